package netpolicy

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Subset proves a sandbox's policy inside its tenant's boundary.
//
// What "inside" means is what Check and NameAllowed decide, under the
// server's AllowPrivate ranges, for every input at once: every name p lets
// the sandbox resolve, the boundary lets it resolve; and for every
// connection (the name the gateway resolved, any address that name may
// resolve to, any port) p allows, the boundary allows it at least as
// freely — a connection p lets through for any protocol (Verdict.OpaqueOK)
// the boundary must too, not only for TLS/HTTP naming the name.
//
// It is exact, not sampled: addresses are sets of ranges (a /16 covered by
// two /17s is covered), ports split where some entry names one, names into
// the classes the patterns of both policies cut them into. Every violation
// carries an action p allows and the boundary refuses (the tests check each
// one against Check), and no violation means there is none — with one
// deliberate exception: allow_private is compared as written (its special
// addresses must lie in the boundary's allow_private), whatever the server
// opens today and whether or not a name of p leads there, because it is a
// grant the tenant's boundary makes and the server's ranges may change
// under a stored policy. Such a violation carries an action only when one
// exists under o.

// Violation is one way a policy reaches beyond its boundary.
type Violation struct {
	// Field is where the offending entry is, named as Validate names
	// fields: "network.allow_out[3]", "network.internet",
	// "network.rules[0].set_headers[\"X-Tenant\"]", "network.egress_proxy";
	// "network" if the policy is not valid at all.
	Field string
	// Entry is the entry as written ("10.0.0.0/8:443"; "true" for
	// internet; a header's name, never its value; the proxy without its
	// credentials).
	Entry string
	// Reason says what the entry reaches that the boundary does not.
	Reason string

	w witness // an action p allows and the boundary refuses (tests)
}

// String is "network.allow_out[0] \"10.0.0.0/8:443\": 10.192.0.0/10 on
// port 443 is outside the boundary …".
func (v Violation) String() string {
	if v.Entry == "" {
		return v.Field + ": " + v.Reason
	}
	return fmt.Sprintf("%s %q: %s", v.Field, v.Entry, v.Reason)
}

// SubsetError is nil for no violations, else an errdefs.ErrInvalidArgument
// error naming every one of them.
func SubsetError(vs []Violation) error {
	if len(vs) == 0 {
		return nil
	}
	msg := make([]string, len(vs))
	for i, v := range vs {
		msg[i] = v.String()
	}
	return fmt.Errorf("the network policy exceeds the tenant's boundary: %s: %w", strings.Join(msg, "; "), errdefs.ErrInvalidArgument)
}

// witness is an action that shows a violation (for tests): a connection
// (name may be "": by address alone) or a DNS query.
type witness struct {
	kind witnessKind
	name string
	addr netip.Addr
	port uint16
}

type witnessKind int

const (
	noWitness witnessKind = iota
	connWitness
	dnsWitness
)

// Subset returns the ways policy p reaches beyond boundary: none means p
// allows nothing the boundary does not (p ⊆ boundary). Both are policies
// as the API accepts them; an invalid one is a single violation.
//
// o is the server's: a range its AllowPrivate opens is reachable through
// an allow_out CIDR only if that CIDR lies inside the range, so whether a
// boundary's "10.0.0.0/8" covers a sandbox's "10.1.2.3" depends on it.
// o.Protected is ignored (it refuses the same addresses under both).
//
// Rules beyond Check: p's allow_private must lie inside the boundary's
// (its special addresses; see above). p's deny_out need not copy the boundary's, but
// wherever p lets a connection reach (a name entry reaches whatever its
// name resolves to) the boundary's deny_out must be matched by p's own. An
// egress_proxy must equal the boundary's (none if it has none). A header
// rule's domain must be resolvable under the boundary, and a rule may not
// set or remove a header that a boundary rule for an overlapping domain
// sets or removes, unless it does exactly the same.
func Subset(p, boundary api.NetworkPolicy, o Options) []Violation {
	if err := Validate(p); err != nil {
		return []Violation{{Field: "network", Reason: err.Error()}}
	}
	if err := Validate(boundary); err != nil {
		return []Violation{{Field: "network", Reason: "the boundary is not a valid policy: " + err.Error()}}
	}
	var open []netip.Prefix
	for _, r := range o.AllowPrivate {
		if r.IsValid() {
			open = append(open, canonPrefix(r.Masked()))
		}
	}
	pr := &prover{p: newSide(p, open), b: newSide(boundary, open), found: map[findingKey]*finding{}}
	pr.addresses(open)
	pr.names()
	pr.privates()
	pr.rules()
	pr.proxy()
	return pr.violations()
}

