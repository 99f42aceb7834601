package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func pfx(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func TestSubset(t *testing.T) {
	open10 := Options{AllowPrivate: pfx("10.0.0.0/8")}
	type tc struct {
		name string
		p, b api.NetworkPolicy
		o    Options
		// want: one "field: reason substring" per violation, in order;
		// empty: p is inside b.
		want []string
	}
	allow := func(es ...string) api.NetworkPolicy { return api.NetworkPolicy{AllowOut: es} }
	with := func(p api.NetworkPolicy, f func(*api.NetworkPolicy)) api.NetworkPolicy { f(&p); return p }
	cases := []tc{
		{name: "nothing in nothing", p: api.NetworkPolicy{}, b: api.NetworkPolicy{}},
		{name: "nothing in anything", p: api.NetworkPolicy{}, b: allow("8.8.8.8")},
		{name: "same", p: allow("8.8.8.8:53", "*.example.com", "10.0.0.0/8"), b: allow("8.8.8.8:53", "*.example.com", "10.0.0.0/8"), o: open10},

		// CIDRs: exact interval arithmetic over unions.
		{name: "/16 in two /17s", p: allow("8.8.0.0/16"), b: allow("8.8.128.0/17", "8.8.0.0/17")},
		{name: "/16 in /17 + /18 + /18", p: allow("8.8.0.0/16"), b: allow("8.8.0.0/17", "8.8.128.0/18", "8.8.192.0/18")},
		{name: "/16 not in /17 + /18", p: allow("10.0.0.0/8:443"), b: allow("10.0.0.0/9", "10.128.0.0/10"), o: open10,
			want: []string{`network.allow_out[0]|"10.0.0.0/8:443": 10.192.0.0/10 (and IPv6 forms that embed IPv4 addresses) on port 443 is outside the boundary (its allow_out there: 10.0.0.0/9, 10.128.0.0/10)`}},
		{name: "IP in CIDR", p: allow("8.8.8.8:443", "[2001:4860::8888]:443"), b: allow("8.8.8.0/24", "2001:4860::/32")},
		{name: "IPv4-mapped entry is the IPv4 one", p: allow("::ffff:8.8.8.0/120"), b: allow("8.8.8.0/24")},
		{name: "IPv6 not in IPv4", p: allow("2001:4860::8888"), b: allow("0.0.0.0/0"),
			want: []string{"network.allow_out[0]|2001:4860::8888/128 on any port is outside the boundary (it allows no address there)"}},
		{name: "IPv6 in two halves", p: allow("::/0"), b: allow("::/1", "8000::/1")},
		{name: "IPv6 outside 2000::/3 is reserved", p: allow("::/0"), b: allow("::/1")},
		{name: "IPv6 half missing", p: allow("2001:4860::/32"), b: allow("2001:4860::/33"),
			want: []string{"network.allow_out[0]|2001:4860:8000::/33 on any port is outside the boundary"}},

		// Ports.
		{name: "port in all ports", p: allow("8.8.8.8:443"), b: allow("8.8.8.0/24")},
		{name: "all ports not in one", p: allow("8.8.8.8"), b: allow("8.8.8.8:443"),
			want: []string{"network.allow_out[0]|8.8.8.8/32 (and IPv6 forms that embed IPv4 addresses) on any port but 443 is outside the boundary (its allow_out there: 8.8.8.8:443)"}},
		{name: "other port", p: allow("8.8.8.8:22"), b: allow("8.8.8.8:443", "8.8.8.8:80"),
			want: []string{"network.allow_out[0]|on port 22 is outside the boundary (its allow_out there: 8.8.8.8:443, 8.8.8.8:80)"}},
		{name: "port union", p: allow("8.8.8.0/24:443"), b: allow("8.8.8.0/25:443", "8.8.8.128/25")},

		// Names.
		{name: "exact in exact", p: allow("api.example.com"), b: allow("api.example.com")},
		{name: "case and trailing dot", p: allow("API.Example.COM."), b: allow("api.example.com")},
		{name: "exact in wildcard", p: allow("a.b.example.com"), b: allow("*.example.com")},
		{name: "wildcard in wildcard", p: allow("*.x.example.com"), b: allow("*.example.com")},
		{name: "wildcard not in narrower wildcard", p: allow("*.example.com"), b: allow("*.x.example.com"),
			want: []string{"network.allow_out[0]|the boundary does not allow resolving a.example.com"}},
		{name: "apex not in wildcard", p: allow("example.com"), b: allow("*.example.com"),
			want: []string{"network.allow_out[0]|the boundary does not allow resolving example.com"}},
		{name: "wildcard not in exacts", p: allow("*.example.com"), b: allow("a.example.com", "b.example.com"),
			want: []string{"network.allow_out[0]|the boundary does not allow resolving c.example.com"}},
		{name: "wildcard in wildcard minus nothing", p: allow("*.example.com", "a.example.com"), b: allow("*.example.com", "*.a.example.com")},
		{name: "name on its port", p: allow("api.example.com:443"), b: allow("*.example.com:443")},
		{name: "name on all ports not in one", p: allow("api.example.com"), b: allow("api.example.com:443"),
			want: []string{"network.allow_out[0]|api.example.com on any port but 443 is not allowed by the boundary"}},
		{name: "name with port is any protocol", p: allow("api.example.com:443"), b: allow("api.example.com"),
			want: []string{"network.allow_out[0]|with a port, this entry lets any protocol reach api.example.com on port 443; the boundary's api.example.com has no port"}},
		{name: "internet covers a name's public addresses", p: allow("api.example.com:443"), b: api.NetworkPolicy{Internet: true}},
		{name: "internet covers a name without a port", p: allow("api.example.com"), b: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, Internet: true}},
		{name: "but not the private addresses it may resolve to", p: api.NetworkPolicy{AllowOut: []string{"api.example.com:443"}, AllowPrivate: []string{"10.0.0.0/8"}},
			b: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, Internet: true, AllowPrivate: []string{"10.0.0.0/8"}}, o: open10,
			want: []string{"network.allow_out[0]|with a port, this entry lets any protocol reach api.example.com on port 443"}},
		{name: "internet alone: no private for a name", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, AllowPrivate: []string{"10.0.0.0/8"}},
			b: api.NetworkPolicy{Internet: true, AllowPrivate: []string{"10.0.0.0/8"}}, o: open10,
			want: []string{"network.allow_out[0]|api.example.com on any port is not allowed by the boundary (its allow_out does not name it there, nor cover every address it may resolve to: 10.0.0.0/8 (and IPv6 forms"}},

		// deny_out must bind p wherever p reaches.
		{name: "name reaching the boundary's deny", p: allow("api.example.com"), b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, DenyOut: []string{"1.2.3.0/24"}},
			want: []string{"network.allow_out[0]|api.example.com may resolve to 1.2.3.0/24 (and IPv6 forms that embed IPv4 addresses) on any port, which the boundary's deny_out 1.2.3.0/24 refuses; add it to deny_out"}},
		{name: "name with the boundary's deny", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, DenyOut: []string{"1.2.3.0/25", "1.2.3.128/25"}},
			b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, DenyOut: []string{"1.2.3.0/24"}}},
		{name: "name with half the boundary's deny", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, DenyOut: []string{"1.2.3.0/25"}},
			b:    api.NetworkPolicy{AllowOut: []string{"*.example.com"}, DenyOut: []string{"1.2.3.0/24"}},
			want: []string{"network.allow_out[0]|api.example.com may resolve to 1.2.3.128/25 (and"}},
		{name: "deny on another port", p: api.NetworkPolicy{AllowOut: []string{"api.example.com:443"}},
			b: api.NetworkPolicy{AllowOut: []string{"*.example.com:443"}, DenyOut: []string{"1.2.3.0/24:22"}}},
		{name: "deny on a port", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}},
			b:    api.NetworkPolicy{AllowOut: []string{"*.example.com"}, DenyOut: []string{"1.2.3.0/24:22"}},
			want: []string{"network.allow_out[0]|api.example.com may resolve to 1.2.3.0/24 (and IPv6 forms that embed IPv4 addresses) on port 22, which the boundary's deny_out 1.2.3.0/24:22 refuses"}},
		{name: "deny on a port, copied", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, DenyOut: []string{"1.2.3.0/24:22"}},
			b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, DenyOut: []string{"1.2.3.0/24:22"}}},
		{name: "CIDR clear of the deny", p: allow("8.8.8.0/24"), b: api.NetworkPolicy{AllowOut: []string{"8.0.0.0/8"}, DenyOut: []string{"8.8.4.0/24"}}},
		{name: "CIDR over the deny", p: allow("8.8.0.0/16"), b: api.NetworkPolicy{AllowOut: []string{"8.0.0.0/8"}, DenyOut: []string{"8.8.4.0/24"}},
			want: []string{"network.allow_out[0]|8.8.4.0/24 (and IPv6 forms that embed IPv4 addresses) on any port is refused by the boundary's deny_out 8.8.4.0/24; add it to deny_out"}},
		{name: "deny of an IPv4-mapped range", p: allow("8.8.8.8"), b: api.NetworkPolicy{AllowOut: []string{"8.8.8.8"}, DenyOut: []string{"::fffe:0:0/95"}},
			want: []string{"network.allow_out[0]|: ::ffff:8.8.8.8/128 on any port is refused by the boundary's deny_out ::fffe:0:0/95"}},
		{name: "deny of a 6to4 form", p: allow("2002::/16"), b: api.NetworkPolicy{AllowOut: []string{"2002::/16"}, DenyOut: []string{"8.8.8.8"}},
			want: []string{"network.allow_out[0]|: 2002:808:808::/48 on any port is refused by the boundary's deny_out 8.8.8.8"}},
		{name: "deny of a 6to4 form, covered", p: api.NetworkPolicy{AllowOut: []string{"2002::/16"}, DenyOut: []string{"2002:808:808::/48"}},
			b: api.NetworkPolicy{AllowOut: []string{"2002::/16"}, DenyOut: []string{"8.8.8.8"}}},

		// internet.
		{name: "internet in internet", p: api.NetworkPolicy{Internet: true}, b: api.NetworkPolicy{Internet: true}},
		{name: "internet not in CIDRs", p: api.NetworkPolicy{Internet: true}, b: allow("0.0.0.0/0", "::/0"),
			want: []string{`network.internet|"true": the boundary does not allow internet`}},
		{name: "internet with the boundary's deny", p: api.NetworkPolicy{Internet: true}, b: api.NetworkPolicy{Internet: true, DenyOut: []string{"8.8.8.8:53"}},
			want: []string{"network.internet|8.8.8.8/32 (and IPv6 forms that embed IPv4 addresses) on port 53 is refused by the boundary's deny_out 8.8.8.8:53"}},
		{name: "public CIDR in internet", p: allow("8.8.8.0/24", "2001:4860::/32"), b: api.NetworkPolicy{Internet: true}},
		{name: "private CIDR not in internet", p: allow("10.1.0.0/16"), b: api.NetworkPolicy{Internet: true}, o: open10,
			want: []string{"network.allow_out[0]|10.1.0.0/16 (and IPv6 forms that embed IPv4 addresses) on any port is outside the boundary (it allows no address there); a special range"}},

		// The operator's AllowPrivate decides what a CIDR opens.
		{name: "private in private", p: allow("10.1.2.3:5432"), b: allow("10.0.0.0/8"), o: open10},
		{name: "private, nothing opened", p: allow("10.1.2.3:5432"), b: allow("10.0.0.0/8")},
		{name: "private, boundary wider than the opened range", p: allow("10.1.2.3:5432"), b: allow("10.0.0.0/8"), o: Options{AllowPrivate: pfx("10.1.0.0/16")},
			want: []string{"network.allow_out[0]|10.1.2.3/32 (and IPv6 forms that embed IPv4 addresses) on port 5432 is outside the boundary (its allow_out there: 10.0.0.0/8); a special range"}},
		{name: "0/0 opens no private space", p: allow("10.0.0.0/8"), b: allow("0.0.0.0/0"), o: open10,
			want: []string{"network.allow_out[0]|10.0.0.0/8 (and IPv6 forms that embed IPv4 addresses) on any port is outside the boundary (its allow_out there: 0.0.0.0/0); a special range"}},
		{name: "0/0 in 0/0, nothing opened", p: allow("0.0.0.0/0"), b: allow("0.0.0.0/0")},
		{name: "0/0 not in public ranges", p: allow("0.0.0.0/0"), b: api.NetworkPolicy{Internet: true}},

		// allow_private: the boundary's must cover p's (its special addresses).
		{name: "allow_private in the boundary's", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, AllowPrivate: []string{"10.1.0.0/16"}},
			b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, AllowPrivate: []string{"10.0.0.0/8"}}, o: open10},
		{name: "allow_private in two halves", p: api.NetworkPolicy{AllowPrivate: []string{"10.0.0.0/8"}}, b: api.NetworkPolicy{AllowPrivate: []string{"10.128.0.0/9", "::ffff:10.0.0.0/105"}}},
		{name: "allow_private the boundary does not list", p: api.NetworkPolicy{AllowOut: []string{"api.example.com"}, AllowPrivate: []string{"10.0.0.0/8"}},
			b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}}, o: open10,
			want: []string{`network.allow_private[0]|"10.0.0.0/8": 10.0.0.0/8 (and IPv6 forms that embed IPv4 addresses) is outside the boundary's allow_private (it lists none: no name may lead into loopback, private or other special ranges)`}},
		{name: "allow_private half outside", p: api.NetworkPolicy{AllowPrivate: []string{"127.0.0.0/8", "10.0.0.0/8"}}, b: api.NetworkPolicy{AllowPrivate: []string{"127.0.0.0/8", "10.0.0.0/9"}},
			want: []string{`network.allow_private[1]|10.128.0.0/9 (and IPv6 forms that embed IPv4 addresses) is outside the boundary's allow_private (127.0.0.0/8, 10.0.0.0/9)`}},
		{name: "allow_private: only special addresses count", p: api.NetworkPolicy{AllowPrivate: []string{"0.0.0.0/0"}}, b: api.NetworkPolicy{AllowPrivate: []string{"0.0.0.0/0"}}},
		{name: "allow_private everything, a boundary of one range", p: api.NetworkPolicy{AllowPrivate: []string{"0.0.0.0/0"}}, b: api.NetworkPolicy{AllowPrivate: []string{"10.0.0.0/8"}},
			want: []string{`network.allow_private[0]|0.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8 and more (and IPv6 forms that embed IPv4 addresses) is outside the boundary's allow_private (10.0.0.0/8)`}},
		// Compared as written: nothing opened, no name of p there, still refused.
		{name: "allow_private with nothing opened", p: api.NetworkPolicy{AllowPrivate: []string{"10.0.0.0/8"}},
			want: []string{"network.allow_private[0]|is outside the boundary's allow_private (it lists none"}},
		// A boundary's allow_private lets its own names lead further than p's.
		{name: "p's names lead nowhere private", p: allow("api.example.com"), b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, AllowPrivate: []string{"10.0.0.0/8"}}, o: open10},
		// Without allow_private, a name cannot reach the private ranges
		// the boundary's internet and CIDRs do not cover.
		{name: "internet covers a name that leads into no private range", p: allow("api.example.com"), b: api.NetworkPolicy{Internet: true}, o: open10},
		{name: "a port-named name in a private range", p: api.NetworkPolicy{AllowOut: []string{"db.example.com:5432"}, AllowPrivate: []string{"10.1.0.0/16"}},
			b: api.NetworkPolicy{AllowOut: []string{"db.example.com"}, AllowPrivate: []string{"10.0.0.0/8"}}, o: open10,
			want: []string{"network.allow_out[0]|with a port, this entry lets any protocol reach db.example.com on port 5432"}},

		// egress_proxy.
		{name: "same proxy", p: api.NetworkPolicy{EgressProxy: "socks5://u:p@127.0.0.9:1080"}, b: api.NetworkPolicy{EgressProxy: "socks5://u:p@127.0.0.9:1080"}},
		{name: "proxy of its own", p: api.NetworkPolicy{EgressProxy: "socks5://u:secret@proxy.example.com:1080"},
			want: []string{`network.egress_proxy|"socks5://proxy.example.com:1080": the boundary sets no egress proxy`}},
		{name: "no proxy under one", b: api.NetworkPolicy{EgressProxy: "socks5://127.0.0.9:1080"},
			want: []string{"network.egress_proxy|: the boundary sends every connection through its egress proxy"}},
		{name: "other credentials", p: api.NetworkPolicy{EgressProxy: "socks5h://u:other@127.0.0.9:1080"}, b: api.NetworkPolicy{EgressProxy: "socks5h://u:p@127.0.0.9:1080"},
			want: []string{`network.egress_proxy|"socks5h://127.0.0.9:1080": differs from the boundary's`}},

		// Header rules.
		{name: "rule on an allowed domain", p: with(allow("api.example.com"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "api.example.com", SetHeaders: map[string]string{"X-A": "1"}}}
		}), b: allow("*.example.com")},
		{name: "rule on a domain outside", p: api.NetworkPolicy{Internet: true, Rules: []api.HeaderRule{{Domain: "*.other.com", RemoveHeaders: []string{"X-A"}}}},
			b: api.NetworkPolicy{AllowOut: []string{"*.other.com"}, Internet: true}},
		{name: "wildcard rule on a narrower boundary", p: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, Rules: []api.HeaderRule{{Domain: "*.example.com", RemoveHeaders: []string{"X-A"}}}},
			b: api.NetworkPolicy{AllowOut: []string{"*.example.com"}, Rules: []api.HeaderRule{{Domain: "*.example.com", RemoveHeaders: []string{"X-A"}}}}},
		{name: "rule domain not in the boundary", p: with(allow("*.example.com"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "*.example.com", SetHeaders: map[string]string{"X-A": "1"}}}
		}), b: allow("*.a.example.com"), want: []string{
			"network.allow_out[0]|the boundary does not allow resolving a.example.com",
			`network.rules[0].domain|"*.example.com": the boundary does not allow this domain`,
		}},
		{name: "rule overriding the boundary's", p: with(allow("api.example.com"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "api.example.com", SetHeaders: map[string]string{"x-tenant": "team-b", "X-Other": "1"}, RemoveHeaders: []string{"Authorization"}}}
		}), b: with(allow("*.example.com"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "*.example.com", SetHeaders: map[string]string{"X-Tenant": "team-a", "Authorization": "Bearer x"}}}
		}), want: []string{
			`network.rules[0].set_headers["x-tenant"]|"x-tenant": the boundary's rule for *.example.com sets or removes this header`,
			`network.rules[0].remove_headers[0]|"Authorization": the boundary's rule for *.example.com`,
		}},
		{name: "rule repeating the boundary's", p: with(allow("api.example.com"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "api.example.com", SetHeaders: map[string]string{"x-tenant": "team-a"}}}
		}), b: with(allow("*.example.com"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "*.example.com", SetHeaders: map[string]string{"X-Tenant": "team-a"}}}
		})},
		{name: "rule on another domain", p: with(allow("api.example.org"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "api.example.org", SetHeaders: map[string]string{"x-tenant": "team-b"}}}
		}), b: with(allow("*.example.com", "*.example.org"), func(p *api.NetworkPolicy) {
			p.Rules = []api.HeaderRule{{Domain: "*.example.com", SetHeaders: map[string]string{"X-Tenant": "team-a"}}}
		})},

		// Invalid input.
		{name: "invalid policy", p: allow("*"), want: []string{`network|network.allow_out[0]: "*": bare "*" is not allowed`}},
		{name: "invalid boundary", b: allow("*"), want: []string{"network|the boundary is not a valid policy"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			vs := Subset(c.p, c.b, c.o)
			var got []string
			for _, v := range vs {
				got = append(got, v.String())
			}
			if len(got) != len(c.want) {
				t.Fatalf("got %d violations, want %d:\n%s", len(got), len(c.want), strings.Join(got, "\n"))
			}
			for i, w := range c.want {
				field, reason, _ := strings.Cut(w, "|")
				if !strings.HasPrefix(got[i], field+" ") && !strings.HasPrefix(got[i], field+":") || !strings.Contains(got[i], reason) {
					t.Errorf("violation %d:\n got %s\nwant %s", i, got[i], w)
				}
			}
			if strings.Contains(strings.Join(got, " "), "secret") {
				t.Errorf("a violation quotes a credential: %s", got)
			}
			// Every violation Check can observe carries its proof.
			cp, errP := Compile(c.p, c.o)
			cb, errB := Compile(c.b, c.o)
			for _, v := range vs {
				if v.w.kind == noWitness || errP != nil || errB != nil {
					continue
				}
				if msg := checkWitness(v, cp, cb); msg != "" {
					t.Errorf("%s: %s", v, msg)
				}
			}
		})
	}
}

