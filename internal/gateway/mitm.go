package gateway

// Credential brokering's wire side. A TLS connection whose proven name is a
// host of one of the sandbox's brokered secrets, or the domain of one of
// its policy's header rules, is intercepted: the gateway terminates TLS
// toward the sandbox with a leaf issued by the sandbox's own CA, dials the
// real host (the same dial path as the plain relay, egress proxy included)
// and re-originates TLS verifying the host's real certificate, then relays
// HTTP/1.1 requests one at a time, putting secrets in (placeholders
// replaced, headers set) only on requests to the hosts they belong to.
// Every other connection keeps the plain byte relay.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/gateway/sniff"
	"github.com/spacehq/space/internal/netpolicy"
)

// httpALPN is the only protocol the gateway speaks on an intercepted
// connection, both ways: a client offered h2 and http/1.1 gets http/1.1.
var httpALPN = []string{"http/1.1"}

// hostRule is a policy header rule, its domain canonical.
type hostRule struct {
	domain string
	set    [][2]string // canonical header name, value (maybe with {secret:NAME})
	remove []string
}

type ruleCache struct {
	pol   *netpolicy.Policy
	rules []hostRule
}

// rules returns pol's header rules, compiled once per policy.
func (l *link) rules(pol *netpolicy.Policy) []hostRule {
	if c := l.ruleCache.Load(); c != nil && c.pol == pol {
		return c.rules
	}
	var out []hostRule
	for _, r := range pol.Source().Rules {
		d, ok := canonicalPattern(r.Domain)
		if !ok {
			continue // Compile validated it; nothing to match otherwise
		}
		hr := hostRule{domain: d}
		keys := make([]string, 0, len(r.SetHeaders))
		for k := range r.SetHeaders {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			hr.set = append(hr.set, [2]string{canonicalHeader(k), r.SetHeaders[k]})
		}
		for _, k := range r.RemoveHeaders {
			hr.remove = append(hr.remove, canonicalHeader(k))
		}
		out = append(out, hr)
	}
	l.ruleCache.Store(&ruleCache{pol: pol, rules: out})
	return out
}

func canonicalHeader(k string) string { return http.CanonicalHeaderKey(k) }

// interceptor returns the broker to intercept a TLS connection naming name
// with, or nil to relay it as is: the sandbox has a CA and name is a host of
// one of its secrets or the domain of one of its policy's header rules.
func (l *link) interceptor(pol *netpolicy.Policy, name string) *broker {
	br := l.broker.Load()
	if br == nil || name == "" {
		return nil
	}
	for _, s := range br.secrets {
		if s.forHost(name) {
			return br
		}
	}
	for _, r := range l.rules(pol) {
		if hostMatch(r.domain, name) {
			return br
		}
	}
	return nil
}

// sniffByAddr is proveName for a connection allowed by its address alone
// (an allowed CIDR, or internet): nothing needs proving, but if the sandbox
// has a broker the TLS SNI decides interception. It peeks only briefly (a
// server-speaks-first protocol must not wait) and only returns a name this
// sandbox resolved to dst, so a secret only ever goes to an address the
// gateway itself resolved for the secret's host.
func (l *link) sniffByAddr(c net.Conn, dst netip.Addr) (name string, head []byte, tls bool) {
	if l.broker.Load() == nil {
		return "", nil, false
	}
	_ = c.SetReadDeadline(time.Now().Add(opaqueWait))
	head, res, _ := sniff.Peek(c, peekMax)
	_ = c.SetReadDeadline(time.Time{})
	if res.Kind != sniff.TLS || res.Err != nil || res.Name == "" || !l.bindings.has(res.Name, dst) {
		return "", head, false
	}
	return res.Name, head, true
}

