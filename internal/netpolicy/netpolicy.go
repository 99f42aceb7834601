// Package netpolicy validates and evaluates a sandbox's network policy
// (api.NetworkPolicy): which names may be resolved, which addresses and
// ports may be reached, and which never may, whatever a name resolves to.
//
// Validate checks a policy as the API receives it; Compile also builds the
// matchers the gateway asks on every DNS query (NameAllowed, Zone) and
// every connection (Check). Everything here is pure: no I/O, no resolving.
//
// Check decides in this order: protected addresses, deny_out, the special
// ranges (loopback, private, link-local, … see Classify) unless opened —
// by the operator (Options.AllowPrivate, the outer limit) and by the
// policy (an allow_out IP/CIDR inside the operator's range, or for a name
// entry its allow_private) —, allow_out IPs and CIDRs, allow_out names
// matching the name the gateway resolved, internet (public addresses
// only), else refused. UnreachableAnswer is the same limit for the DNS
// answers the gateway binds to names.
package netpolicy

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Options are server-wide settings.
type Options struct {
	// AllowPrivate: ranges the operator opened with --egress-allow-private;
	// a sandbox still needs its policy to allow them (an allow_out IP/CIDR
	// inside one, or, for names, its allow_private).
	AllowPrivate []netip.Prefix
	// Protected: addresses never reachable whatever any policy says (the
	// host's own interface addresses, the API listener). A Protected entry
	// with port 0 = every port of that IP.
	Protected []netip.AddrPort
}

// Unreachable says why the operator's settings alone keep ip:port out of
// every sandbox's reach ("protected address", or the Classify class of a
// special address outside AllowPrivate), or "" if a policy may allow it.
// Port 0 asks about the address on any port. The gateway's host dialer
// asks this; its DNS filter asks (*Policy).UnreachableAnswer, which adds
// the sandbox's policy, and Check asks more.
func (o Options) Unreachable(ip netip.Addr, port uint16) string {
	ip = ip.Unmap()
	for _, p := range o.Protected {
		if p.Addr().Unmap() == ip && (port == 0 || p.Port() == 0 || p.Port() == port) {
			return "protected address"
		}
	}
	class := Classify(ip)
	if class == "" {
		return ""
	}
	for _, p := range o.AllowPrivate {
		if p.Contains(ip) {
			return ""
		}
	}
	return class
}

// Policy is a compiled api.NetworkPolicy. It is immutable and safe for
// concurrent use.
type Policy struct {
	src      api.NetworkPolicy
	internet bool
	allowIP  []entry
	denyIP   []entry
	exact    map[string][]entry // name → entries
	wild     map[string][]entry // suffix (after "*.") → entries
	proxy    *Proxy

	// namePrivate: the policy's allow_private, where a name entry may
	// lead inside the operator's allowPrivate.
	namePrivate []netip.Prefix

	allowPrivate []netip.Prefix // the operator's (Options.AllowPrivate)
	protected    []netip.AddrPort
}

// Verdict is Check's answer for one connection.
type Verdict struct {
	Allow bool
	// ByName: allowed only because of a name entry, so the connection's
	// SNI or Host must prove that name.
	ByName bool
	// OpaqueOK: any protocol may be spoken. True when an IP/CIDR entry or
	// internet allowed the address, or when the name entry that allowed it
	// carried an explicit port; false for a name entry without a port
	// (then only TLS or HTTP naming the allowed name may pass).
	OpaqueOK bool
	// Reason: the rule text that allowed it ("pypi.org:443",
	// "10.0.0.0/8", "internet"), or why it was refused ("deny_out
	// 203.0.113.0/24", "private address (10.0.0.0/8)", "protected
	// address", "port not allowed", "not allowed").
	Reason string
}

// Proxy is a parsed egress_proxy.
type Proxy struct {
	Host      string // name or IP literal (IPv6 without brackets)
	Port      uint16
	RemoteDNS bool // socks5h: the proxy resolves names
	Username  string
	Password  string
}

// Address is host:port, as a dialer wants it.
func (p *Proxy) Address() string { return joinHostPort(p.Host, p.Port) }

func joinHostPort(h string, port uint16) string {
	return net.JoinHostPort(h, strconv.Itoa(int(port)))
}

func invalid(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrInvalidArgument)...)
}

// Validate checks p and returns an errdefs.ErrInvalidArgument error naming
// the offending field ("network.allow_out[2]: \"*\": bare \"*\" is not
// allowed …"). It does not know the server's Options: Compile may still
// refuse an egress proxy at a protected or private address.
func Validate(p api.NetworkPolicy) error {
	_, err := compile(p)
	return err
}

