package netpolicy

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
)

// FuzzValidate: Validate and Compile never panic, and a compiled policy
// answers every question without panicking.
func FuzzValidate(f *testing.F) {
	for _, s := range []string{"pypi.org", "*.example.com:443", "[::1]:443", "10.0.0.0/8:22", "*", "a.*.b", "::ffff:1.2.3.4/120", "socks5://u:p@h:1", "https://x/y", "1.2.3", "[", "]:", "/", ":"} {
		f.Add(s, s, s, s)
	}
	f.Fuzz(func(t *testing.T, allow, deny, rule, proxy string) {
		p := api.NetworkPolicy{
			AllowOut:    strings.Split(allow, ","),
			DenyOut:     strings.Split(deny, ","),
			Rules:       []api.HeaderRule{{Domain: rule, SetHeaders: map[string]string{rule: allow}, RemoveHeaders: []string{deny}}},
			EgressProxy: proxy,
		}
		_ = Validate(p)
		_ = Validate(api.NetworkPolicy{AllowPrivate: strings.Split(deny, ",")})
		p.Rules = nil
		pol, err := Compile(p, Options{AllowPrivate: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
		if err != nil {
			return
		}
		for _, n := range []string{rule, allow, "a." + rule} {
			pol.NameAllowed(n)
			pol.Zone(n)
			for _, ip := range []string{"10.1.1.1", "8.8.8.8", "::ffff:127.0.0.1", "2002:a9fe:a9fe::"} {
				pol.Check(n, netip.MustParseAddr(ip), 443)
				pol.UnreachableAnswer(netip.MustParseAddr(ip))
			}
		}
		if a, err := netip.ParseAddr(deny); err == nil {
			pol.Check(rule, a, 1)
			Classify(a)
		}
	})
}
