package gateway

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/proxy"
	"golang.org/x/time/rate"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/waiter"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/sniff"
	"github.com/spacehq/space/internal/netpolicy"
)

const (
	// maxDNSTCP bounds a sandbox's simultaneous DNS-over-TCP connections.
	maxDNSTCP   = 16
	peekMax     = 16 << 10
	peekTimeout = 10 * time.Second
	// opaqueWait is how long a connection allowed for a server-speaks-first
	// protocol (an entry with an explicit port) waits for the client's
	// first bytes before it is relayed as opaque.
	opaqueWait  = 300 * time.Millisecond
	dialTimeout = 10 * time.Second
)

// handleTCP decides one SYN of the sandbox.
func (l *link) handleTCP(r *tcp.ForwarderRequest) {
	id := r.ID()
	dst := netip.AddrFrom4(id.LocalAddress.As4())
	port := id.LocalPort
	if dst == gatewayAddr {
		if port != 53 {
			l.events.add(api.NetworkEvent{Protocol: "tcp", IP: dst.String(), Port: int(port), Verdict: api.VerdictDeny,
				Reason: "the gateway serves only DNS"})
			r.Complete(true)
			return
		}
		// DNS over TCP holds a goroutine and an endpoint per connection in
		// the process every sandbox shares: a few at a time, at the rate
		// of other connections.
		if !l.connLimit.Allow() || l.dnsTCP.Add(1) > maxDNSTCP {
			l.dnsTCP.Add(-1)
			r.Complete(true)
			return
		}
		defer l.dnsTCP.Add(-1)
		c, err := l.accept(r)
		if err != nil {
			return
		}
		l.serveDNSTCP(c)
		return
	}
	dst = toHost(dst)
	ev := api.NetworkEvent{Protocol: "tcp", IP: dst.String(), Port: int(port)}
	refuse := func(verdict, reason string) {
		ev.Verdict, ev.Reason = verdict, reason
		// A flood of refused SYNs must not churn the ring: refusals by a
		// limit are recorded at a bounded rate, like dropped packets.
		if verdict != api.VerdictLimit || l.dropEvents.Allow() {
			l.events.add(ev)
		}
		r.Complete(true)
	}
	if !l.connLimit.Allow() {
		refuse(api.VerdictLimit, "new connection rate limit")
		return
	}
	// Every connection counts from its SYN to its close: one still
	// silent, one waiting for a decision or a dial, one relayed.
	if int(l.open.Add(1)) > l.g.opts.Limits.MaxConns {
		l.open.Add(-1)
		refuse(api.VerdictLimit, fmt.Sprintf("more than %d open connections", l.g.opts.Limits.MaxConns))
		return
	}
	defer l.open.Add(-1)
	pol := l.policy.Load()
	// By address alone (an allowed CIDR, or internet): no name to prove.
	v := pol.Check("", dst, port)
	byAddr := v.Allow
	// opaque is an allowed name bound to dst whose entry has an explicit
	// port: it also allows protocols that name nothing.
	opaque := ""
	if !byAddr {
		// Else some allowed name this sandbox resolved to dst must claim it.
		candidates := l.bindings.names(dst)
		any := false
		reason := "not resolved for an allowed name by this sandbox; " + v.Reason
		for _, n := range candidates {
			nv := pol.Check(n, dst, port)
			if nv.Allow {
				any = true
				if nv.OpaqueOK && opaque == "" {
					opaque = n
				}
			} else {
				reason = n + ": " + nv.Reason // why the name bound here does not open it
			}
		}
		if !any {
			refuse(api.VerdictDeny, reason)
			return
		}
	}
	c, err := l.accept(r)
	if err != nil {
		return
	}
	name, head, reason, ok := "", []byte(nil), v.Reason, true
	if !byAddr {
		name, head, ev.Protocol, reason, ok = l.proveName(c, pol, dst, port, opaque)
	} else if n, h, isTLS := l.sniffByAddr(c, dst); isTLS {
		name, head, ev.Protocol = n, h, "tls"
	} else {
		head = h
	}
	ev.Name = name
	if !ok {
		ev.Verdict, ev.Reason = api.VerdictDeny, reason
		l.events.add(ev)
		abort(c)
		return
	}
	// The temporal policy has the last word (decide.go), before the host
	// dials anything.
	d, exe := l.decideConnect(id, name, ev.Protocol, dst, port)
	ev.Exe = exe
	if !d.Allowed() {
		ev.Verdict, ev.Reason = api.VerdictDeny, deniedBy(d)
		l.events.add(ev)
		abort(c)
		return
	}
	reason = allowedBy(reason, d)
	if br := l.interceptor(pol, name); br != nil && ev.Protocol == "tls" {
		l.intercept(c, head, &ev, br, name, dst, port, reason) // credential brokering (mitm.go)
		return
	}
	l.relay(c, head, &ev, name, dst, port, reason, !byAddr && ev.Protocol == "tcp")
}