// TestSubsetAllowPrivateWitness: where a name of p leads into p's extra
// private range, the violation carries that connection.
func TestSubsetAllowPrivateWitness(t *testing.T) {
	o := Options{AllowPrivate: pfx("127.0.0.0/8")}
	p := api.NetworkPolicy{AllowOut: []string{"*.attacker.example"}, AllowPrivate: []string{"127.0.0.0/8"}}
	b := api.NetworkPolicy{AllowOut: []string{"*.attacker.example", "127.0.0.2:80"}, AllowPrivate: []string{"127.0.0.0/24"}}
	vs := Subset(p, b, o)
	if len(vs) != 1 || vs[0].Field != "network.allow_private[0]" || !strings.Contains(vs[0].Reason, "127.0.1.0/24") {
		t.Fatalf("got %v", vs)
	}
	w := vs[0].w
	if a := w.addr.Unmap(); w.kind != connWitness || w.name == "" || !netip.MustParsePrefix("127.0.0.0/8").Contains(a) || netip.MustParsePrefix("127.0.0.0/24").Contains(a) {
		t.Fatalf("witness %+v", w)
	}
	if msg := checkWitness(vs[0], mustCompile(t, p, o), mustCompile(t, b, o)); msg != "" {
		t.Fatal(msg)
	}
	if err := SubsetError(vs); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `network.allow_private[0] "127.0.0.0/8"`) {
		t.Fatalf("SubsetError: %v", err)
	}
}