// ipRule is a parsed allow_out or deny_out IP/CIDR entry.
type ipRule struct {
	idx  int
	text string
	pf   netip.Prefix
	port uint16
	foot addrSet // the connection addresses it matches
	open bool    // inside an AllowPrivate range: it may open special addresses
}

// privRule is a parsed allow_private entry.
type privRule struct {
	idx  int
	text string
	foot addrSet // the special addresses it opens to names
}

type nameRule struct {
	idx  int
	text string
	name string // the suffix for a wildcard
	wild bool
	port uint16
}

// side is one policy, parsed for proving.
type side struct {
	src          api.NetworkPolicy
	inet         bool
	allow, deny  []ipRule
	names        []nameRule
	exact, wilds map[string][]int // into names
	privs        []privRule
	priv         addrSet // the union of privs' footprints
}

func newSide(p api.NetworkPolicy, open []netip.Prefix) *side {
	s := &side{src: p, inet: p.Internet, exact: map[string][]int{}, wilds: map[string][]int{}}
	for i, t := range p.AllowOut {
		e, _ := parseEntry(t, true) // validated
		if e.kind == kindPrefix {
			r := ipRule{idx: i, text: t, pf: e.prefix, port: e.port, foot: allowFootprint(e.prefix)}
			for _, o := range open {
				r.open = r.open || within(e.prefix, o)
			}
			s.allow = append(s.allow, r)
			continue
		}
		s.names = append(s.names, nameRule{idx: i, text: t, name: e.name, wild: e.kind == kindWildcard, port: e.port})
		m := s.exact
		if e.kind == kindWildcard {
			m = s.wilds
		}
		m[e.name] = append(m[e.name], len(s.names)-1)
	}
	for i, t := range p.DenyOut {
		e, _ := parseEntry(t, false)
		s.deny = append(s.deny, ipRule{idx: i, text: t, pf: e.prefix, port: e.port, foot: denyFootprint(e.prefix)})
	}
	var privs []addrSet
	for i, t := range p.AllowPrivate {
		pf, _ := parsePrivate(t)
		r := privRule{idx: i, text: t, foot: specialSet().intersect(allowFootprint(pf))}
		s.privs = append(s.privs, r)
		privs = append(privs, r.foot)
	}
	s.priv = unionAll(privs)
	return s
}

// match lists the name entries matching canonical name n in Check's order
// of preference: exact ones, then wildcards from the narrowest suffix.
func (s *side) match(n string) []int {
	out := append([]int(nil), s.exact[n]...)
	for t := n; ; {
		dot := strings.IndexByte(t, '.')
		if dot < 0 {
			return out
		}
		t = t[dot+1:]
		out = append(out, s.wilds[t]...)
	}
}

// level is what the matching name entries allow on port: 2 any protocol
// (an entry naming the port), 1 TLS/HTTP naming the name (an entry
// without a port), 0 nothing; and the entry Check would use.
func (s *side) level(m []int, port uint16) (int, int) {
	for _, i := range m {
		if s.names[i].port == port {
			return 2, i
		}
	}
	for _, i := range m {
		if s.names[i].port == 0 {
			return 1, i
		}
	}
	return 0, -1
}

// ruleSets are the footprints of a list of rules by port, unioned once:
// at(port) is then one merge.
type ruleSets struct {
	any    addrSet            // rules without a port
	byPort map[uint16]addrSet // rules naming the port
}

func newRuleSets(rules []ipRule, onlyOpen bool) ruleSets {
	var any []addrSet
	by := map[uint16][]addrSet{}
	for _, r := range rules {
		if onlyOpen && !r.open {
			continue
		}
		if r.port == 0 {
			any = append(any, r.foot)
		} else {
			by[r.port] = append(by[r.port], r.foot)
		}
	}
	rs := ruleSets{any: unionAll(any), byPort: map[uint16]addrSet{}}
	for p, l := range by {
		rs.byPort[p] = unionAll(l)
	}
	return rs
}

