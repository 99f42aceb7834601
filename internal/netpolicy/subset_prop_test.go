package netpolicy

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// The property: for random small policies, Subset agrees with brute force
// over a universe of actions built from the edges of every range either
// policy (or Classify, or the operator) draws, with Check and NameAllowed
// as the oracle. Every violation's witness must be an action p allows and
// the boundary refuses (no false alarm), and when Subset finds nothing, no
// action of the universe may be allowed by p and refused by the boundary
// (no miss).

var (
	propIPs = []string{
		"10.0.0.0/8", "10.0.0.0/9", "10.128.0.0/9", "10.1.2.3", "10.1.0.0/16", "0.0.0.0/0", "0.0.0.0/1",
		"8.8.8.0/24", "8.8.8.8", "8.8.0.0/16", "8.0.0.0/7", "1.2.3.0/24", "127.0.0.1", "127.0.0.0/8",
		"192.168.0.0/16", "::ffff:8.8.8.0/120", "::ffff:10.0.0.0/104", "2001:4860::/32", "2001:4860::8888",
		"::/0", "2000::/3", "2002::/16", "2002:808:800::/40", "2002:a00::/24", "64:ff9b::/96", "64:ff9b::808:808",
		"::/96", "::fffe:0:0/95", "fc00::/7", "fd00::/8", "::/1", "8000::/1",
	}
	propNames = []string{
		"example.com", "a.example.com", "*.example.com", "*.a.example.com", "b.a.example.com",
		"*.b.example.com", "example.org", "*.x.example.org", "x.example.org", "Example.COM.",
	}
	propPorts = []string{"", "", ":443", ":80", ":22"}
	propPriv  = []string{
		"10.0.0.0/8", "10.0.0.0/9", "10.1.0.0/16", "10.1.2.3", "127.0.0.0/8", "192.168.0.0/16", "fc00::/7",
		"0.0.0.0/0", "::ffff:10.0.0.0/104", "2002:a00::/24",
	}
	propOpen = []string{
		"10.0.0.0/8", "10.0.0.0/9", "10.1.0.0/16", "127.0.0.0/8", "192.168.0.0/16", "fc00::/7",
		"0.0.0.0/0", "::/0", "::ffff:10.0.0.0/104", "2002:a00::/24",
	}
)

// propGen draws from a byte stream (so the fuzzer can drive it) or a rand.
type propGen struct {
	b []byte
	r *rand.Rand
}

func (g *propGen) n(k int) int {
	if g.r != nil {
		return g.r.IntN(k)
	}
	if len(g.b) == 0 {
		return 0
	}
	v := int(g.b[0])
	g.b = g.b[1:]
	return v % k
}

func (g *propGen) entry(names bool) string {
	host := propIPs[g.n(len(propIPs))]
	if names && g.n(2) == 0 {
		host = propNames[g.n(len(propNames))]
	}
	port := propPorts[g.n(len(propPorts))]
	if port != "" && strings.Count(host, ":") >= 2 {
		host = "[" + host + "]"
	}
	return host + port
}

func (g *propGen) policy(allow, deny int, inet int) api.NetworkPolicy {
	var p api.NetworkPolicy
	for i, k := 0, g.n(allow+1); i < k; i++ {
		p.AllowOut = append(p.AllowOut, g.entry(true))
	}
	for i, k := 0, g.n(deny+1); i < k; i++ {
		p.DenyOut = append(p.DenyOut, g.entry(false))
	}
	p.Internet = g.n(10) < inet
	for i, k := 0, g.n(3); i < k; i++ {
		p.AllowPrivate = append(p.AllowPrivate, propPriv[g.n(len(propPriv))])
	}
	return p
}