func TestSubsetError(t *testing.T) {
	if err := SubsetError(nil); err != nil {
		t.Fatal(err)
	}
	err := SubsetError(Subset(api.NetworkPolicy{AllowOut: []string{"8.8.8.8", "example.com"}}, api.NetworkPolicy{}, Options{}))
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("%v is not an invalid argument", err)
	}
	for _, s := range []string{`network.allow_out[0] "8.8.8.8"`, `network.allow_out[1] "example.com"`, "exceeds the tenant's boundary"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("%v lacks %q", err, s)
		}
	}
}

// TestSpecialSet: the special set agrees with Classify at and around the
// edge of every range Classify knows, in every form.
func TestSpecialSet(t *testing.T) {
	s := specialSet()
	in := func(a netip.Addr) bool {
		v6, k := addrKey(a)
		sp := s.v4
		if v6 {
			sp = s.v6
		}
		return !addrSet{v4: sp}.intersect(addrSet{v4: spans{{k, k}}}).empty()
	}
	u := buildUniverse(t)
	for _, a := range u.addrs {
		if got, want := in(a), Classify(a) != ""; got != want {
			t.Errorf("%s: in the special set %v, Classify %q", a, got, Classify(a))
		}
	}
	if len(u.addrs) < 400 {
		t.Fatalf("only %d addresses tried", len(u.addrs))
	}
}