// at is the union of the footprints of the rules applying on port.
func (rs ruleSets) at(port uint16) addrSet { return rs.any.union(rs.byPort[port]) }

// atom is a set of ports on which every entry of both policies decides
// alike: one port some entry names, or (other) every port none names.
type atom struct {
	port  uint16 // the port, or for other the lowest port no entry names
	other bool
	dB    addrSet // the boundary's deny_out here
	// window is what the entries naming this port cover: outside it,
	// every set here is as on the other-ports atom.
	window addrSet
	// What p allows by address (an IP/CIDR entry or internet: any name,
	// any protocol) that the boundary does not.
	res addrSet
	// Where a name entry of p lets a connection reach and the boundary's
	// name entries would not (its deny_out refuses them).
	gapDeny addrSet
	// Where a name entry of p lets a connection reach and the boundary
	// does not allow by address.
	gapAddr addrSet
	// gapAddr split by the boundary's deny_out, when needed.
	gapDenied, gapOpaque addrSet
	splitDone            bool
	// privGap: where a name entry of p may lead through p's allow_private
	// beyond the boundary's, and the boundary allows no connection.
	privGap addrSet
}

type prover struct {
	p, b  *side
	atoms []atom
	notS  addrSet // addresses Classify calls public
	found map[findingKey]*finding
	// privOver: the special addresses p's allow_private lists and the
	// boundary's does not (each is a violation of its own).
	privOver addrSet
	reps     []string // the names standing for every class (names)
}