type countingWriter struct {
	w     io.Writer
	bw    *rate.Limiter
	n     *int64
	total counter
}

func (c *countingWriter) Write(p []byte) (int, error) {
	if c.bw != nil {
		_ = c.bw.WaitN(context.Background(), min(len(p), c.bw.Burst()))
	}
	k, err := c.w.Write(p)
	*c.n += int64(k)
	c.total.Add(int64(k))
	return k, err
}

// proveName reads the client's first bytes and returns the allowed name
// they claim for dst:port (TLS SNI or HTTP Host), the bytes read, the
// protocol seen and the rule, or ok=false with the reason.
func (l *link) proveName(c net.Conn, pol *netpolicy.Policy, dst netip.Addr, port uint16, opaque string) (name string, head []byte, proto, reason string, ok bool) {
	// A name entry with an explicit port (opaque) also allows protocols
	// where the server speaks first: wait only briefly for client bytes.
	wait := peekTimeout
	if opaque != "" {
		wait = opaqueWait
	}
	_ = c.SetReadDeadline(time.Now().Add(wait))
	head, res, err := sniff.Peek(c, peekMax)
	_ = c.SetReadDeadline(time.Time{})
	if res.Err != nil && res.Kind != sniff.Unknown {
		p := "tls"
		if res.Kind == sniff.HTTP {
			p = "http"
		}
		return res.Name, head, p, p + ": " + res.Err.Error(), false
	}
	switch res.Kind {
	case sniff.TLS:
		proto = "tls"
		if res.Name == "" {
			return "", head, proto, "tls without sni", false
		}
	case sniff.HTTP:
		proto = "http"
		if res.Name == "" {
			return "", head, proto, "http without host", false
		}
	default:
		if opaque != "" {
			// Nothing claimed a name; the entry with a port allowed the
			// protocol as such.
			return opaque, head, "tcp", "opaque protocol to " + opaque + ":" + strconv.Itoa(int(port)), true
		}
		if err != nil && !isTimeout(err) {
			return "", head, "tcp", "connection ended before a tls or http request", false
		}
		return "", head, "tcp", "neither tls with sni nor http with host (allow the name with an explicit port for other protocols)", false
	}
	name = res.Name
	if !l.bindings.has(name, dst) {
		return name, head, proto, fmt.Sprintf("%s names %s, which this sandbox did not resolve to %s", proto, name, dst), false
	}
	v := pol.Check(name, dst, port)
	if !v.Allow {
		return name, head, proto, v.Reason, false
	}
	return name, head, proto, v.Reason, true
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func (l *link) accept(r *tcp.ForwarderRequest) (net.Conn, error) {
	var wq waiter.Queue
	ep, terr := r.CreateEndpoint(&wq)
	if terr != nil {
		r.Complete(true)
		return nil, fmt.Errorf("create endpoint: %s", terr)
	}
	r.Complete(false)
	ep.SocketOptions().SetKeepAlive(true)
	return &stackConn{TCPConn: gonet.NewTCPConn(&wq, ep), ep: ep}, nil
}

// stackConn is the sandbox side of a connection, with its endpoint so it
// can be reset.
type stackConn struct {
	*gonet.TCPConn
	ep tcpip.Endpoint
}

// abort resets a sandbox-side connection (RST, not FIN: the client must not
// take a refused connection for a finished one).
func abort(c net.Conn) {
	if sc, ok := c.(*stackConn); ok {
		sc.ep.Abort()
	}
	_ = c.Close()
}

// dial re-originates to dst:port from the host, through the egress proxy
// if the policy names one (never around it: a proxy that cannot be reached
// fails the connection).
func (l *link) dial(ctx context.Context, pol *netpolicy.Policy, dst netip.Addr, port uint16) (net.Conn, error) {
	addr := netip.AddrPortFrom(dst, port).String()
	px := pol.Proxy()
	if px == nil {
		return l.g.opts.Dialer.DialContext(ctx, "tcp", addr)
	}
	var auth *proxy.Auth
	if px.Username != "" {
		auth = &proxy.Auth{User: px.Username, Password: px.Password}
	}
	d, err := proxy.SOCKS5("tcp", px.Address(), auth, dialerFunc(l.g.opts.Dialer.DialContext))
	if err != nil {
		return nil, fmt.Errorf("egress proxy: %w", err)
	}
	c, err := d.(proxy.ContextDialer).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("egress proxy %s: %w", px.Address(), err)
	}
	return c, nil
}