// Compile validates p and builds its matchers under the server's options.
func Compile(p api.NetworkPolicy, o Options) (*Policy, error) {
	pol, err := compile(p)
	if err != nil {
		return nil, err
	}
	for _, pf := range o.AllowPrivate {
		if !pf.IsValid() {
			return nil, fmt.Errorf("netpolicy: invalid AllowPrivate prefix %v", pf)
		}
		pol.allowPrivate = append(pol.allowPrivate, canonPrefix(pf.Masked()))
	}
	for _, ap := range o.Protected {
		if !ap.Addr().IsValid() {
			return nil, fmt.Errorf("netpolicy: invalid Protected address %v", ap)
		}
		pol.protected = append(pol.protected, netip.AddrPortFrom(ap.Addr().WithZone("").Unmap(), ap.Port()))
	}
	if pol.proxy != nil {
		if ip, err := netip.ParseAddr(pol.proxy.Host); err == nil {
			if v := pol.CheckProxy(ip, pol.proxy.Port); !v.Allow {
				return nil, invalid("network.egress_proxy: %s is refused: %s", joinHostPort(ip.String(), pol.proxy.Port), v.Reason)
			}
		}
	}
	return pol, nil
}

func compile(p api.NetworkPolicy) (*Policy, error) {
	pol := &Policy{
		src:      clonePolicy(p),
		internet: p.Internet,
		exact:    map[string][]entry{},
		wild:     map[string][]entry{},
	}
	if n := len(p.AllowOut); n > MaxAllowOut {
		return nil, invalid("network.allow_out: %d entries, at most %d", n, MaxAllowOut)
	}
	if n := len(p.DenyOut); n > MaxDenyOut {
		return nil, invalid("network.deny_out: %d entries, at most %d", n, MaxDenyOut)
	}
	for i, s := range p.AllowOut {
		e, err := parseEntry(s, true)
		if err != nil {
			return nil, invalid("network.allow_out[%d]: %q: %v", i, clip(s), err)
		}
		switch e.kind {
		case kindPrefix:
			pol.allowIP = append(pol.allowIP, e)
		case kindExact:
			pol.exact[e.name] = append(pol.exact[e.name], e)
		case kindWildcard:
			pol.wild[e.name] = append(pol.wild[e.name], e)
		}
	}
	for i, s := range p.DenyOut {
		e, err := parseEntry(s, false)
		if err != nil {
			return nil, invalid("network.deny_out[%d]: %q: %v", i, clip(s), err)
		}
		pol.denyIP = append(pol.denyIP, e)
	}
	if n := len(p.AllowPrivate); n > MaxAllowPrivate {
		return nil, invalid("network.allow_private: %d entries, at most %d", n, MaxAllowPrivate)
	}
	for i, s := range p.AllowPrivate {
		pf, err := parsePrivate(s)
		if err != nil {
			return nil, invalid("network.allow_private[%d]: %q: %v", i, clip(s), err)
		}
		pol.namePrivate = append(pol.namePrivate, pf)
	}
	if err := pol.checkRules(p.Rules); err != nil {
		return nil, err
	}
	if p.EgressProxy != "" {
		px, err := parseProxy(p.EgressProxy)
		if err != nil {
			// Never echo the value: it may carry a password.
			return nil, invalid("network.egress_proxy: %v", err)
		}
		pol.proxy = px
	}
	return pol, nil
}

// clip bounds what an error message quotes of hostile input.
func clip(s string) string {
	if len(s) <= MaxEntryLen {
		return s
	}
	return s[:64] + "…"
}

func clonePolicy(p api.NetworkPolicy) api.NetworkPolicy {
	c := p
	c.AllowOut = append([]string(nil), p.AllowOut...)
	c.DenyOut = append([]string(nil), p.DenyOut...)
	c.AllowPrivate = append([]string(nil), p.AllowPrivate...)
	if p.Rules != nil {
		c.Rules = make([]api.HeaderRule, len(p.Rules))
		for i, r := range p.Rules {
			c.Rules[i] = api.HeaderRule{Domain: r.Domain, RemoveHeaders: append([]string(nil), r.RemoveHeaders...)}
			if r.SetHeaders != nil {
				c.Rules[i].SetHeaders = make(map[string]string, len(r.SetHeaders))
				for k, v := range r.SetHeaders {
					c.Rules[i].SetHeaders[k] = v
				}
			}
		}
	}
	return c
}

// Source returns (a copy of) the policy p was compiled from, as written.
func (p *Policy) Source() api.NetworkPolicy { return clonePolicy(p.src) }

// Internet reports whether the policy allows every public destination.
func (p *Policy) Internet() bool { return p.internet }

