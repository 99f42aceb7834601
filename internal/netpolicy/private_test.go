package netpolicy

import (
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func TestValidateAllowPrivate(t *testing.T) {
	for _, s := range []string{
		"127.0.0.0/8", "127.0.0.2", "10.0.0.0/8", "169.254.169.254", "fd00::/8", "[fd00::1]", "::ffff:10.0.0.0/104",
		"0.0.0.0/0", // every special range the operator opens (names then lead wherever it does)
	} {
		if err := Validate(api.NetworkPolicy{AllowPrivate: []string{s}}); err != nil {
			t.Errorf("allow_private %q: %v", s, err)
		}
	}
	for s, want := range map[string]string{
		"":                "empty entry",
		"db.internal":     "a name is not allowed",
		"*.internal":      "a name is not allowed",
		"*":               "a name is not allowed",
		"10.0.0.0/8:5432": "a port is not allowed",
		"[fd00::1]:443":   "a port is not allowed",
		"10.0.0.1/8":      "host bits set (did you mean 10.0.0.0/8?)",
		"8.8.8.0/24":      "holds no loopback, private",
		"2001:4860::/32":  "holds no loopback, private",
		"fe80::1%eth0":    "zones",
		"10.0.0.0/33":     "prefix length",
		"10.0.0.0\n":      "control",
	} {
		err := Validate(api.NetworkPolicy{AllowPrivate: []string{"10.0.0.0/8", s}})
		if err == nil {
			t.Errorf("allow_private %q: accepted", s)
			continue
		}
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("allow_private %q: %v does not wrap ErrInvalidArgument", s, err)
		}
		if !strings.HasPrefix(err.Error(), "network.allow_private[1]: ") || !strings.Contains(err.Error(), want) {
			t.Errorf("allow_private %q: %v, want network.allow_private[1]: …%s…", s, err, want)
		}
	}
	many := make([]string, MaxAllowPrivate+1)
	for i := range many {
		many[i] = "10.0.0.0/8"
	}
	if err := Validate(api.NetworkPolicy{AllowPrivate: many}); err == nil || !strings.Contains(err.Error(), "network.allow_private: 257 entries") {
		t.Errorf("too many entries: %v", err)
	}
	// Source keeps it, as written, and is a copy.
	in := api.NetworkPolicy{AllowPrivate: []string{"::ffff:10.0.0.0/104"}}
	pol := mustCompile(t, in, Options{})
	in.AllowPrivate[0] = "127.0.0.0/8"
	if got := pol.Source().AllowPrivate; len(got) != 1 || got[0] != "::ffff:10.0.0.0/104" {
		t.Errorf("Source().AllowPrivate = %v", got)
	}
}