// intercept serves one intercepted connection: it plays the TLS server to
// the sandbox and the TLS client to the real host, and relays requests.
func (l *link) intercept(c net.Conn, head []byte, ev *api.NetworkEvent, br *broker, name string, dst netip.Addr, port uint16, rule string) {
	start := time.Now()
	ev.Protocol = "tls"
	fail := func(stage string, err error) {
		ev.Verdict, ev.Reason = api.VerdictError, rule+"; intercepted; "+stage+": "+err.Error()
		ev.DurationMS = float64(time.Since(start).Microseconds()) / 1000
		l.events.add(*ev)
		abort(c)
	}
	// The real host first: a sandbox never gets a certificate from us for
	// a host that is not what it claims to be.
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	raw, err := l.dial(ctx, l.policy.Load(), dst, port)
	if err != nil {
		cancel()
		fail("dial", err)
		return
	}
	mc := &meteredConn{Conn: raw, l: l}
	up := tls.Client(mc, &tls.Config{
		ServerName:         name,
		RootCAs:            l.g.opts.UpstreamRoots, // nil: the system roots
		NextProtos:         httpALPN,
		MinVersion:         tls.VersionTLS12,
		ClientSessionCache: br.upSessions,
	})
	err = up.HandshakeContext(ctx)
	cancel()
	if err != nil {
		raw.Close()
		fail("upstream tls (the real certificate of "+name+" did not verify, or the handshake failed; never relayed unverified)", err)
		return
	}
	conf, err := br.serverConfig(name)
	if err != nil {
		raw.Close()
		fail("leaf", err)
		return
	}
	down := tls.Server(&prefixConn{Conn: c, r: io.MultiReader(bytes.NewReader(head), c)}, conf)
	hctx, hcancel := context.WithTimeout(context.Background(), peekTimeout)
	err = down.HandshakeContext(hctx)
	hcancel()
	if err != nil {
		raw.Close()
		fail("sandbox tls (does the sandbox trust its CA?)", err)
		return
	}

	rctx, rcancel := context.WithCancel(context.Background())
	defer rcancel()
	rl := &relay{l: l, in: c, out: raw, name: name, ip: dst, port: port, onAbort: rcancel}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		abort(c)
		raw.Close()
		return
	}
	l.conns[rl] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.conns, rl)
		l.mu.Unlock()
	}()

	n := l.serveIntercepted(rctx, down, up, name, dst, port)
	rl.abort("")
	ev.Verdict = api.VerdictAllow
	ev.Reason = fmt.Sprintf("%s; intercepted, %d requests", rule, n)
	if rl.closedWhy != "" {
		ev.Reason += "; " + rl.closedWhy
	}
	ev.BytesOut, ev.BytesIn = mc.out.Load(), mc.in.Load()
	ev.DurationMS = float64(time.Since(start).Microseconds()) / 1000
	l.events.add(*ev)
}

