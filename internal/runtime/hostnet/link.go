// Package hostnet creates a sandbox's one virtual NIC on the host side: a TAP
// device inside the sandbox's network namespace, configured with the link
// addressing below, whose descriptor the network gateway serves.
//
// The addresses exist only on the virtual link between one sandbox and its
// own user-space stack in the gateway: they are never routed on the host,
// and every sandbox uses the same ones (each has a stack of its own, so two
// sandboxes can never reach each other).
package hostnet

// Link addressing (RFC 2544's benchmarking range: never routed publicly and
// unlikely to be a destination an operator allows).
const (
	SandboxAddr = "198.18.0.2"
	GatewayAddr = "198.18.0.1"
	PrefixLen   = 30
	// MTU is large: the link is virtual, and every frame costs a system
	// call on each side, so fewer, larger frames are what makes bulk
	// transfers fast (1500: ~0.05× the host's own download speed).
	MTU        = 65520
	IfName     = "eth0"
	SandboxMAC = "02:5a:ce:00:00:02"
	GatewayMAC = "02:5a:ce:00:00:01"
)

// ResolvConf is the sandbox's /etc/resolv.conf: the gateway is its only
// resolver.
const ResolvConf = "nameserver " + GatewayAddr + "\noptions edns0 trust-ad\n"
