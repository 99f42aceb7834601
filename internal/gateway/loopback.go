package gateway

import "net/netip"

// The host's loopback cannot be addressed from inside a sandbox: there,
// 127.0.0.0/8 is the sandbox's own. When the operator opens a loopback
// range (--egress-allow-private 127.0.0.0/8, how tests stand in "the
// internet" with local servers), the sandbox reaches 127.0.x.y of the host
// as 198.19.x.y: DNS answers are rewritten to the alias, connections to the
// alias are decided and dialled as the loopback address they stand for.
// Nothing else is ever translated.
var loopbackAlias = netip.MustParsePrefix("198.19.0.0/16")

// toHost returns the host address a sandbox-side destination stands for.
func toHost(ip netip.Addr) netip.Addr {
	if loopbackAlias.Contains(ip) {
		b := ip.As4()
		return netip.AddrFrom4([4]byte{127, 0, b[2], b[3]})
	}
	return ip
}

// toSandbox returns the address a sandbox must use to reach host address
// ip, or false if it has none (loopback beyond 127.0.255.255).
func toSandbox(ip netip.Addr) (netip.Addr, bool) {
	if !ip.Is4() {
		return ip, false
	}
	b := ip.As4()
	if b[0] == 127 {
		if b[1] != 0 {
			return ip, false
		}
		return netip.AddrFrom4([4]byte{198, 19, b[2], b[3]}), true
	}
	return ip, true
}