// serveIntercepted relays HTTP/1.1 requests from the sandbox (down) to the
// real host (up) and their responses back, one at a time, until either
// side ends; it returns how many requests it relayed. Bodies stream (never
// buffered whole); a protocol switch (101) becomes a raw relay.
func (l *link) serveIntercepted(ctx context.Context, down, up net.Conn, host string, dst netip.Addr, port uint16) int {
	// Buffers: what bounds a head each way, and small write buffers (a
	// sandbox may hold hundreds of these connections in the shared process).
	cbr := bufio.NewReaderSize(down, maxRequestHead)
	ubr := bufio.NewReaderSize(up, maxRequestHead)
	cbw := bufio.NewWriterSize(down, 8<<10)
	ubw := bufio.NewWriterSize(up, 8<<10)
	n := 0
	for {
		// The plain HTTP relay's strict reader: one parser for every
		// request, framing every reader agrees on.
		req, res, err := readRequest(cbr)
		if err != nil {
			if err != io.EOF && res.Kind == sniff.HTTP {
				_ = l.refuseOut("https", host, dst, port, "http: "+err.Error())
			}
			return n
		}
		n++
		start := time.Now()
		ev := api.NetworkEvent{Protocol: "https", Name: host, IP: dst.String(), Port: int(port),
			Method: clip(req.Method, 32), Path: clip(req.URL.Path, 1024)}
		done := func(verdict string, status int, reason string) {
			ev.Verdict, ev.Status, ev.Reason = verdict, status, reason
			ev.DurationMS = float64(time.Since(start).Microseconds()) / 1000
			l.events.add(ev)
		}
		refuse := func(status int, reason string) int {
			writeRefusal(cbw, status, reason)
			done(api.VerdictDeny, status, reason)
			// Read (a bounded part of) the body the client is still
			// sending, so closing does not reset the connection before it
			// reads the answer.
			_ = down.SetReadDeadline(time.Now().Add(2 * time.Second))
			_, _ = io.CopyN(io.Discard, req.Body, 1<<20)
			return n
		}
		// The TLS name proved the connection; each request's Host must be
		// that same name (a kept-alive connection cannot switch hosts).
		h := req.Host
		if hh, _, err := net.SplitHostPort(h); err == nil {
			h = hh
		}
		if cn, ok := netpolicy.CanonicalName(h); !ok || cn != host || res.Name != host {
			return refuse(http.StatusMisdirectedRequest, "request names "+clip(h, 255)+" on a connection to "+host)
		}
		if req.Method == http.MethodConnect {
			return refuse(http.StatusMethodNotAllowed, "CONNECT on an intercepted connection")
		}
		req.Host = hostHeader(host, res.HostPort)
		act := actions.Action{Kind: actions.HTTP, Time: start, Sandbox: l.id, Name: host, IP: dst.String(), Port: int(port),
			Method: req.Method, Path: req.URL.Path}
		if d, _ := l.decide(act, nil); !d.Allowed() {
			return refuse(http.StatusForbidden, "denied by policy: "+d.Reason)
		}
		br := l.broker.Load() // the config of this request: SetBroker applies from the next one
		plan := planRewrite(br, l.rules(l.policy.Load()), req, host)
		for _, s := range plan.secrets {
			act := actions.Action{Kind: actions.SecretUse, Time: time.Now(), Sandbox: l.id, Secret: s.name, Name: host}
			if d, _ := l.decide(act, nil); !d.Allowed() {
				ev.Secrets = []string{s.name}
				return refuse(http.StatusForbidden, "use of secret "+s.name+" denied by policy: "+d.Reason)
			}
		}
		plan.apply(req)
		ev.Secrets = plan.names()
		if strings.EqualFold(req.Header.Get("Expect"), "100-continue") {
			// Answered here, so the client sends its body while we relay
			// it (the upstream never sees the expectation).
			req.Header.Del("Expect")
			_, _ = cbw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
			if cbw.Flush() != nil {
				return n
			}
		}
		if _, has := req.Header["User-Agent"]; !has {
			req.Header["User-Agent"] = []string{""} // Write adds Go's own otherwise
		}
		if req.Body != nil && req.Body != http.NoBody {
			req.Body = &flushingBody{ReadCloser: req.Body, w: ubw}
		}
		werr := req.Write(writerOnly{ubw})
		if werr == nil {
			werr = ubw.Flush()
		}
		resp, rerr := readResponse(ubr, req)
		for rerr == nil && resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			// Interim responses (103 Early Hints, a 100 the server sent
			// anyway) go to the client as they are; the final one follows.
			if err := writeInterim(cbw, resp); err != nil {
				return n
			}
			resp, rerr = readResponse(ubr, req)
		}
		if rerr != nil {
			why := "upstream: " + rerr.Error()
			if werr != nil {
				why = "upstream: " + werr.Error()
			}
			writeRefusal(cbw, http.StatusBadGateway, why)
			done(api.VerdictError, http.StatusBadGateway, why)
			return n
		}
		if resp.Body != nil && resp.Body != http.NoBody {
			resp.Body = &flushingBody{ReadCloser: resp.Body, w: cbw}
		}
		err = resp.Write(writerOnly{cbw})
		if err == nil {
			err = cbw.Flush()
		}
		resp.Body.Close()
		if err != nil {
			done(api.VerdictError, resp.StatusCode, "relaying the response: "+err.Error())
			return n
		}
		done(api.VerdictAllow, resp.StatusCode, "intercepted")
		if resp.StatusCode == http.StatusSwitchingProtocols && !res.Upgrade {
			return n // a switch nobody asked for: the framing is not ours to trust
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			// What follows is not HTTP: relay it, without rewriting.
			go func() {
				pump(up, cbr)
				closeWrite(up)
			}()
			pump(down, ubr)
			return n
		}
		if werr != nil || resp.Close || req.Close {
			return n
		}
	}
}

