package gateway

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/time/rate"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"

	"github.com/spacehq/space/api"
)

// bindings are the (name → IP, expiry) pairs this gateway resolved for one
// sandbox: the only way a name entry of the policy makes an IP reachable.
type bindings struct {
	mu   sync.Mutex
	byIP map[netip.Addr]map[string]time.Time
}

func newBindings() *bindings { return &bindings{byIP: map[netip.Addr]map[string]time.Time{}} }

func (b *bindings) add(name string, ip netip.Addr, until time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	m := b.byIP[ip]
	if m == nil {
		m = map[string]time.Time{}
		b.byIP[ip] = m
	}
	if until.After(m[name]) {
		m[name] = until
	}
}

// names returns the live names bound to ip.
func (b *bindings) names(ip netip.Addr) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	t := time.Now()
	var out []string
	for name, until := range b.byIP[ip] {
		if t.Before(until) {
			out = append(out, name)
		} else {
			delete(b.byIP[ip], name)
		}
	}
	if len(b.byIP[ip]) == 0 {
		delete(b.byIP, ip)
	}
	return out
}

func (b *bindings) has(name string, ip netip.Addr) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	until, ok := b.byIP[ip][name]
	return ok && time.Now().Before(until)
}

// dnsGuard bounds what a sandbox can push through DNS, and what its DNS
// can make the gateway (which every sandbox shares) do: a query rate,
// distinct names per wildcard zone per window (data hidden in
// <data>.allowed-zone labels), and a few workers with a short queue for
// the queries that pass the rate (one goroutine per datagram let a flood
// of 369k datagrams in 2 s take the gateway from 60 to 305 MB).
type dnsGuard struct {
	lim     Limits
	rate    *rate.Limiter
	mu      sync.Mutex
	zones   map[string]map[string]struct{}
	started time.Time

	work    chan func()  // UDP queries (and lookups after a decision) waiting for a worker
	workers atomic.Int32 // running workers, ≤ dnsWorkers
	dropped atomic.Int64 // UDP queries dropped with the queue full
	// deciding counts the goroutines of UDP queries waiting for a policy
	// decision, ≤ maxHeldDNS.
	deciding atomic.Int32
}

const (
	// dnsWorkers bounds the goroutines answering one link's UDP queries
	// at once (a lookup waits up to ~3 s for the upstream).
	dnsWorkers = 8
	// dnsQueueLen bounds the queries waiting for a worker; at least the
	// rate limiter's burst, so a burst the limiter admits is queued whole
	// unless the upstream is slow. A datagram that finds it full is
	// dropped (counted; a drop event, rate-bounded).
	dnsQueueLen = 256
)

func newDNSGuard(lim Limits) *dnsGuard {
	// Burst: one second's worth, so a burst of queries over t seconds
	// admits at most rate×(1+t) (Limits.DNSPerSecond).
	burst := max(1, int(lim.DNSPerSecond))
	return &dnsGuard{lim: lim, rate: rate.NewLimiter(rate.Limit(lim.DNSPerSecond), burst),
		zones: map[string]map[string]struct{}{}, started: time.Now(), work: make(chan func(), dnsQueueLen)}
}

// push queues job for one of the link's DNS workers, starting one if
// fewer than dnsWorkers run; false if the queue is full. Workers exist
// only while there is work: an idle link has none.
func (d *dnsGuard) push(job func()) bool {
	select {
	case d.work <- job:
	default:
		return false
	}
	for {
		n := d.workers.Load()
		if n >= dnsWorkers {
			return true
		}
		if d.workers.CompareAndSwap(n, n+1) {
			go d.worker()
			return true
		}
	}
}

func (d *dnsGuard) worker() {
	for {
		select {
		case job := <-d.work:
			job()
			continue
		default:
		}
		d.workers.Add(-1)
		// A push between the look above and the decrement counted this
		// worker as running and started none: look again.
		if len(d.work) == 0 {
			return
		}
		if d.workers.Add(1) > dnsWorkers {
			d.workers.Add(-1)
			return
		}
	}
}