// addresses splits ports into atoms and, on each, works out the address
// sets the proofs need; then proves p's IP/CIDR entries and internet.
func (pr *prover) addresses(open []netip.Prefix) {
	ports := map[uint16]bool{}
	for _, s := range []*side{pr.p, pr.b} {
		for _, r := range s.allow {
			ports[r.port] = true
		}
		for _, r := range s.deny {
			ports[r.port] = true
		}
		for _, r := range s.names {
			ports[r.port] = true
		}
	}
	delete(ports, 0)
	listed := make([]uint16, 0, len(ports))
	for p := range ports {
		listed = append(listed, p)
	}
	slices.Sort(listed)
	for _, p := range listed {
		pr.atoms = append(pr.atoms, atom{port: p})
	}
	other := uint16(1)
	for ports[other] {
		other++ // at most 2*(MaxAllowOut+MaxDenyOut) ports are listed
	}
	pr.atoms = append(pr.atoms, atom{port: other, other: true})

	S := specialSet()
	pr.notS = allAddrs.minus(S)
	var opens []addrSet
	for _, r := range open {
		opens = append(opens, allowFootprint(r))
	}
	openS := S.intersect(unionAll(opens)) // special, but opened by the operator
	// Where a name entry may lead: public addresses, and the special ones
	// both the operator and the policy's allow_private open. p's excess
	// over the boundary's allow_private is a violation of its own
	// (privates), so the name proofs below take p's as cut to the
	// boundary's (the same when there is no such violation) and each
	// finding keeps one reason.
	pr.privOver = pr.p.priv.minus(pr.b.priv)
	nameReachB := pr.notS.union(openS.intersect(pr.b.priv))
	nameReachP := pr.notS.union(openS.intersect(pr.p.priv).intersect(pr.b.priv))
	overP := openS.intersect(pr.privOver) // where only p's allow_private leads
	type sets struct{ deny, allow, open ruleSets }
	sideSets := func(s *side) sets {
		return sets{newRuleSets(s.deny, false), newRuleSets(s.allow, false), newRuleSets(s.allow, true)}
	}
	setsP, setsB := sideSets(pr.p), sideSets(pr.b)
	byAddr := func(s *side, rs sets, reachable addrSet, port uint16) (addrOK, reach addrSet) {
		d := rs.deny.at(port)
		pub := allAddrs
		if !s.inet {
			pub = rs.allow.at(port)
		}
		addrOK = pr.notS.intersect(pub).union(openS.intersect(rs.open.at(port))).minus(d)
		return addrOK, reachable.minus(d)
	}
	for i := range pr.atoms {
		a := &pr.atoms[i]
		okP, reachP := byAddr(pr.p, setsP, nameReachP, a.port)
		okB, reachB := byAddr(pr.b, setsB, nameReachB, a.port)
		a.dB = setsB.deny.at(a.port)
		if !a.other {
			a.window = unionAll([]addrSet{setsP.deny.byPort[a.port], setsP.allow.byPort[a.port], setsB.deny.byPort[a.port], setsB.allow.byPort[a.port]})
		}
		a.res = okP.minus(okB)
		a.gapDeny = reachP.minus(reachB)
		a.gapAddr = reachP.minus(okB)
		if !overP.empty() {
			a.privGap = overP.minus(setsP.deny.at(a.port)).minus(okB)
		}
	}

	// Which of p's IP/CIDR entries allow what. An entry without a port is
	// decided on each atom as on the "other" one unless the atom's window
	// (what its port-specific entries cover) meets the entry: only those
	// pairs are worked out again, so a policy of many ports costs little.
	base := len(pr.atoms) - 1
	contrib := func(r ipRule, ai int) addrSet {
		c := pr.atoms[ai].res.intersect(r.foot)
		if !r.open {
			c = c.intersect(pr.notS)
		}
		return c
	}
	for _, r := range pr.p.allow {
		order := orderAllow + r.idx
		if r.port != 0 {
			ai := slices.IndexFunc(pr.atoms, func(a atom) bool { return a.port == r.port && !a.other })
			pr.addrFinding(order, r.text, ai, contrib(r, ai), r.pf)
			continue
		}
		den, out := pr.split(base, contrib(r, base))
		for ai := range pr.atoms {
			if ai == base || overlaps(pr.atoms[ai].window, r.foot) {
				pr.addrFinding(order, r.text, ai, contrib(r, ai), r.pf)
			} else {
				pr.addrRecord(order, r.text, ai, den, out, r.pf)
			}
		}
	}
	if pr.p.inet && pr.b.inet {
		for ai := range pr.atoms {
			pr.addrFinding(orderInternet, "true", ai, pr.atoms[ai].res.intersect(pr.notS), netip.Prefix{})
		}
	}
	if pr.p.inet && !pr.b.inet {
		f := pr.add(findingKey{orderInternet, kindNoInternet}, "network.internet", "true")
		if n, ok := pr.freshName(""); ok {
			f.setWitness(witness{kind: dnsWitness, name: n})
		}
	}
}

// addrFinding records that an entry (order) allows the addresses c on
// atom ai that the boundary refuses, split by why.
func (pr *prover) addrFinding(order int, text string, ai int, c addrSet, pf netip.Prefix) {
	if c.empty() {
		return
	}
	den, out := pr.split(ai, c)
	pr.addrRecord(order, text, ai, den, out, pf)
}

// split cuts c into what the boundary's deny_out refuses on atom ai and
// the rest.
func (pr *prover) split(ai int, c addrSet) (den, out addrSet) {
	dB := pr.atoms[ai].dB
	return c.intersect(dB), c.minus(dB)
}

func (pr *prover) addrRecord(order int, text string, ai int, den, out addrSet, pf netip.Prefix) {
	a := &pr.atoms[ai]
	field := func() string {
		if order == orderInternet {
			return "network.internet"
		}
		return allowField(order - orderAllow)
	}
	for _, x := range []struct {
		kind findingKind
		set  addrSet
	}{{kindAddrDenied, den}, {kindAddrOutside, out}} {
		if x.set.empty() {
			continue
		}
		k := findingKey{order, x.kind}
		f := pr.found[k]
		if f == nil {
			f = pr.add(k, field(), text)
			f.pf = pf
		}
		f.note(ai, x.set)
		f.setWitness(witness{kind: connWitness, addr: x.set.first(), port: a.port})
	}
}

// overlaps says whether two sets meet, without building the intersection
// (w is small: an entry's footprint).
func overlaps(s, w addrSet) bool {
	hit := func(s, w spans) bool {
		for _, x := range w {
			j, _ := slices.BinarySearchFunc(s, x.lo, func(sp span, lo u128) int { return sp.hi.cmp(lo) })
			if j < len(s) && s[j].lo.cmp(x.hi) <= 0 {
				return true
			}
		}
		return false
	}
	return hit(s.v4, w.v4) || hit(s.v6, w.v6)
}