// readResponse reads a response whose head fits br's buffer: an allowed
// host is not necessarily a friendly one, and net/http reads a header line
// of any length.
func readResponse(br *bufio.Reader, req *http.Request) (*http.Response, error) {
	if err := bufferHead(br); err != nil {
		if err == errHeadTooLarge {
			return nil, fmt.Errorf("response head over %d KiB", br.Size()>>10)
		}
		return nil, err
	}
	return http.ReadResponse(br, req)
}

// rewritePlan is what the gateway will put into one request.
type rewritePlan struct {
	host    string
	secrets []*brokerSecret // granted for host and used by the request
	rules   []hostRule      // matching host
	br      *broker
}

// planRewrite finds the secrets a request will carry: those granted for
// host whose placeholder appears in a header value or the query, those
// with a header to set, and those a matching header rule names. A
// placeholder of a secret not granted for host is left as it is.
func planRewrite(br *broker, rules []hostRule, req *http.Request, host string) rewritePlan {
	p := rewritePlan{host: host, br: br}
	for _, r := range rules {
		if hostMatch(r.domain, host) {
			p.rules = append(p.rules, r)
		}
	}
	if br == nil {
		return p
	}
	used := map[*brokerSecret]bool{}
	for _, s := range br.secrets {
		if !s.forHost(host) {
			continue
		}
		if s.header != "" || strings.Contains(req.URL.RawQuery, s.placeholder) || headerHas(req.Header, s.placeholder) {
			used[s] = true
		}
	}
	for _, r := range p.rules {
		for _, kv := range r.set {
			for _, name := range secretRefs(kv[1]) {
				if s := br.byName[name]; s != nil && s.forHost(host) {
					used[s] = true
				}
			}
		}
	}
	for _, s := range br.secrets { // config order: deterministic
		if used[s] {
			p.secrets = append(p.secrets, s)
		}
	}
	return p
}

func headerHas(h http.Header, sub string) bool {
	for _, vs := range h {
		for _, v := range vs {
			if strings.Contains(v, sub) {
				return true
			}
		}
	}
	return false
}

// apply rewrites req: placeholders in header values and the query, then
// the secrets' own headers, then the policy's header rules (the operator's
// word last). A rule value naming a secret not granted for this host is
// not set at all (never sent with the reference unexpanded).
func (p rewritePlan) apply(req *http.Request) {
	for _, s := range p.secrets {
		for _, vs := range req.Header {
			for i, v := range vs {
				if strings.Contains(v, s.placeholder) {
					vs[i] = strings.ReplaceAll(v, s.placeholder, s.value)
				}
			}
		}
		if strings.Contains(req.URL.RawQuery, s.placeholder) {
			req.URL.RawQuery = strings.ReplaceAll(req.URL.RawQuery, s.placeholder, url.QueryEscape(s.value))
		}
		if s.header != "" {
			req.Header[s.header] = []string{strings.ReplaceAll(s.template, "{}", s.value)}
		}
	}
	for _, r := range p.rules {
		for _, k := range r.remove {
			delete(req.Header, k)
		}
		for _, kv := range r.set {
			if v, ok := p.expand(kv[1]); ok {
				req.Header[kv[0]] = []string{v}
			}
		}
	}
}

func (p rewritePlan) names() []string {
	if len(p.secrets) == 0 {
		return nil
	}
	out := make([]string, len(p.secrets))
	for i, s := range p.secrets {
		out[i] = s.name
	}
	return out
}