// admit says why a query for name (under zone; "" if none) is refused, or
// "". The rate was checked before (serveDNSUDP, serveDNSTCP).
func (d *dnsGuard) admit(name, zone string) string {
	if zone == "" {
		return ""
	}
	for _, label := range strings.Split(name, ".") {
		if len(label) > d.lim.MaxLabel {
			return fmt.Sprintf("label longer than %d under wildcard zone %s", d.lim.MaxLabel, zone)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if time.Since(d.started) > d.lim.ZoneWindow {
		d.zones = map[string]map[string]struct{}{}
		d.started = time.Now()
	}
	names := d.zones[zone]
	if names == nil {
		names = map[string]struct{}{}
		d.zones[zone] = names
	}
	if _, seen := names[name]; !seen {
		if len(names) >= d.lim.NamesPerZone {
			return fmt.Sprintf("more than %d distinct names under %s", d.lim.NamesPerZone, zone)
		}
		names[name] = struct{}{}
	}
	return ""
}

const rateLimited = "dns query rate limit"

// serveDNSUDP answers queries sent to the gateway's port 53. One reader
// per link takes each datagram, charges it to the rate limiter first (an
// over-rate query is REFUSED right there, with no copy, goroutine or
// queue slot), and queues the rest for the link's few workers.
func (l *link) serveDNSUDP() error {
	pc, err := gonet.DialUDP(l.stack, &tcpip.FullAddress{NIC: nicID, Addr: tcpip.AddrFrom4(gatewayAddr.As4()), Port: 53}, nil, ipv4.ProtocolNumber)
	if err != nil {
		return fmt.Errorf("gateway: dns listener: %w", err)
	}
	go func() {
		defer pc.Close()
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return // the stack is gone
			}
			l.queries.Add(1)
			if !l.dns.rate.Allow() {
				if resp := l.refuse(buf[:n], 512, rateLimited); resp != nil {
					_, _ = pc.WriteTo(resp, from)
				}
				continue
			}
			q := append([]byte(nil), buf[:n]...)
			if !l.dns.push(func() { l.answerUDP(pc, q, from) }) {
				l.dnsQueueFull()
			}
		}
	}()
	return nil
}

func (l *link) dnsQueueFull() {
	l.dns.dropped.Add(1)
	l.dropEvent(api.NetworkEvent{Protocol: "dns", IP: gatewayAddr.String(), Port: 53,
		Reason: fmt.Sprintf("%d queries already waiting for an answer", dnsQueueLen)})
}

// answerUDP answers one UDP query in a worker. A query the temporal policy
// is asked about leaves the worker for a goroutine of its own (the answer
// may wait for an approval; at most maxHeldDNS wait at once) and comes
// back to the queue for its lookup.
func (l *link) answerUDP(pc net.PacketConn, q []byte, from net.Addr) {
	if l.ctx.Err() != nil {
		return // the link is gone
	}
	write := func(resp []byte) {
		if resp != nil {
			_, _ = pc.WriteTo(resp, from)
		}
	}
	resp, x := l.check(q, 512)
	if x == nil {
		write(resp)
		return
	}
	if !l.decideOn.Load() {
		write(l.lookup(x))
		return
	}
	// Counted from before the goroutine starts (heldDNS counts only from
	// inside decideDNS), so a burst cannot start more than maxHeldDNS.
	if l.dns.deciding.Add(1) > maxHeldDNS {
		l.dns.deciding.Add(-1)
		write(l.tooManyHeld(x))
		return
	}
	go func() {
		defer l.dns.deciding.Add(-1)
		if resp := l.decideQuery(x); resp != nil {
			write(resp)
			return
		}
		if !l.dns.push(func() {
			if l.ctx.Err() == nil {
				write(l.lookup(x))
			}
		}) {
			l.dnsQueueFull()
		}
	}()
}