// names proves p's name entries, class by class: two names matched by the
// same entries of both policies are decided alike, so one name of each
// class stands for all (an exact name, or a made-up name under a wildcard
// suffix that no exact entry names).
func (pr *prover) names() {
	reps := map[string]bool{}
	for _, s := range []*side{pr.p, pr.b} {
		for n := range s.exact {
			reps[n] = true
		}
		for suffix := range s.wilds {
			if n, ok := pr.freshName(suffix); ok {
				reps[n] = true
			}
		}
	}
	sorted := make([]string, 0, len(reps))
	for n := range reps {
		sorted = append(sorted, n)
	}
	slices.Sort(sorted)
	pr.reps = sorted
	atomOf := map[uint16]int{}
	for i, a := range pr.atoms {
		if !a.other {
			atomOf[a.port] = i
		}
	}
	for _, n := range sorted {
		mp := pr.p.match(n)
		if len(mp) == 0 {
			continue
		}
		mb := pr.b.match(n)
		if len(mb) == 0 && !pr.b.inet {
			e := pr.p.names[mp[0]]
			f := pr.add(findingKey{orderAllow + e.idx, kindNameDNS}, allowField(e.idx), e.text)
			f.example(n)
			f.setWitness(witness{kind: dnsWitness, name: n})
			// Its connections fail the boundary too, but that the name
			// cannot even be resolved under it says enough.
			continue
		}
		var check []int // atoms where p lets the name through
		if lvl, _ := pr.p.level(mp, 0); lvl > 0 {
			check = make([]int, len(pr.atoms))
			for i := range check {
				check[i] = i
			}
		} else {
			for _, i := range mp {
				check = append(check, atomOf[pr.p.names[i].port])
			}
		}
		for _, ai := range check {
			a := &pr.atoms[ai]
			need, blame := pr.p.level(mp, a.port)
			have, bBlame := pr.b.level(mb, a.port)
			e := pr.p.names[blame]
			rec := func(kind findingKind, gap addrSet) {
				if gap.empty() {
					return
				}
				k := findingKey{orderAllow + e.idx, kind}
				f := pr.found[k]
				if f == nil {
					f = pr.add(k, allowField(e.idx), e.text)
				}
				f.note(ai, gap)
				f.example(n)
				if kind == kindNameOpaque {
					f.bEntry = pr.b.names[bBlame].text
				}
				f.setWitness(witness{kind: connWitness, name: n, addr: gap.first(), port: a.port})
			}
			switch {
			case have >= need:
				rec(kindNameDenied, a.gapDeny)
			case have == 0:
				rec(kindNamePort, a.gapAddr)
			default: // p any protocol, the boundary TLS/HTTP only
				if !a.splitDone {
					a.gapDenied, a.gapOpaque = pr.split(ai, a.gapAddr)
					a.splitDone = true
				}
				rec(kindNameOpaque, a.gapOpaque)
				rec(kindNameDenied, a.gapDenied)
			}
		}
	}
}

// privates proves p's allow_private: the special addresses of each entry
// must lie in the boundary's allow_private. The witness, when there is
// one, is a name of p reaching such an address on a port where the
// boundary allows no connection there (the boundary lets no name lead to
// it, and its address entries do not cover it).
func (pr *prover) privates() {
	if pr.privOver.empty() {
		return
	}
	for _, r := range pr.p.privs {
		over := r.foot.intersect(pr.privOver)
		if over.empty() {
			continue
		}
		f := pr.add(findingKey{orderPrivate + r.idx, kindPrivate}, fmt.Sprintf("network.allow_private[%d]", r.idx), r.text)
		f.addrs = over
		for _, n := range pr.reps {
			mp := pr.p.match(n)
			if len(mp) == 0 || f.w.kind != noWitness {
				continue
			}
			for ai := range pr.atoms {
				a := &pr.atoms[ai]
				if need, _ := pr.p.level(mp, a.port); need == 0 {
					continue
				}
				if g := a.privGap.intersect(over); !g.empty() {
					f.setWitness(witness{kind: connWitness, name: n, addr: g.first(), port: a.port})
					break
				}
			}
		}
	}
}