// pair draws p, a boundary and the operator's options; often the boundary
// is p plus more (so that both answers occur).
func (g *propGen) pair() (api.NetworkPolicy, api.NetworkPolicy, Options) {
	p := g.policy(4, 2, 2)
	var b api.NetworkPolicy
	switch g.n(3) {
	case 0:
		b = g.policy(5, 2, 3)
	default:
		b = g.policy(3, 1, 3)
		b.AllowOut = append(b.AllowOut, p.AllowOut...)
		if g.n(2) == 0 {
			// p also denies what the boundary does (often needed).
			p.DenyOut = append(p.DenyOut, b.DenyOut...)
		}
		b.Internet = b.Internet || p.Internet
		if g.n(3) != 0 {
			// The boundary grants p's private ranges (else a violation).
			b.AllowPrivate = append(b.AllowPrivate, p.AllowPrivate...)
		}
	}
	var o Options
	for i, k := 0, g.n(3); i < k; i++ {
		o.AllowPrivate = append(o.AllowPrivate, netip.MustParsePrefix(propOpen[g.n(len(propOpen))]))
	}
	return p, b, o
}

// universe is every action the brute force tries.
type universe struct {
	names []string
	addrs []netip.Addr
	ports []uint16
}

func edgeAddrs(p netip.Prefix, add func(netip.Addr)) {
	p = p.Masked()
	lo := p.Addr()
	v6, s := prefixSpan(p)
	hi := keyAddr(v6, s.hi)
	for _, a := range []netip.Addr{lo, hi, lo.Prev(), hi.Next()} {
		if !a.IsValid() {
			continue
		}
		add(a)
		if a.Is4() {
			// The IPv6 forms embedding it, at both ends of each.
			_, k := addrKey(a)
			one := span{k, k}
			for _, e := range []span{embedMapped(one), embedCompat(one), embedNAT64(one), embed6to4(one)} {
				add(keyAddr(true, e.lo))
				add(keyAddr(true, e.hi))
			}
		}
	}
}

func buildUniverse(t testing.TB, ps ...api.NetworkPolicy) *universe {
	u := &universe{names: []string{"", "unlisted", "q.unlisted.net"}}
	seenA := map[netip.Addr]bool{}
	addA := func(a netip.Addr) {
		if !seenA[a] {
			seenA[a] = true
			u.addrs = append(u.addrs, a)
		}
	}
	seenP := map[uint16]bool{}
	addP := func(p int) {
		if p >= 1 && p <= 65535 && !seenP[uint16(p)] {
			seenP[uint16(p)] = true
			u.ports = append(u.ports, uint16(p))
		}
	}
	for _, p := range []int{1, 65535, 8080} {
		addP(p)
	}
	seenN := map[string]bool{}
	addN := func(n string) {
		if !seenN[n] {
			seenN[n] = true
			u.names = append(u.names, n)
		}
	}
	for _, s := range v4Special {
		edgeAddrs(s.prefix, addA)
	}
	for _, s := range v6Special {
		edgeAddrs(s.prefix, addA)
	}
	for _, p := range []netip.Prefix{globalUnicast6, mapped6, compat6, nat646, sixToFour6} {
		edgeAddrs(p, addA)
	}
	for _, s := range propOpen {
		edgeAddrs(netip.MustParsePrefix(s), addA)
	}
	addA(netip.MustParseAddr("::"))
	addA(netip.MustParseAddr("::1"))
	addA(netip.MustParseAddr("::2"))
	for _, p := range ps {
		for _, s := range p.AllowPrivate {
			edgeAddrs(netip.MustParsePrefix(canonPrivate(t, s)), addA)
		}
		for i, s := range append(append([]string(nil), p.AllowOut...), p.DenyOut...) {
			e, err := parseEntry(s, i < len(p.AllowOut))
			if err != nil {
				t.Fatalf("%q: %v", s, err)
			}
			if e.port != 0 {
				addP(int(e.port) - 1)
				addP(int(e.port))
				addP(int(e.port) + 1)
			}
			switch e.kind {
			case kindPrefix:
				edgeAddrs(e.prefix, addA)
			case kindExact:
				addN(e.name)
				addN("z." + e.name)
			case kindWildcard:
				addN(e.name)
				addN("x." + e.name)
				addN("y.z." + e.name)
			}
		}
	}
	return u
}

func verdictLevel(v Verdict) int {
	switch {
	case !v.Allow:
		return 0
	case v.OpaqueOK:
		return 2
	}
	return 1
}