// serveDNSTCP answers length-prefixed queries on one TCP connection, one
// at a time (the connection's own goroutine; at most maxDNSTCP of them).
func (l *link) serveDNSTCP(c net.Conn) {
	defer c.Close()
	for {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		var n uint16
		if err := binary.Read(c, binary.BigEndian, &n); err != nil {
			return
		}
		q := make([]byte, n)
		if _, err := io.ReadFull(c, q); err != nil {
			return
		}
		l.queries.Add(1)
		var resp []byte
		if l.dns.rate.Allow() {
			resp = l.answer(q, 65535)
		} else {
			resp = l.refuse(q, 65535, rateLimited)
		}
		if resp == nil {
			return
		}
		out := binary.BigEndian.AppendUint16(nil, uint16(len(resp)))
		if _, err := c.Write(append(out, resp...)); err != nil {
			return
		}
	}
}

// refuse is the REFUSED reply to a query refused before any other work
// (why: the limit event's reason), nil if it is not a DNS query.
func (l *link) refuse(query []byte, maxSize int, why string) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil || h.Response {
		return nil
	}
	qs, _ := p.AllQuestions()
	ev := api.NetworkEvent{Protocol: "dns", Verdict: api.VerdictLimit, Reason: why}
	if len(qs) > 0 {
		ev.Name = canonicalName(qs[0].Name)
	}
	l.events.add(ev)
	return reply(h, qs, dnsmessage.RCodeRefused, nil, maxSize)
}

// canonicalName is the one form of a question's name the gateway uses:
// lowercase, without the final dot. The policy, the distinct-names bound
// and the upstream all see this form, never the sandbox's letter case.
func canonicalName(n dnsmessage.Name) string {
	return strings.TrimSuffix(strings.ToLower(n.String()), ".")
}

// dnsQuery is one query between answer's steps.
type dnsQuery struct {
	h       dnsmessage.Header
	qs      []dnsmessage.Question // as the sandbox asked (the reply echoes them)
	name    string                // canonicalName of the question
	rule    string                // what allowed it
	ev      api.NetworkEvent
	maxSize int
}

// answer builds the reply to one query (nil: drop it, it is not DNS); the
// rate was charged before.
func (l *link) answer(query []byte, maxSize int) []byte {
	resp, x := l.check(query, maxSize)
	if x == nil {
		return resp
	}
	if resp := l.decideQuery(x); resp != nil {
		return resp
	}
	return l.lookup(x)
}

// check is answer's first step, what never waits: the query parsed and
// held against the network policy and the zone bounds. It returns the
// reply, or the query to go on with.
func (l *link) check(query []byte, maxSize int) ([]byte, *dnsQuery) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil || h.Response {
		return nil, nil
	}
	qs, err := p.AllQuestions()
	if err != nil || len(qs) != 1 || h.OpCode != 0 {
		return reply(h, qs, dnsmessage.RCodeFormatError, nil, maxSize), nil
	}
	q := qs[0]
	name := canonicalName(q.Name)
	ev := api.NetworkEvent{Protocol: "dns", Name: name}
	pol := l.policy.Load()
	rule, ok := pol.NameAllowed(name)
	if !ok || q.Class != dnsmessage.ClassINET {
		ev.Verdict, ev.Reason = api.VerdictDeny, "name not allowed"
		l.events.add(ev)
		return reply(h, qs, dnsmessage.RCodeNameError, nil, maxSize), nil
	}
	if why := l.dns.admit(name, pol.Zone(name)); why != "" {
		ev.Verdict, ev.Reason = api.VerdictLimit, why
		l.events.add(ev)
		return reply(h, qs, dnsmessage.RCodeRefused, nil, maxSize), nil
	}
	return nil, &dnsQuery{h: h, qs: qs, name: name, rule: rule, ev: ev, maxSize: maxSize}
}