// freshName makes up a valid name directly under suffix ("" for a single
// label) that no exact entry of either policy names, so that it is matched
// exactly by the wildcards over suffix; false if there is none (suffix is
// too long to have names under it, or all of them are listed).
func (pr *prover) freshName(suffix string) (string, bool) {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789_-"
	budget := maxNameLen - len(suffix) - 1
	if suffix == "" {
		budget = maxNameLen
	}
	budget = min(budget, maxLabelLen)
	for l := 1; l <= budget; l++ {
		idx := make([]int, l)
		for {
			b := make([]byte, l)
			for i, k := range idx {
				b[i] = alphabet[k]
			}
			n := string(b)
			if suffix != "" {
				n += "." + suffix
			}
			if c, ok := CanonicalName(n); ok && len(pr.p.exact[c]) == 0 && len(pr.b.exact[c]) == 0 {
				return c, true
			}
			// Next label of this length (odometer).
			i := l - 1
			for ; i >= 0; i-- {
				idx[i]++
				if idx[i] < len(alphabet) {
					break
				}
				idx[i] = 0
			}
			if i < 0 {
				break
			}
		}
	}
	return "", false
}

// rules proves p's header rules.
func (pr *prover) rules() {
	type pattern struct {
		name string
		wild bool
	}
	parse := func(d string) pattern {
		n, w, _ := parsePattern(d) // validated
		return pattern{n, w}
	}
	under := func(n, suffix string) bool { return strings.HasSuffix(n, "."+suffix) }
	overlap := func(a, b pattern) bool {
		switch {
		case !a.wild && !b.wild:
			return a.name == b.name
		case !a.wild:
			return under(a.name, b.name)
		case !b.wild:
			return under(b.name, a.name)
		}
		return a.name == b.name || under(a.name, b.name) || under(b.name, a.name)
	}
	for i, r := range pr.p.src.Rules {
		field := fmt.Sprintf("network.rules[%d]", i)
		order := orderRules + i*(2*MaxRuleHeaders+2)
		pp := parse(r.Domain)
		covered := pr.b.inet
		var w witness
		if pp.wild {
			for t := pp.name; !covered; {
				covered = len(pr.b.wilds[t]) > 0
				dot := strings.IndexByte(t, '.')
				if dot < 0 {
					break
				}
				t = t[dot+1:]
			}
			if n, ok := pr.freshName(pp.name); ok {
				w = witness{kind: dnsWitness, name: n}
			}
		} else {
			covered = covered || len(pr.b.match(pp.name)) > 0
			w = witness{kind: dnsWitness, name: pp.name}
		}
		if !covered {
			f := pr.add(findingKey{order, kindRuleDomain}, field+".domain", r.Domain)
			f.setWitness(w)
		}
		for _, br := range pr.b.src.Rules {
			if !overlap(pp, parse(br.Domain)) {
				continue
			}
			bSet, bRemove := map[string]string{}, map[string]bool{}
			for k, v := range br.SetHeaders {
				bSet[strings.ToLower(k)] = v
			}
			for _, k := range br.RemoveHeaders {
				bRemove[strings.ToLower(k)] = true
			}
			keys := make([]string, 0, len(r.SetHeaders))
			for k := range r.SetHeaders {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			for j, k := range keys {
				lk := strings.ToLower(k)
				v, set := bSet[lk]
				if (set && v != r.SetHeaders[k]) || bRemove[lk] {
					f := pr.add(findingKey{order + 1 + j, kindRuleHeader}, fmt.Sprintf("%s.set_headers[%q]", field, k), k)
					f.example(br.Domain)
				}
			}
			for j, k := range r.RemoveHeaders {
				lk := strings.ToLower(k)
				if _, set := bSet[lk]; set {
					f := pr.add(findingKey{order + 1 + MaxRuleHeaders + j, kindRuleHeader}, fmt.Sprintf("%s.remove_headers[%d]", field, j), k)
					f.example(br.Domain)
				}
			}
		}
	}
}

// proxy: p's egress proxy must be the boundary's.
func (pr *prover) proxy() {
	ps, bs := pr.p.src.EgressProxy, pr.b.src.EgressProxy
	if ps == "" && bs == "" {
		return
	}
	var px, bx *Proxy
	if ps != "" {
		px, _ = parseProxy(ps) // validated
	}
	if bs != "" {
		bx, _ = parseProxy(bs)
	}
	if px != nil && bx != nil && *px == *bx {
		return
	}
	entry := ""
	if px != nil {
		scheme := "socks5"
		if px.RemoteDNS {
			scheme = "socks5h"
		}
		entry = scheme + "://" + px.Address() // never the credentials
	}
	f := pr.add(findingKey{orderProxy, kindProxy}, "network.egress_proxy", entry)
	switch {
	case bx == nil:
		f.reason = "the boundary sets no egress proxy: a sandbox's proxy would carry its connections to a destination the boundary does not allow"
	case px == nil:
		f.reason = "the boundary sends every connection through its egress proxy; set the same egress_proxy"
	default:
		f.reason = "differs from the boundary's egress proxy (scheme, address and credentials must all be the same)"
	}
}

type findingKind int

const (
	kindAddrOutside findingKind = iota
	kindAddrDenied
	kindNoInternet
	kindNameDNS
	kindNamePort
	kindNameOpaque
	kindNameDenied
	kindRuleDomain
	kindRuleHeader
	kindProxy
	kindPrivate
)

// Sort keys: violations come in the order of p's fields.
const (
	orderAllow    = 0
	orderInternet = orderAllow + MaxAllowOut
	orderPrivate  = orderInternet + 1
	orderRules    = orderPrivate + MaxAllowPrivate
	orderProxy    = orderRules + MaxRules*(2*MaxRuleHeaders+2)
)

type findingKey struct {
	order int // of the entry in p
	kind  findingKind
}

// finding gathers one violation before it is worded.
type finding struct {
	key      findingKey
	field    string
	entry    string
	atoms    []int   // where it happens
	addrs    addrSet // the addresses (up to a bound)
	examples []string
	pf       netip.Prefix // kindAddrOutside: the entry's prefix
	bEntry   string       // kindNameOpaque: the boundary's entry
	reason   string       // set directly for some kinds
	w        witness
}

// add returns the finding k, made with field and entry if new. Callers on
// hot paths compute field only once per entry (see addrFinding).
func (pr *prover) add(k findingKey, field, entry string) *finding {
	f := pr.found[k]
	if f == nil {
		f = &finding{key: k, field: field, entry: entry}
		pr.found[k] = f
	}
	return f
}

func (f *finding) note(ai int, a addrSet) {
	if len(f.atoms) == 0 || f.atoms[len(f.atoms)-1] != ai {
		f.atoms = append(f.atoms, ai)
	}
	if len(f.atoms) > 16 {
		return // enough ranges to show
	}
	// The message shows a few ranges: keep a few (cheaply: a gap may be
	// thousands of ranges, on each of thousands of port atoms).
	const keep = 8
	if len(f.addrs.v4) < keep && len(f.addrs.v6) < keep {
		f.addrs = f.addrs.union(addrSet{a.v4[:min(len(a.v4), keep)], a.v6[:min(len(a.v6), keep)]})
	}
}

func (f *finding) example(n string) {
	if len(f.examples) < 3 && !slices.Contains(f.examples, n) {
		f.examples = append(f.examples, n)
	}
}

func (f *finding) setWitness(w witness) {
	if f.w.kind == noWitness {
		f.w = w
	}
}

func allowField(i int) string { return fmt.Sprintf("network.allow_out[%d]", i) }

// ports words the atoms a finding happens on.
func (pr *prover) ports(atoms []int) string {
	in := make([]bool, len(pr.atoms))
	for _, a := range atoms {
		in[a] = true
	}
	var listed, except []string
	other := false
	for i, a := range pr.atoms {
		switch {
		case a.other:
			other = in[i]
		case in[i] && len(listed) <= 8:
			listed = append(listed, strconv.Itoa(int(a.port)))
		case !in[i] && len(except) <= 8:
			except = append(except, strconv.Itoa(int(a.port)))
		}
	}
	clipList := func(l []string) string {
		if len(l) > 8 {
			return strings.Join(l[:8], ", ") + ", …"
		}
		return strings.Join(l, ", ")
	}
	switch {
	case other && len(except) == 0:
		return "on any port"
	case other:
		return "on any port but " + clipList(except)
	case len(listed) == 1:
		return "on port " + listed[0]
	}
	return "on ports " + clipList(listed)
}

// overlapping lists (up to 4) the texts of rules whose prefix overlaps addrs.
func overlapping(rules []ipRule, addrs addrSet) string {
	var out []string
	for _, r := range rules {
		if len(out) == 4 {
			out = append(out, "…")
			break
		}
		if !r.foot.intersect(addrs).empty() && !slices.Contains(out, r.text) {
			out = append(out, r.text)
		}
	}
	return strings.Join(out, ", ")
}

func (pr *prover) violations() []Violation {
	fs := make([]*finding, 0, len(pr.found))
	for _, f := range pr.found {
		fs = append(fs, f)
	}
	slices.SortFunc(fs, func(a, b *finding) int {
		if a.key.order != b.key.order {
			return a.key.order - b.key.order
		}
		return int(a.key.kind) - int(b.key.kind)
	})
	out := make([]Violation, 0, len(fs))
	for _, f := range fs {
		out = append(out, Violation{Field: f.field, Entry: f.entry, Reason: pr.word(f), w: f.w})
	}
	return out
}

func (pr *prover) word(f *finding) string {
	if f.reason != "" {
		return f.reason
	}
	where := ""
	if len(f.atoms) > 0 {
		where = f.addrs.describe(3) + " " + pr.ports(f.atoms)
	}
	ex := strings.Join(f.examples, ", ")
	switch f.key.kind {
	case kindAddrOutside:
		r := where + " is outside the boundary"
		if there := overlapping(pr.b.allow, prefixFootprintOrAll(f.pf)); there != "" {
			r += " (its allow_out there: " + there + ")"
		} else {
			r += " (it allows no address there)"
		}
		if !f.addrs.minus(pr.notS).empty() {
			r += "; a special range (private, loopback, …) is allowed only by a boundary entry inside a range the server opens with --egress-allow-private"
		}
		return r
	case kindAddrDenied:
		return where + " is refused by the boundary's deny_out " + overlapping(pr.b.deny, f.addrs) + "; add it to deny_out"
	case kindNoInternet:
		return "the boundary does not allow internet"
	case kindNameDNS:
		return "the boundary does not allow resolving " + ex + " (no allow_out name matches it, and no internet)"
	case kindNamePort:
		return ex + " " + pr.ports(f.atoms) + " is not allowed by the boundary (its allow_out does not name it there, nor cover every address it may resolve to: " + f.addrs.describe(3) + ")"
	case kindNameOpaque:
		return "with a port, this entry lets any protocol reach " + ex + " " + pr.ports(f.atoms) + "; the boundary's " + f.bEntry + " has no port, so it allows only TLS or HTTP naming the name (drop the port, or widen the boundary)"
	case kindNameDenied:
		return ex + " may resolve to " + where + ", which the boundary's deny_out " + overlapping(pr.b.deny, f.addrs) + " refuses; add it to deny_out"
	case kindRuleDomain:
		return "the boundary does not allow this domain (a rule's domain must be one the boundary lets a sandbox resolve)"
	case kindRuleHeader:
		return "the boundary's rule for " + ex + " sets or removes this header; a sandbox's rule may not change what it does"
	case kindPrivate:
		r := f.addrs.describe(3) + " is outside the boundary's allow_private"
		if len(pr.b.privs) == 0 {
			r += " (it lists none: no name may lead into loopback, private or other special ranges)"
		} else {
			var there []string
			for _, b := range pr.b.privs {
				there = append(there, b.text)
			}
			if len(there) > 4 {
				there = append(there[:4], "…")
			}
			r += " (" + strings.Join(there, ", ") + ")"
		}
		return r
	}
	return "exceeds the boundary"
}

func prefixFootprintOrAll(p netip.Prefix) addrSet {
	if !p.IsValid() {
		return allAddrs
	}
	return allowFootprint(p)
}