// counterexample finds an action of u that p allows more than b does.
func (u *universe) counterexample(p, b *Policy) string {
	for _, n := range u.names {
		if _, ok := p.NameAllowed(n); ok {
			if _, ok := b.NameAllowed(n); !ok {
				return fmt.Sprintf("dns %q", n)
			}
		}
	}
	// The gateway passes Check only names the sandbox resolved, so only
	// names p lets it resolve (and "": by address alone).
	var names []string
	for _, n := range u.names {
		if _, ok := p.NameAllowed(n); ok || n == "" {
			names = append(names, n)
		}
	}
	for _, a := range u.addrs {
		for _, port := range u.ports {
			for _, n := range names {
				lp := verdictLevel(p.Check(n, a, port))
				if lp == 0 {
					continue
				}
				if lb := verdictLevel(b.Check(n, a, port)); lp > lb {
					return fmt.Sprintf("connect name=%q %s port %d: level %d > %d", n, a, port, lp, lb)
				}
			}
		}
	}
	return ""
}

// canonPrivate is an allow_private entry as a prefix.
func canonPrivate(t testing.TB, s string) string {
	pf, err := parsePrivate(s)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return pf.String()
}

// checkWitness says what is wrong with v's witness, or "".
func checkWitness(v Violation, p, b *Policy) string {
	w := v.w
	switch w.kind {
	case dnsWitness:
		_, okP := p.NameAllowed(w.name)
		_, okB := b.NameAllowed(w.name)
		if !okP || okB {
			return fmt.Sprintf("dns witness %q: p allows %v, boundary allows %v", w.name, okP, okB)
		}
	case connWitness:
		vp, vb := p.Check(w.name, w.addr, w.port), b.Check(w.name, w.addr, w.port)
		if verdictLevel(vp) <= verdictLevel(vb) {
			return fmt.Sprintf("connect witness name=%q %s port %d: p %+v, boundary %+v", w.name, w.addr, w.port, vp, vb)
		}
	default:
		if strings.HasPrefix(v.Field, "network.allow_private[") {
			// Compared as written: a violation even where no name of p
			// leads there under these options.
			return ""
		}
		return "no witness"
	}
	return ""
}

// checkProperty runs the property on one pair; false if the pair is not
// valid (skipped).
func checkProperty(t testing.TB, p, b api.NetworkPolicy, o Options) bool {
	cp, err := Compile(p, o)
	if err != nil {
		return false
	}
	cb, err := Compile(b, o)
	if err != nil {
		return false
	}
	vs := Subset(p, b, o)
	for _, v := range vs {
		if msg := checkWitness(v, cp, cb); msg != "" {
			t.Fatalf("p=%+v b=%+v open=%v:\nfalse alarm %s\n%s", p, b, o.AllowPrivate, v, msg)
		}
	}
	// allow_private violations without a witness are the only ones Check
	// cannot observe: with nothing else found, nothing else may exist.
	unseen := 0
	for _, v := range vs {
		if v.w.kind == noWitness {
			unseen++
		}
	}
	if len(vs) == 0 || unseen == len(vs) {
		if ce := buildUniverse(t, p, b).counterexample(cp, cb); ce != "" {
			t.Fatalf("p=%+v b=%+v open=%v:\nSubset found nothing Check can observe (%d unseen), but %s", p, b, o.AllowPrivate, unseen, ce)
		}
	}
	return true
}

func TestSubsetProperty(t *testing.T) {
	n := 200
	if testing.Short() {
		n = 60
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	g := &propGen{r: rand.New(rand.NewPCG(seed, 13))}
	subsets, valid := 0, 0
	for i := 0; i < n; i++ {
		p, b, o := g.pair()
		if !checkProperty(t, p, b, o) {
			continue
		}
		valid++
		if len(Subset(p, b, o)) == 0 {
			subsets++
		}
	}
	// Both answers must be exercised, or the property proves little.
	if subsets < valid/10 || subsets > valid*9/10 {
		t.Fatalf("%d of %d pairs were subsets: the generator is lopsided", subsets, valid)
	}
	t.Logf("%d pairs, %d subsets", valid, subsets)
}

func FuzzSubset(f *testing.F) {
	for _, s := range []string{"", "\x01\x02\x03\x04\x05", "\x09\x01\x00\x07\x03\x02\x01\x00\x04\x05\x06", strings.Repeat("\x07\x11\x03", 20)} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		g := &propGen{b: b}
		p, bd, o := g.pair()
		checkProperty(t, p, bd, o)
	})
}