// Proxy returns the parsed egress proxy, or nil if connections are dialed
// directly.
func (p *Policy) Proxy() *Proxy {
	if p.proxy == nil {
		return nil
	}
	c := *p.proxy
	return &c
}

// nameMatch walks the entries matching name (canonical): the exact ones,
// then the wildcards from the narrowest suffix to the broadest. fn returns
// false to stop.
func (p *Policy) nameMatch(name string, fn func(e *entry) bool) {
	for i := range p.exact[name] {
		if !fn(&p.exact[name][i]) {
			return
		}
	}
	if len(p.wild) == 0 {
		return
	}
	for s := name; ; {
		dot := strings.IndexByte(s, '.')
		if dot < 0 {
			return
		}
		s = s[dot+1:]
		es := p.wild[s]
		for i := range es {
			if !fn(&es[i]) {
				return
			}
		}
	}
}

// NameAllowed says whether the DNS name may be resolved (forwarded
// upstream). Names are case-insensitive and a trailing dot is ignored; a
// name that is not a valid DNS name (LDH labels and '_') is never allowed.
// An exact or wildcard entry matches whatever its port. rule is the
// matching entry as written (the most specific one), else "internet".
func (p *Policy) NameAllowed(name string) (rule string, ok bool) {
	n, valid := CanonicalName(name)
	if !valid {
		return "", false
	}
	p.nameMatch(n, func(e *entry) bool { rule, ok = e.text, true; return false })
	if !ok && p.internet {
		return "internet", true
	}
	return rule, ok
}

// Zone returns the allow_out wildcard zone name falls under ("*.example.com",
// the broadest when several match), to bound DNS exfiltration per zone; ""
// when an exact entry matches the name, when only internet allows it, or
// when nothing does.
func (p *Policy) Zone(name string) string {
	n, valid := CanonicalName(name)
	if !valid || len(p.exact[n]) > 0 {
		return ""
	}
	zone := ""
	p.nameMatch(n, func(e *entry) bool {
		if e.kind == kindWildcard {
			zone = "*." + e.name
		}
		return true
	})
	return zone
}

// matchName finds the name entry allowing name on port, preferring one
// that names the port; portMiss reports entries matching the name on
// other ports.
func (p *Policy) matchName(name string, port uint16) (best *entry, portMiss bool) {
	n, valid := CanonicalName(name)
	if !valid {
		return nil, false
	}
	p.nameMatch(n, func(e *entry) bool {
		switch e.port {
		case port:
			best = e
			return false
		case 0:
			if best == nil {
				best = e
			}
		default:
			portMiss = true
		}
		return true
	})
	return best, portMiss
}

func portOK(e *entry, port uint16) bool { return e.port == 0 || e.port == port }

func within(inner, outer netip.Prefix) bool {
	return outer.Bits() <= inner.Bits() && outer.Contains(inner.Addr())
}

func (p *Policy) privateOpen(ip netip.Addr) bool { return inAny(p.allowPrivate, ip) }

// namePrivateOpen: may a name entry lead to ip (inside the operator's
// ranges, checked apart)? Only if the policy's allow_private covers it.
func (p *Policy) namePrivateOpen(ip netip.Addr) bool { return inAny(p.namePrivate, ip) }

func inAny(pfs []netip.Prefix, ip netip.Addr) bool {
	for _, pf := range pfs {
		if pf.Contains(ip) {
			return true
		}
	}
	return false
}

// privatePrefixOpen: is pf inside a range the operator opened?
func (p *Policy) privatePrefixOpen(pf netip.Prefix) bool {
	for _, o := range p.allowPrivate {
		if within(pf, o) {
			return true
		}
	}
	return false
}

// isProtected: is any of ips protected on port (0: on any port)?
func (p *Policy) isProtected(port uint16, ips ...netip.Addr) bool {
	for _, a := range p.protected {
		if port != 0 && a.Port() != 0 && a.Port() != port {
			continue
		}
		for _, ip := range ips {
			if ip.IsValid() && a.Addr() == ip {
				return true
			}
		}
	}
	return false
}

func refuse(reason string) Verdict { return Verdict{Reason: reason} }