// TestCheckAllowPrivate: the operator's --egress-allow-private is the outer
// limit; inside it, a name entry leads into a special range only through
// the policy's allow_private, while an IP/CIDR entry opens its own range.
func TestCheckAllowPrivate(t *testing.T) {
	o := Options{
		AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.20.0.0/16")},
		Protected:    []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")},
	}
	names := []string{"*.attacker.example", "svc.test", "127.0.0.5/32:5432"}
	without := mustCompile(t, api.NetworkPolicy{AllowOut: names, Internet: true}, o)
	with := mustCompile(t, api.NetworkPolicy{AllowOut: names, AllowPrivate: []string{"127.0.0.2", "10.0.0.0/8"}}, o)
	mapped := mustCompile(t, api.NetworkPolicy{AllowOut: names, AllowPrivate: []string{"::ffff:127.0.0.0/104"}}, o)
	type c struct {
		pol    *Policy
		name   string
		ip     string
		port   uint16
		allow  bool
		reason string
	}
	for i, c := range []c{
		// Without allow_private, an allowed name (whose DNS the attacker
		// controls) leads nowhere special, though the operator opened it.
		{without, "x.attacker.example", "127.0.0.2", 80, false, "loopback address (127.0.0.0/8) not in the sandbox's allow_private"},
		{without, "svc.test", "10.20.1.1", 443, false, "private address (10.0.0.0/8) not in the sandbox's allow_private"},
		{without, "svc.test", "::ffff:127.0.0.2", 443, false, "loopback address (127.0.0.0/8, in ipv4-mapped form) not in the sandbox's allow_private"},
		// ... still public addresses (and internet) as before.
		{without, "x.attacker.example", "8.8.8.8", 443, true, "*.attacker.example"},
		// ... and an IP/CIDR entry opens its own range without allow_private.
		{without, "", "127.0.0.5", 5432, true, "127.0.0.5/32:5432"},
		{without, "svc.test", "127.0.0.5", 5432, true, "127.0.0.5/32:5432"},
		{without, "svc.test", "127.0.0.5", 80, false, "loopback address (127.0.0.0/8) not in the sandbox's allow_private"},
		// Outside the operator's ranges: the class alone, as before.
		{without, "svc.test", "10.30.0.1", 443, false, "private address (10.0.0.0/8)"},
		// With allow_private covering the address: reachable by name.
		{with, "x.attacker.example", "127.0.0.2", 80, true, "*.attacker.example"},
		{with, "svc.test", "::ffff:127.0.0.2", 80, true, "svc.test"},
		{with, "x.attacker.example", "127.0.0.3", 80, false, "loopback address (127.0.0.0/8) not in the sandbox's allow_private"},
		{with, "svc.test", "10.20.1.1", 443, true, "svc.test"},
		// allow_private wider than the operator's range: the operator wins.
		{with, "svc.test", "10.30.0.1", 443, false, "private address (10.0.0.0/8)"},
		// allow_private opens nothing by address alone.
		{with, "", "127.0.0.2", 80, false, "loopback address (127.0.0.0/8)"},
		{with, "", "10.20.1.1", 443, false, "private address (10.0.0.0/8)"},
		// Protected stays protected.
		{with, "svc.test", "127.0.0.1", 80, false, "protected address"},
		// A v4-mapped allow_private is the IPv4 range it is.
		{mapped, "svc.test", "127.0.0.9", 80, true, "svc.test"},
		{mapped, "svc.test", "10.20.1.1", 80, false, "private address (10.0.0.0/8) not in the sandbox's allow_private"},
	} {
		v := c.pol.Check(c.name, netip.MustParseAddr(c.ip), c.port)
		if v.Allow != c.allow || v.Reason != c.reason {
			t.Errorf("%d: Check(%q, %s, %d) = %+v, want allow=%v %q", i, c.name, c.ip, c.port, v, c.allow, c.reason)
		}
		if v.Allow && c.name != "" && v.Reason == c.name && !v.ByName {
			t.Errorf("%d: allowed by a name without ByName: %+v", i, v)
		}
	}
}

// TestUnreachableAnswer: what the gateway's DNS filter removes from an
// allowed name's answer.
func TestUnreachableAnswer(t *testing.T) {
	o := Options{
		AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.20.0.0/16")},
		Protected:    []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0"), netip.MustParseAddrPort("127.0.0.9:7070")},
	}
	without := mustCompile(t, api.NetworkPolicy{AllowOut: []string{"*.attacker.example", "127.0.0.5/32:5432", "0.0.0.0/0"}, Internet: true}, o)
	with := mustCompile(t, api.NetworkPolicy{AllowOut: []string{"*.attacker.example"}, AllowPrivate: []string{"127.0.0.2", "10.0.0.0/8"}}, o)
	for _, c := range []struct {
		pol  *Policy
		ip   string
		want string
	}{
		{without, "8.8.8.8", ""},
		{without, "127.0.0.2", "loopback address not in the sandbox's allow_private"},
		{without, "::ffff:127.0.0.2", "loopback address not in the sandbox's allow_private"},
		{without, "10.20.1.1", "private address not in the sandbox's allow_private"},
		{without, "127.0.0.5", ""}, // its own CIDR entry opens it (any port: Check decides which)
		{without, "10.30.0.1", "private"},
		{without, "169.254.169.254", "link-local"},
		{without, "127.0.0.1", "protected address"},
		{without, "127.0.0.9", "protected address"}, // any port of it
		{with, "127.0.0.2", ""},
		{with, "127.0.0.3", "loopback address not in the sandbox's allow_private"},
		{with, "10.20.1.1", ""},
		{with, "10.30.0.1", "private"}, // outside the operator's ranges
		{with, "127.0.0.1", "protected address"},
	} {
		if got := c.pol.UnreachableAnswer(netip.MustParseAddr(c.ip)); got != c.want {
			t.Errorf("UnreachableAnswer(%s) = %q, want %q", c.ip, got, c.want)
		}
	}
	var nilPol *Policy
	if nilPol.UnreachableAnswer(netip.MustParseAddr("8.8.8.8")) == "" {
		t.Error("a nil policy lets an answer through")
	}
}