func TestRangePrefixes(t *testing.T) {
	for _, c := range []struct{ lo, hi, want string }{
		{"10.192.0.0", "10.255.255.255", "[10.192.0.0/10]"},
		{"10.0.0.1", "10.0.0.6", "[10.0.0.1/32 10.0.0.2/31 10.0.0.4/31 10.0.0.6/32]"},
		{"0.0.0.0", "255.255.255.255", "[0.0.0.0/0]"},
		{"::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "[::/0]"},
		{"8000::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "[8000::/1]"},
		{"::1", "::2", "[::1/128 ::2/128]"},
	} {
		v6, lo := addrKey(netip.MustParseAddr(c.lo))
		_, hi := addrKey(netip.MustParseAddr(c.hi))
		if got := fmt.Sprint(rangePrefixes(v6, span{lo, hi})); got != c.want {
			t.Errorf("%s-%s: %s, want %s", c.lo, c.hi, got, c.want)
		}
	}
}

// bigPolicies are as large as Validate allows, with every entry on its
// own port: the worst case for the number of port atoms.
func bigPolicies() (api.NetworkPolicy, api.NetworkPolicy) {
	var p, b api.NetworkPolicy
	for i := 0; i < MaxAllowOut; i++ {
		p.AllowOut = append(p.AllowOut, fmt.Sprintf("8.%d.%d.0/24:%d", i/256, i%256, 1000+i))
		b.AllowOut = append(b.AllowOut, fmt.Sprintf("8.%d.0.0/16:%d", i/256, 1000+i))
	}
	for i := 0; i < MaxDenyOut; i++ {
		p.DenyOut = append(p.DenyOut, fmt.Sprintf("9.%d.%d.0/24", i/256, i%256))
		b.DenyOut = append(b.DenyOut, fmt.Sprintf("[2600:%x::/32]:%d", i, 3000+i))
	}
	p.AllowOut[0] = "*.example.com"
	b.AllowOut[0] = "*.example.com"
	return p, b
}

// worstPolicies are other shapes of the largest policies: every entry of
// p outside a boundary whose entries each name their own port (so every
// entry of p fails on every port), and names against names.
func worstPolicies() [][2]api.NetworkPolicy {
	var p1, b1, p2, b2 api.NetworkPolicy
	for i := 0; i < MaxAllowOut; i++ {
		p1.AllowOut = append(p1.AllowOut, fmt.Sprintf("7.%d.%d.0/24", i/256, i%256))
		b1.AllowOut = append(b1.AllowOut, fmt.Sprintf("n%d.example.com:%d", i, 1000+i))
		p2.AllowOut = append(p2.AllowOut, fmt.Sprintf("*.n%d.example.com", i))
		b2.AllowOut = append(b2.AllowOut, fmt.Sprintf("a.n%d.example.com:%d", i, 1000+i))
	}
	for i := 0; i < MaxDenyOut; i++ {
		p1.DenyOut = append(p1.DenyOut, fmt.Sprintf("9.%d.%d.0/24", i/256, i%256))
		b1.DenyOut = append(b1.DenyOut, fmt.Sprintf("7.%d.%d.0/25:%d", i/256, i%256, 3000+i))
		b2.DenyOut = append(b2.DenyOut, fmt.Sprintf("8.%d.%d.0/24:%d", i/256, i%256, 3000+i))
	}
	b2.Internet = true
	return [][2]api.NetworkPolicy{{p1, b1}, {p2, b2}}
}

func TestSubsetLargeIsBounded(t *testing.T) {
	p, b := bigPolicies()
	pairs := [][2]api.NetworkPolicy{{p, b}}
	if !testing.Short() {
		pairs = append(pairs, worstPolicies()...)
	}
	for i, pb := range pairs {
		start := time.Now()
		vs := Subset(pb[0], pb[1], Options{AllowPrivate: pfx("10.0.0.0/8")})
		d := time.Since(start)
		t.Logf("shape %d, %d+%d entries each: %v, %d violations", i, MaxAllowOut, MaxDenyOut, d, len(vs))
		if d > 20*time.Second {
			t.Fatalf("took %v", d)
		}
	}
}

func BenchmarkSubset(b *testing.B) {
	small := api.NetworkPolicy{AllowOut: []string{"api.example.com", "*.pypi.org", "10.1.2.3:5432", "8.8.8.8:53"}, DenyOut: []string{"1.2.3.0/24"}}
	bound := api.NetworkPolicy{AllowOut: []string{"*.example.com", "*.pypi.org", "10.0.0.0/8", "8.8.8.0/24"}, DenyOut: []string{"1.2.3.0/24"}}
	o := Options{AllowPrivate: pfx("10.0.0.0/8")}
	b.Run("small", func(b *testing.B) {
		for b.Loop() {
			if len(Subset(small, bound, o)) != 0 {
				b.Fatal("not a subset")
			}
		}
	})
	bp, bb := bigPolicies()
	b.Run("max", func(b *testing.B) {
		for b.Loop() {
			Subset(bp, bb, o)
		}
	})
}