type dialerFunc func(ctx context.Context, network, address string) (net.Conn, error)

func (f dialerFunc) Dial(network, address string) (net.Conn, error) {
	return f(context.Background(), network, address)
}

// relay is one allowed connection, sandbox side and host side.
type relay struct {
	l         *link
	in, out   net.Conn
	name      string
	ip        netip.Addr
	port      uint16
	once      sync.Once
	closedWhy string
	onAbort   func() // an intercepted connection's pending decisions end
}

// relay dials dst:port and relays c to it. opaque: the connection was
// allowed for name as an opaque protocol before the sandbox sent anything
// naming it (lateProof).
func (l *link) relay(c net.Conn, head []byte, ev *api.NetworkEvent, name string, dst netip.Addr, port uint16, rule string, opaque bool) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	up, err := l.dial(ctx, l.policy.Load(), dst, port)
	cancel()
	if err != nil {
		ev.Verdict, ev.Reason = api.VerdictError, rule+"; dial: "+err.Error()
		l.events.add(*ev)
		abort(c)
		return
	}
	rl := &relay{l: l, in: c, out: up, name: name, ip: dst, port: port}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		abort(c)
		up.Close()
		return
	}
	l.conns[rl] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.conns, rl)
		l.mu.Unlock()
	}()

	var wg sync.WaitGroup
	var outN, inN int64
	var refused atomic.Pointer[refusal]
	var rs *responses
	if ev.Protocol == "http" {
		rs = newResponses()
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		var err error
		switch {
		case ev.Protocol == "http":
			br := bufio.NewReaderSize(io.MultiReader(bytes.NewReader(head), c), maxRelayHead)
			err = l.httpOut(up, br, dst, port, rs, &outN)
		case opaque:
			// Allowed as an opaque protocol before the sandbox spoke:
			// what it sends first is still proved.
			br := bufio.NewReaderSize(io.MultiReader(bytes.NewReader(head), c), maxRelayHead)
			var proto, proved string
			proto, proved, err = l.lateProof(up, c, br, dst, port, &outN)
			ev.Protocol = proto
			if proved != "" {
				ev.Name = proved
			}
		default:
			cw := &countingWriter{w: up, bw: l.bwOut, n: &outN, total: &l.bytesOut}
			if _, err := cw.Write(head); err != nil {
				return
			}
			pump(cw, c)
		}
		if r, ok := err.(*refusal); ok {
			// Nothing more goes upstream; the responses to what was sent
			// still come back (for a while), then the connection is reset.
			refused.Store(r)
			_ = up.SetReadDeadline(time.Now().Add(refusedDrain))
		}
		closeWrite(up)
	}()
	go func() {
		defer wg.Done()
		down := &countingWriter{w: c, bw: l.bwIn, n: &inN, total: &l.bytesIn}
		if rs != nil {
			rs.run(down, up)
		} else {
			pump(down, up)
		}
		if refused.Load() == nil {
			closeWrite(c)
		}
	}()
	wg.Wait()
	if r := refused.Load(); r != nil {
		rl.abort("refused: " + r.reason)
	}
	rl.abort("")
	ev.Verdict, ev.Reason = api.VerdictAllow, rule
	if rl.closedWhy != "" {
		ev.Reason += "; " + rl.closedWhy
	}
	ev.BytesOut, ev.BytesIn = outN, inN
	ev.DurationMS = float64(time.Since(start).Microseconds()) / 1000
	l.events.add(*ev)
}