// Check is the verdict for a TCP connection to ip:port, where name is the
// name the gateway resolved to ip for this sandbox ("" if none). An
// IPv4-mapped ip is treated as the IPv4 address; any IPv6 form embedding an
// IPv4 address is also protected, denied and classified by that address.
//
// A special address (Classify) is reachable only if it lies in one of
// Options.AllowPrivate AND the policy explicitly allows it: an allow_out
// IP/CIDR covering it that itself lies inside an AllowPrivate range (so
// "0.0.0.0/0" never opens private space), or a name entry matching name
// when the address also lies in the policy's allow_private (so a name
// whose DNS someone else controls cannot lead into private space the
// policy did not name). internet never opens it; protected addresses are
// refused even then.
func (p *Policy) Check(name string, ip netip.Addr, port uint16) Verdict {
	if !ip.IsValid() {
		return refuse("invalid address")
	}
	if port == 0 {
		return refuse("port not allowed")
	}
	orig := ip.WithZone("")
	ip = orig.Unmap()
	emb, _, _ := embeddedV4(orig)
	if p.isProtected(port, ip, emb) {
		return refuse("protected address")
	}
	for i := range p.denyIP {
		d := &p.denyIP[i]
		if !portOK(d, port) {
			continue
		}
		if d.prefix.Contains(ip) || d.prefix.Contains(orig) || emb.IsValid() && d.prefix.Contains(emb) {
			return refuse("deny_out " + d.text)
		}
	}
	var ipRule *entry
	portMiss := false
	ci := classify(orig)
	special := ci.class != ""
	open := special && p.privateOpen(ip)
	for i := range p.allowIP {
		a := &p.allowIP[i]
		if !a.prefix.Contains(ip) {
			continue
		}
		if !portOK(a, port) {
			portMiss = true
			continue
		}
		if special && !(open && p.privatePrefixOpen(a.prefix)) {
			continue
		}
		ipRule = a
		break
	}
	nameRule, nameMiss := p.matchName(name, port)
	portMiss = portMiss || nameMiss
	if special && !(open && (ipRule != nil || nameRule != nil && p.namePrivateOpen(ip))) {
		if open && nameRule != nil {
			return refuse(ci.reason() + " not in the sandbox's allow_private")
		}
		return refuse(ci.reason())
	}
	switch {
	case ipRule != nil:
		return Verdict{Allow: true, OpaqueOK: true, Reason: ipRule.text}
	case nameRule != nil && p.internet && !special:
		// internet alone would allow this address: no proof needed.
		return Verdict{Allow: true, OpaqueOK: true, Reason: nameRule.text}
	case nameRule != nil:
		return Verdict{Allow: true, ByName: true, OpaqueOK: nameRule.port != 0, Reason: nameRule.text}
	case p.internet && !special:
		return Verdict{Allow: true, OpaqueOK: true, Reason: "internet"}
	case portMiss:
		return refuse("port not allowed")
	}
	return refuse("not allowed")
}

// UnreachableAnswer says why a DNS answer's address may not be bound to
// an allowed name for this sandbox (the gateway removes it from the
// answer), or "": a protected address ("protected address"); a special
// address outside the operator's AllowPrivate (its Classify class, as
// Options.Unreachable says); or one inside it that the policy does not
// open — neither its allow_private nor an allow_out IP/CIDR inside the
// operator's range covers it ("loopback address not in the sandbox's
// allow_private"). So a name whose DNS an attacker controls cannot even
// point this sandbox's binding at an opened private range the policy
// never named. Check still decides every connection.
func (p *Policy) UnreachableAnswer(ip netip.Addr) string {
	if p == nil {
		return "no policy"
	}
	if !ip.IsValid() {
		return "invalid"
	}
	orig := ip.WithZone("")
	ip = orig.Unmap()
	emb, _, _ := embeddedV4(orig)
	if p.isProtected(0, ip, emb) {
		return "protected address"
	}
	ci := classify(orig)
	switch {
	case ci.class == "":
		return ""
	case !p.privateOpen(ip):
		return ci.class
	case p.namePrivateOpen(ip):
		return ""
	}
	for i := range p.allowIP {
		if a := &p.allowIP[i]; a.prefix.Contains(ip) && p.privatePrefixOpen(a.prefix) {
			return "" // reachable by address anyway
		}
	}
	return ci.class + " address not in the sandbox's allow_private"
}

// CheckProxy is the verdict for dialing the egress proxy at ip:port (the
// gateway resolves a proxy name itself and asks for each address):
// protected addresses are refused, special ranges unless inside
// Options.AllowPrivate (the proxy is the policy's explicit choice).
func (p *Policy) CheckProxy(ip netip.Addr, port uint16) Verdict {
	if !ip.IsValid() || port == 0 {
		return refuse("invalid address")
	}
	orig := ip.WithZone("")
	ip = orig.Unmap()
	emb, _, _ := embeddedV4(orig)
	if p.isProtected(port, ip, emb) {
		return refuse("protected address")
	}
	if ci := classify(orig); ci.class != "" && !p.privateOpen(ip) {
		return refuse(ci.reason())
	}
	return Verdict{Allow: true, OpaqueOK: true, Reason: "egress_proxy"}
}