// decideQuery asks the temporal policy (decide.go), which has the last
// word; its deny looks like the network policy's. It returns the reply to
// a refused query, nil to go on.
func (l *link) decideQuery(x *dnsQuery) []byte {
	d, limited := l.decideDNS(x.name)
	if limited {
		return l.tooManyHeld(x)
	}
	if !d.Allowed() {
		x.ev.Verdict, x.ev.Reason = api.VerdictDeny, deniedBy(d)
		l.events.add(x.ev)
		return reply(x.h, x.qs, dnsmessage.RCodeNameError, nil, x.maxSize)
	}
	x.rule = allowedBy(x.rule, d)
	return nil
}

func (l *link) tooManyHeld(x *dnsQuery) []byte {
	x.ev.Verdict, x.ev.Reason = api.VerdictLimit, "too many dns queries waiting for a policy decision"
	l.events.add(x.ev)
	return reply(x.h, x.qs, dnsmessage.RCodeRefused, nil, x.maxSize)
}

// lookup is answer's last step: the upstream's A records, filtered and
// bound.
func (l *link) lookup(x *dnsQuery) []byte {
	q, name, ev, h, qs, maxSize := x.qs[0], x.name, x.ev, x.h, x.qs, x.maxSize
	if q.Type != dnsmessage.TypeA {
		// The link is IPv4 only; nothing but addresses ever leaves here
		// (a TXT or NULL answer is a channel).
		ev.Verdict, ev.Reason = api.VerdictAllow, x.rule+" (no data for type "+strings.TrimPrefix(q.Type.String(), "Type")+")"
		l.events.add(ev)
		return reply(h, qs, dnsmessage.RCodeSuccess, nil, maxSize)
	}
	start := time.Now()
	ips, ttl, rcode, err := l.resolve(name)
	ev.DurationMS = float64(time.Since(start).Microseconds()) / 1000
	if err != nil {
		ev.Verdict, ev.Reason = api.VerdictError, "upstream: "+err.Error()
		l.events.add(ev)
		return reply(h, qs, dnsmessage.RCodeServerFailure, nil, maxSize)
	}
	if ttl < l.g.opts.MinTTL {
		ttl = l.g.opts.MinTTL
	}
	var kept []netip.Addr
	var removed []string
	for _, ip := range ips {
		if why := l.unreachable(ip); why != "" {
			removed = append(removed, ip.String()+" ("+why+")")
			continue
		}
		kept = append(kept, ip)
	}
	until := time.Now().Add(max(time.Duration(ttl)*time.Second, l.g.opts.BindingTTL))
	for _, ip := range kept {
		l.bindings.add(name, ip, until)
		ev.Answers = append(ev.Answers, ip.String())
	}
	ev.Verdict, ev.Reason = api.VerdictAllow, x.rule
	if len(removed) > 0 {
		ev.Reason += "; removed " + strings.Join(removed, ", ")
	}
	l.events.add(ev)
	var rrs []dnsmessage.Resource
	for _, ip := range kept {
		alias, _ := toSandbox(ip)
		rrs = append(rrs, dnsmessage.Resource{
			// The sandbox's own question name (and case): resolvers
			// check the answer matches what they asked.
			Header: dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: ttl},
			Body:   &dnsmessage.AResource{A: alias.As4()},
		})
	}
	return reply(h, qs, rcode, rrs, maxSize)
}

// unreachable says why an answer's address may never be bound, or "":
// non-public addresses stay out unless the operator opened their range and
// the sandbox's policy opens them too (its allow_private, or an allow_out
// IP/CIDR): netpolicy's UnreachableAnswer.
func (l *link) unreachable(ip netip.Addr) string {
	if _, ok := toSandbox(ip); !ok {
		return "no address in the sandbox for it"
	}
	return l.policy.Load().UnreachableAnswer(ip)
}