func (r *relay) abort(why string) {
	r.once.Do(func() {
		r.closedWhy = why
		if r.onAbort != nil {
			r.onAbort()
		}
		if why != "" {
			abort(r.in)
		} else {
			r.in.Close()
		}
		r.out.Close()
	})
}

func (l *link) stillAllowed(pol *netpolicy.Policy, r *relay) bool {
	if pol.Check("", r.ip, r.port).Allow {
		return true
	}
	return r.name != "" && l.bindings.has(r.name, r.ip) && pol.Check(r.name, r.ip, r.port).Allow
}

type counter interface{ Add(int64) int64 }

// pump copies src to dst until either ends (dst a countingWriter where the
// bytes count and the bandwidth cap applies).
func pump(dst io.Writer, src io.Reader) {
	// An idle connection holds a small buffer; one that fills it gets
	// the bulk one.
	buf := make([]byte, idleBuffer)
	for {
		k, err := src.Read(buf)
		if k == len(buf) && len(buf) < relayBuffer {
			nb := make([]byte, relayBuffer)
			copy(nb, buf[:k])
			buf = nb
		}
		if k > 0 {
			if _, werr := dst.Write(buf[:k]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// maxRequestHead bounds the request line and headers of one HTTP request the
// gateway relays.
const maxRequestHead = 64 << 10

// maxRelayHead bounds a request head on a plain-HTTP connection: the
// buffer every such connection holds while idle (the first request's head
// was bounded by peekMax already).
const maxRelayHead = 32 << 10

var errHeadTooLarge = errors.New("head larger than its buffer")

// bufferHead reads until br holds a whole request head (up to the empty
// line), or fails if it does not fit in br's buffer.
func bufferHead(br *bufio.Reader) error {
	from := 0 // scanned already: a trickling peer costs linear work
	for {
		b, _ := br.Peek(br.Buffered())
		if bytes.Contains(b[max(from-3, 0):], []byte("\r\n\r\n")) || bytes.Contains(b[max(from-1, 0):], []byte("\n\n")) {
			return nil
		}
		from = len(b)
		if br.Buffered() >= br.Size() {
			return errHeadTooLarge
		}
		if _, err := br.Peek(br.Buffered() + 1); err != nil {
			if err == io.EOF && br.Buffered() > 0 {
				return io.ErrUnexpectedEOF
			}
			return err
		}
	}
}

// clip shortens s to at most n bytes (for event fields from the sandbox).
func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// relayBuffer is each direction's copy buffer once data flows in bulk: big
// enough for bulk transfers, small enough that a sandbox's 512 connections
// cost at most 64 MiB of the shared gateway; idleBuffer is what a
// direction holds until then.
const (
	relayBuffer = 64 << 10
	idleBuffer  = 4 << 10
)

// refusedDrain is how long the responses to requests already forwarded
// may still come back after the relay refused a later one.
const refusedDrain = 5 * time.Second