// expand replaces every "{secret:NAME}" in v with that secret's value; ok
// is false if one is not granted for the plan's host.
func (p rewritePlan) expand(v string) (string, bool) {
	if !strings.Contains(v, "{secret:") {
		return v, true
	}
	var b strings.Builder
	for {
		i := strings.Index(v, "{secret:")
		if i < 0 {
			b.WriteString(v)
			return b.String(), true
		}
		j := strings.IndexByte(v[i:], '}')
		if j < 0 {
			b.WriteString(v)
			return b.String(), true
		}
		name := v[i+len("{secret:") : i+j]
		var s *brokerSecret
		if p.br != nil {
			s = p.br.byName[name]
		}
		if s == nil || !s.forHost(p.host) {
			return "", false
		}
		b.WriteString(v[:i])
		b.WriteString(s.value)
		v = v[i+j+1:]
	}
}

// secretRefs lists the NAMEs of "{secret:NAME}" in v.
func secretRefs(v string) []string {
	var out []string
	for {
		i := strings.Index(v, "{secret:")
		if i < 0 {
			return out
		}
		j := strings.IndexByte(v[i:], '}')
		if j < 0 {
			return out
		}
		out = append(out, v[i+len("{secret:"):i+j])
		v = v[i+j+1:]
	}
}

// writeRefusal answers the sandbox's client with status and a plain-text
// reason, and closes the exchange (the request's body is not read).
func writeRefusal(w *bufio.Writer, status int, reason string) {
	body := reason + "\n"
	fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\nX-Space-Gateway: refused\r\n\r\n%s",
		status, http.StatusText(status), len(body), body)
	_ = w.Flush()
}

func writeInterim(w *bufio.Writer, resp *http.Response) error {
	fmt.Fprintf(w, "HTTP/1.1 %s\r\n", resp.Status)
	if err := resp.Header.Write(w); err != nil {
		return err
	}
	_, _ = w.WriteString("\r\n")
	return w.Flush()
}

// flushingBody flushes w before each read of the body it wraps: what was
// written (the head, earlier chunks) goes out before the relay waits for
// more, so a streamed body (server-sent events, a slow upload) streams,
// while a head and a small body still leave in one TLS record.
type flushingBody struct {
	io.ReadCloser
	w *bufio.Writer
}

func (f *flushingBody) Read(p []byte) (int, error) {
	if f.w.Buffered() > 0 {
		if err := f.w.Flush(); err != nil {
			return 0, err
		}
	}
	return f.ReadCloser.Read(p)
}

// writerOnly hides bufio.Writer's ReadFrom: it would read into its buffer
// while flushingBody flushes that same buffer.
type writerOnly struct{ w io.Writer }

func (w writerOnly) Write(p []byte) (int, error) { return w.w.Write(p) }

// prefixConn replays the bytes proveName already read before the rest.
type prefixConn struct {
	net.Conn
	r io.Reader
}

func (p *prefixConn) Read(b []byte) (int, error) { return p.r.Read(b) }

// meteredConn is the host side of an intercepted connection: it counts
// what goes each way (TLS bytes, as the plain relay counts what it moves)
// and applies the sandbox's bandwidth cap.
type meteredConn struct {
	net.Conn
	l       *link
	out, in atomic.Int64
}

func (m *meteredConn) Write(p []byte) (int, error) {
	if bw := m.l.bwOut; bw != nil {
		_ = bw.WaitN(context.Background(), min(len(p), bw.Burst()))
	}
	k, err := m.Conn.Write(p)
	m.out.Add(int64(k))
	m.l.bytesOut.Add(int64(k))
	return k, err
}

func (m *meteredConn) Read(p []byte) (int, error) {
	k, err := m.Conn.Read(p)
	if k > 0 {
		if bw := m.l.bwIn; bw != nil {
			_ = bw.WaitN(context.Background(), min(k, bw.Burst()))
		}
		m.in.Add(int64(k))
		m.l.bytesIn.Add(int64(k))
	}
	return k, err
}

// brokerEvent records that a sandbox's brokering config was replaced (the
// names of its secrets, never their values).
func brokerEvent(names []string) api.NetworkEvent {
	reason := "broker replaced: no secrets"
	if len(names) > 0 {
		reason = "broker replaced: secrets " + strings.Join(names, ", ")
	}
	return api.NetworkEvent{Protocol: "policy", Verdict: api.VerdictAllow, Reason: reason}
}