// resolve asks the upstream for name's A records, following the CNAME
// chain the upstream returns; only the final addresses come back.
//
// Nothing in the upstream query is the sandbox's choice but which allowed
// name it asks for (and when): the name goes in its canonical form (the
// one the policy and the distinct-names bound counted — sending the
// sandbox's letter case would let it carry a bit per letter, 0x20
// encoding, past those bounds), type A and class IN always, a random ID of
// the gateway's, RD the only flag, no EDNS or other additional records.
// The sandbox's ID, flags, EDNS options and case stay between it and the
// gateway.
func (l *link) resolve(name string) ([]netip.Addr, uint32, dnsmessage.RCode, error) {
	if l.g.opts.DNSUpstream == "" {
		return nil, 0, 0, errors.New("no upstream resolver configured (--dns-upstream)")
	}
	qn, err := dnsmessage.NewName(name + ".")
	if err != nil {
		return nil, 0, 0, err
	}
	q := dnsmessage.Question{Name: qn, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	c, err := l.g.opts.Dialer.DialContext(ctx, "udp", l.g.opts.DNSUpstream)
	if err != nil {
		return nil, 0, 0, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	id := uint16(rand.Uint32())
	msg := dnsmessage.Message{Header: dnsmessage.Header{ID: id, RecursionDesired: true}, Questions: []dnsmessage.Question{q}}
	b, err := msg.Pack()
	if err != nil {
		return nil, 0, 0, err
	}
	if _, err := c.Write(b); err != nil {
		return nil, 0, 0, err
	}
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return nil, 0, 0, err
		}
		var resp dnsmessage.Message
		if resp.Unpack(buf[:n]) != nil || resp.ID != id || !resp.Response || len(resp.Questions) != 1 ||
			!strings.EqualFold(resp.Questions[0].Name.String(), qn.String()) ||
			resp.Questions[0].Type != q.Type || resp.Questions[0].Class != q.Class {
			continue // not the answer to our question: keep waiting
		}
		if resp.RCode != dnsmessage.RCodeSuccess {
			return nil, 0, resp.RCode, nil
		}
		return chain(qn, resp.Answers)
	}
}

// chain follows CNAMEs from name through answers and returns the A records
// at the end with the smallest TTL seen.
func chain(name dnsmessage.Name, answers []dnsmessage.Resource) ([]netip.Addr, uint32, dnsmessage.RCode, error) {
	target := strings.ToLower(name.String())
	ttl := uint32(1<<32 - 1)
	for hops := 0; hops < 8; hops++ {
		var ips []netip.Addr
		next := ""
		for _, rr := range answers {
			if strings.ToLower(rr.Header.Name.String()) != target {
				continue
			}
			switch body := rr.Body.(type) {
			case *dnsmessage.AResource:
				ips = append(ips, netip.AddrFrom4(body.A))
				ttl = min(ttl, rr.Header.TTL)
			case *dnsmessage.CNAMEResource:
				next = strings.ToLower(body.CNAME.String())
				ttl = min(ttl, rr.Header.TTL)
			}
		}
		if len(ips) > 0 || next == "" {
			if len(ips) == 0 {
				ttl = 0
			}
			return ips, ttl, dnsmessage.RCodeSuccess, nil
		}
		target = next
	}
	return nil, 0, 0, errors.New("cname chain too long")
}

func reply(h dnsmessage.Header, qs []dnsmessage.Question, rcode dnsmessage.RCode, answers []dnsmessage.Resource, maxSize int) []byte {
	if len(qs) > 1 {
		qs = qs[:1]
	}
	m := dnsmessage.Message{
		Header: dnsmessage.Header{ID: h.ID, Response: true, OpCode: h.OpCode, RecursionDesired: h.RecursionDesired,
			RecursionAvailable: true, RCode: rcode},
		Questions: qs,
		Answers:   answers,
	}
	b, err := m.Pack()
	for err == nil && len(b) > maxSize && len(m.Answers) > 0 {
		m.Answers = m.Answers[:len(m.Answers)-1]
		m.Header.Truncated = true
		b, err = m.Pack()
	}
	if err != nil {
		return nil
	}
	return b
}
