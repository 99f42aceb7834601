package netpolicy

import (
	"fmt"
	"net/netip"
)

// special is one address range no sandbox reaches by default.
type special struct {
	prefix netip.Prefix
	class  string
}

func mustSpecial(list [][2]string) []special {
	out := make([]special, len(list))
	for i, e := range list {
		out[i] = special{netip.MustParsePrefix(e[0]), e[1]}
	}
	return out
}

// v4Special is IANA's IPv4 special-purpose registry minus the ranges that
// are globally reachable (AS112, AMT), plus documentation ranges (nothing
// legitimate lives there, and they are what attackers put in tests).
// Order matters only for the broadcast address inside 240.0.0.0/4.
var v4Special = mustSpecial([][2]string{
	{"0.0.0.0/8", "unspecified"},
	{"10.0.0.0/8", "private"},
	{"100.64.0.0/10", "cgnat"},
	{"127.0.0.0/8", "loopback"},
	{"169.254.0.0/16", "link-local"},
	{"172.16.0.0/12", "private"},
	{"192.0.0.0/24", "reserved"},
	{"192.0.2.0/24", "documentation"},
	{"192.88.99.0/24", "reserved"}, // deprecated 6to4 relay anycast
	{"192.168.0.0/16", "private"},
	{"198.18.0.0/15", "benchmark"}, // also the sandbox↔gateway link
	{"198.51.100.0/24", "documentation"},
	{"203.0.113.0/24", "documentation"},
	{"224.0.0.0/4", "multicast"},
	{"255.255.255.255/32", "broadcast"},
	{"240.0.0.0/4", "reserved"},
})

// v6Special are the IPv6 ranges refused outright. Forms that embed an IPv4
// address are handled by embeddedV4 before these, and anything outside
// 2000::/3 (the only global unicast space allocated) is "reserved".
var v6Special = mustSpecial([][2]string{
	{"::/128", "unspecified"},
	{"::1/128", "loopback"},
	{"100::/64", "discard"},
	{"64:ff9b:1::/48", "reserved"}, // local-use NAT64 (RFC 8215)
	{"2001::/23", "reserved"},      // IETF protocol assignments, Teredo
	{"2001:db8::/32", "documentation"},
	{"3fff::/20", "documentation"},
	{"fc00::/7", "private"},
	{"fec0::/10", "private"}, // deprecated site-local
	{"fe80::/10", "link-local"},
	{"ff00::/8", "multicast"},
})

var (
	globalUnicast6 = netip.MustParsePrefix("2000::/3")
	mapped6        = netip.MustParsePrefix("::ffff:0:0/96")
	compat6        = netip.MustParsePrefix("::/96")
	nat646         = netip.MustParsePrefix("64:ff9b::/96")
	sixToFour6     = netip.MustParsePrefix("2002::/16")
)

// classInfo says why an address is special: its class, the range, and
// (for IPv6 forms that embed an IPv4 address) which form.
type classInfo struct {
	class  string
	prefix netip.Prefix
	via    string
}

func (c classInfo) reason() string {
	if c.via != "" {
		return fmt.Sprintf("%s address (%s, in %s form)", c.class, c.prefix, c.via)
	}
	if !c.prefix.IsValid() {
		return c.class + " address"
	}
	return fmt.Sprintf("%s address (%s)", c.class, c.prefix)
}

// embeddedV4 returns the IPv4 address an IPv6 address carries, for the
// forms that route to it: IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible
// (::a.b.c.d, deprecated), NAT64 (64:ff9b::a.b.c.d) and 6to4
// (2002:aabb:ccdd::).
func embeddedV4(ip netip.Addr) (netip.Addr, string, bool) {
	if !ip.Is6() {
		return netip.Addr{}, "", false
	}
	b := ip.As16()
	last := netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
	switch {
	case mapped6.Contains(ip):
		return last, "ipv4-mapped", true
	case nat646.Contains(ip):
		return last, "nat64", true
	case sixToFour6.Contains(ip):
		return netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]}), "6to4", true
	case compat6.Contains(ip) && ip != netip.IPv6Unspecified() && ip != netip.IPv6Loopback():
		return last, "ipv4-compatible", true
	}
	return netip.Addr{}, "", false
}

func classifyV4(ip netip.Addr) classInfo {
	for _, s := range v4Special {
		if s.prefix.Contains(ip) {
			return classInfo{class: s.class, prefix: s.prefix}
		}
	}
	return classInfo{}
}

// classify is Classify with the range and form, for verdict reasons.
func classify(ip netip.Addr) classInfo {
	if !ip.IsValid() {
		return classInfo{class: "invalid"}
	}
	ip = ip.WithZone("")
	if ip.Is4() {
		return classifyV4(ip)
	}
	if v4, via, ok := embeddedV4(ip); ok {
		c := classifyV4(v4)
		if c.class != "" {
			c.via = via
		}
		return c
	}
	for _, s := range v6Special {
		if s.prefix.Contains(ip) {
			return classInfo{class: s.class, prefix: s.prefix}
		}
	}
	if !globalUnicast6.Contains(ip) {
		return classInfo{class: "reserved"} // not in 2000::/3
	}
	return classInfo{}
}

// Classify says whether ip is never reachable by default and why:
// "loopback", "private", "cgnat", "link-local", "multicast", "unspecified",
// "broadcast", "reserved", "benchmark", "documentation", "discard" (or
// "invalid" for the zero Addr). Public addresses return "". IPv6 forms that
// embed an IPv4 address (IPv4-mapped, IPv4-compatible, NAT64 64:ff9b::/96,
// 6to4 2002::/16) are classified by the embedded address, so
// ::ffff:127.0.0.1 is "loopback". IPv6 outside 2000::/3 is "reserved".
func Classify(ip netip.Addr) string { return classify(ip).class }
