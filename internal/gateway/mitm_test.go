package gateway

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/netpolicy"
)

const (
	phKey   = "SPACE_PH_0123456789abcdef"
	realKey = "sk-real-0123456789"
	phTok   = "SPACE_PH_fedcba9876543210"
	realTok = "tok-real-42"
)

// recordingDecider records every action and answers with deny (if set) for the
// first action it matches.
type recordingDecider struct {
	mu   sync.Mutex
	seen []actions.Action
	deny func(actions.Action) string // "" allows
}

func (d *recordingDecider) Decide(_ context.Context, a actions.Action) actions.Decision {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.seen = append(d.seen, a)
	if d.deny != nil {
		if why := d.deny(a); why != "" {
			return actions.Decision{Verdict: actions.Deny, Reason: why}
		}
	}
	return actions.Decision{Verdict: actions.Allow}
}

func (d *recordingDecider) setDeny(f func(actions.Action) string) {
	d.mu.Lock()
	d.deny = f
	d.mu.Unlock()
}

func (d *recordingDecider) actions(kind string) []actions.Action {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []actions.Action
	for _, a := range d.seen {
		if a.Kind == kind {
			out = append(out, a)
		}
	}
	return out
}

var _ actions.Decider = (*recordingDecider)(nil)

type brokerFixture struct {
	g       *Gateway
	sb      *gatewaytest.SandboxStack
	port    uint16 // the echo server on 127.0.0.2
	sbCA    *gatewaytest.CA
	upCA    *gatewaytest.CA
	decider *recordingDecider
}

// newBrokerFixture: a gateway whose upstream roots are only upCA, a local
// HTTPS echo server on 127.0.0.2 with a certificate from upCA for
// api.test, plain.test and x.svc.test (not wrong.test, which resolves
// there too), and sandbox sb1 attached with policy p.
func newBrokerFixture(t *testing.T, p api.NetworkPolicy) *brokerFixture {
	t.Helper()
	f := &brokerFixture{decider: &recordingDecider{}}
	var err error
	if f.sbCA, err = gatewaytest.NewCA("sandbox sb1 CA"); err != nil {
		t.Fatal(err)
	}
	if f.upCA, err = gatewaytest.NewCA("test internet CA"); err != nil {
		t.Fatal(err)
	}
	cert, err := f.upCA.Issue("api.test", "plain.test", "x.svc.test")
	if err != nil {
		t.Fatal(err)
	}
	port, stop, err := gatewaytest.ServeEcho("127.0.0.2:0", cert)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	f.port = port
	dns := gatewaytest.StartDNS(t, map[string][]string{
		"api.test": {"127.0.0.2"}, "plain.test": {"127.0.0.2"}, "wrong.test": {"127.0.0.2"}, "x.svc.test": {"127.0.0.2"},
	})
	g, err := New(Options{
		DNSUpstream: dns.Addr,
		Policy: netpolicy.Options{
			AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
			Protected:    []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")},
		},
		Dialer:        &gatewaytest.GuardDialer{T: t},
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		Decider:       f.decider,
		UpstreamRoots: f.upCA.Pool(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	if err := g.Attach("sb1", nic, p); err != nil {
		t.Fatal(err)
	}
	nic.Close()
	f.g = g
	f.sb = gatewaytest.NewSandboxStack(t, fds[1])
	return f
}

func (f *brokerFixture) config(secrets ...brokerconf.Secret) brokerconf.Config {
	return brokerconf.Config{CACertPEM: f.sbCA.CertPEM, CAKeyPEM: f.sbCA.KeyPEM, Secrets: secrets}
}

func keySecret(hosts ...string) brokerconf.Secret {
	return brokerconf.Secret{Name: "API_KEY", Hosts: hosts, Placeholder: phKey, Value: []byte(realKey)}
}

// sbConn is an HTTPS connection from inside the sandbox.
type sbConn struct {
	c  *tls.Conn
	br *bufio.Reader
}

// open resolves name in the sandbox (the gateway only connects names it
// resolved) and opens TLS to it, trusting roots.
func (f *brokerFixture) open(t *testing.T, name string, roots ...*gatewaytest.CA) (*sbConn, error) {
	t.Helper()
	if rc, ips, err := f.sb.Query(t, gatewayAddr, name, dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 {
		t.Fatalf("resolve %s: %v %v %v", name, rc, ips, err)
	}
	raw, err := f.sb.Dial(ip2, f.port)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	for _, ca := range roots {
		pool.AddCert(ca.Cert)
	}
	c := tls.Client(raw, &tls.Config{ServerName: name, RootCAs: pool, NextProtos: []string{"h2", "http/1.1"}})
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := c.Handshake(); err != nil {
		raw.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	t.Cleanup(func() { c.Close() })
	return &sbConn{c: c, br: bufio.NewReader(c)}, nil
}

// do sends one request and returns the response and its body.
func (s *sbConn) do(t *testing.T, req *http.Request) (*http.Response, string) {
	t.Helper()
	_ = s.c.SetDeadline(time.Now().Add(10 * time.Second))
	defer s.c.SetDeadline(time.Time{})
	if err := req.Write(s.c); err != nil {
		t.Fatalf("write request: %v", err)
	}
	resp, err := http.ReadResponse(s.br, req)
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return resp, string(b)
}

func get(t *testing.T, host, uri string, hdr ...string) *http.Request {
	t.Helper()
	req, err := http.NewRequest("GET", "https://"+host+uri, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return req
}

func issuer(c *sbConn) string { return c.c.ConnectionState().PeerCertificates[0].Issuer.CommonName }

func (f *brokerFixture) eventsJSON(t *testing.T) string {
	t.Helper()
	var out []api.NetworkEvent
	if err := f.g.Events(context.Background(), "sb1", 0, false, func(ev api.NetworkEvent) error {
		out = append(out, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(out)
	return string(b)
}

func (f *brokerFixture) waitEvent(t *testing.T, match func(api.NetworkEvent) bool) api.NetworkEvent {
	t.Helper()
	for range 100 {
		var hit *api.NetworkEvent
		_ = f.g.Events(context.Background(), "sb1", 0, false, func(ev api.NetworkEvent) error {
			if hit == nil && match(ev) {
				hit = &ev
			}
			return nil
		})
		if hit != nil {
			return *hit
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no such event in %s", f.eventsJSON(t))
	return api.NetworkEvent{}
}

var allowBroker = api.NetworkPolicy{AllowOut: []string{"api.test", "plain.test", "wrong.test", "*.svc.test"}, AllowPrivate: []string{"127.0.0.0/8"}}

// (a) and (f): a placeholder in Authorization and in the query reaches the
// real host as the value; the client saw a leaf of its own CA.
func TestBrokerReplacesPlaceholder(t *testing.T) {
	f := newBrokerFixture(t, allowBroker)
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	// (f) trusting only the real host's CA, the client refuses the gateway.
	if _, err := f.open(t, "api.test", f.upCA); err == nil || !errors.As(err, new(*tls.CertificateVerificationError)) {
		t.Fatalf("a client not trusting the sandbox CA connected: %v", err)
	}
	c, err := f.open(t, "api.test", f.sbCA) // only the sandbox's CA
	if err != nil {
		t.Fatalf("client trusting its CA: %v", err)
	}
	leaf := c.c.ConnectionState().PeerCertificates[0]
	if issuer(c) != "sandbox sb1 CA" || len(leaf.DNSNames) != 1 || leaf.DNSNames[0] != "api.test" || leaf.NotAfter.Sub(leaf.NotBefore) > 26*time.Hour {
		t.Fatalf("leaf: issuer %q names %v validity %v", issuer(c), leaf.DNSNames, leaf.NotAfter.Sub(leaf.NotBefore))
	}
	if _, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok {
		t.Fatalf("leaf key %T, want ECDSA", leaf.PublicKey)
	}
	if p := c.c.ConnectionState().NegotiatedProtocol; p != "http/1.1" {
		t.Fatalf("ALPN %q, want http/1.1", p)
	}
	resp, body := c.do(t, get(t, "api.test", "/v1/x?key="+phKey+"&a=1", "Authorization", "Bearer "+phKey, "X-Other", "keep"))
	if resp.StatusCode != 200 || !strings.Contains(body, "Authorization: Bearer "+realKey+"\n") ||
		!strings.Contains(body, "uri /v1/x?key="+realKey+"&a=1\n") || !strings.Contains(body, "X-Other: keep\n") || strings.Contains(body, phKey) {
		t.Fatalf("upstream saw:\n%s", body)
	}
	ev := f.waitEvent(t, func(ev api.NetworkEvent) bool { return ev.Protocol == "https" })
	if ev.Name != "api.test" || ev.Method != "GET" || ev.Path != "/v1/x" || ev.Status != 200 || ev.Verdict != api.VerdictAllow ||
		len(ev.Secrets) != 1 || ev.Secrets[0] != "API_KEY" {
		t.Fatalf("request event %+v", ev)
	}
	if a := f.decider.actions(actions.SecretUse); len(a) != 1 || a[0].Secret != "API_KEY" || a[0].Name != "api.test" || a[0].Sandbox != "sb1" {
		t.Fatalf("secret-use actions %+v", a)
	}
	if a := f.decider.actions(actions.HTTP); len(a) != 1 || a[0].Method != "GET" || a[0].Path != "/v1/x" || a[0].Name != "api.test" {
		t.Fatalf("http actions %+v", a)
	}
	c.c.Close()
	f.waitEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "tls" && ev.Verdict == api.VerdictAllow && strings.Contains(ev.Reason, "intercepted, 1 requests")
	})
	if s := f.eventsJSON(t); strings.Contains(s, realKey) {
		t.Fatalf("an event carries the secret's value: %s", s)
	}
}

// (b) A secret's Header template sets the header (a wildcard host); a
// header rule sets a header from a secret and removes another.
func TestBrokerHeaderTemplateAndRules(t *testing.T) {
	p := allowBroker
	p.Rules = []api.HeaderRule{{Domain: "*.svc.test", SetHeaders: map[string]string{"X-Rule": "r-{secret:TOKEN}", "X-Bad": "{secret:API_KEY}"},
		RemoveHeaders: []string{"X-Drop"}}}
	f := newBrokerFixture(t, p)
	tok := brokerconf.Secret{Name: "TOKEN", Hosts: []string{"*.svc.test"}, Header: "x-api-key: tok {}", Placeholder: phTok, Value: []byte(realTok)}
	if err := f.g.SetBroker("sb1", f.config(tok, keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	c, err := f.open(t, "x.svc.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	_, body := c.do(t, get(t, "x.svc.test", "/", "X-Drop", "gone", "X-Keep", phKey))
	for _, want := range []string{"X-Api-Key: tok " + realTok + "\n", "X-Rule: r-" + realTok + "\n", "X-Keep: " + phKey + "\n"} {
		if !strings.Contains(body, want) {
			t.Fatalf("upstream lacks %q:\n%s", want, body)
		}
	}
	// X-Bad names a secret not granted for this host: never set.
	if strings.Contains(body, "X-Drop") || strings.Contains(body, "X-Bad") || strings.Contains(body, realKey) {
		t.Fatalf("upstream saw:\n%s", body)
	}
	ev := f.waitEvent(t, func(ev api.NetworkEvent) bool { return ev.Protocol == "https" })
	if len(ev.Secrets) != 1 || ev.Secrets[0] != "TOKEN" {
		t.Fatalf("secrets used %v", ev.Secrets)
	}
}

// (c) Another allowed host, not a host of any secret, is not intercepted:
// the client sees the real certificate and the placeholder arrives as it
// was sent.
func TestBrokerOtherHostNotIntercepted(t *testing.T) {
	f := newBrokerFixture(t, allowBroker)
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	c, err := f.open(t, "plain.test", f.upCA) // only the real host's CA
	if err != nil {
		t.Fatalf("plain.test through the relay: %v", err)
	}
	if issuer(c) != "test internet CA" {
		t.Fatalf("plain.test presented a certificate from %q", issuer(c))
	}
	// The client's ALPN offer reached the real server untouched (h2
	// taken); the gateway alone would have answered http/1.1.
	if p := c.c.ConnectionState().NegotiatedProtocol; p != "h2" {
		t.Fatalf("ALPN %q through the plain relay, want the server's h2", p)
	}
	_, body := f.openH1(t, "plain.test").do(t, get(t, "plain.test", "/?k="+phKey, "Authorization", "Bearer "+phKey))
	if !strings.Contains(body, "Authorization: Bearer "+phKey+"\n") || !strings.Contains(body, "uri /?k="+phKey+"\n") || strings.Contains(body, realKey) {
		t.Fatalf("upstream saw:\n%s", body)
	}
	if s := f.eventsJSON(t); strings.Contains(s, `"protocol":"https"`) {
		t.Fatalf("plain.test was intercepted: %s", s)
	}
	if len(f.decider.actions(actions.SecretUse)) != 0 {
		t.Fatal("a secret was used on plain.test")
	}
}

func (f *brokerFixture) openH1(t *testing.T, name string) *sbConn {
	t.Helper()
	raw, err := f.sb.Dial(ip2, f.port)
	if err != nil {
		t.Fatal(err)
	}
	c := tls.Client(raw, &tls.Config{ServerName: name, RootCAs: f.upCA.Pool(), NextProtos: []string{"http/1.1"}})
	if err := c.Handshake(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &sbConn{c: c, br: bufio.NewReader(c)}
}

// (d) SetBroker takes effect on the next request of a kept-alive
// connection: a new value is sent; without the secret the placeholder
// passes unreplaced.
func TestBrokerRotationAndRevocation(t *testing.T) {
	f := newBrokerFixture(t, allowBroker)
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	c, err := f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	auth := func() string {
		_, body := c.do(t, get(t, "api.test", "/", "Authorization", "Bearer "+phKey))
		for _, l := range strings.Split(body, "\n") {
			if v, ok := strings.CutPrefix(l, "Authorization: "); ok {
				return v
			}
		}
		t.Fatalf("no Authorization in\n%s", body)
		return ""
	}
	if got := auth(); got != "Bearer "+realKey {
		t.Fatalf("first: %q", got)
	}
	rotated := keySecret("api.test")
	rotated.Value = []byte("sk-rotated-777")
	if err := f.g.SetBroker("sb1", f.config(rotated)); err != nil {
		t.Fatal(err)
	}
	if got := auth(); got != "Bearer sk-rotated-777" {
		t.Fatalf("after rotation: %q", got)
	}
	if err := f.g.SetBroker("sb1", f.config()); err != nil { // the grant revoked
		t.Fatal(err)
	}
	if got := auth(); got != "Bearer "+phKey {
		t.Fatalf("after revocation: %q", got)
	}
	if err := f.g.SetBroker("nope", f.config()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("SetBroker of an unattached id: %v", err)
	}
}

// (e) A real host whose certificate is not valid for the name fails the
// connection; nothing is relayed unverified.
func TestBrokerUpstreamMustVerify(t *testing.T) {
	f := newBrokerFixture(t, allowBroker)
	if err := f.g.SetBroker("sb1", f.config(keySecret("wrong.test", "api.test"))); err != nil {
		t.Fatal(err)
	}
	if c, err := f.open(t, "wrong.test", f.sbCA, f.upCA); err == nil {
		// Handshakes can complete before the server's abort arrives.
		_ = c.c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, werr := fmt.Fprintf(c.c, "GET / HTTP/1.1\r\nHost: wrong.test\r\nAuthorization: %s\r\n\r\n", phKey); werr == nil {
			if b, _ := io.ReadAll(c.br); len(b) > 0 {
				t.Fatalf("wrong.test answered: %q", b)
			}
		}
	}
	ev := f.waitEvent(t, func(ev api.NetworkEvent) bool { return ev.Name == "wrong.test" && ev.Protocol == "tls" })
	if ev.Verdict != api.VerdictError || !strings.Contains(ev.Reason, "upstream tls") || !strings.Contains(ev.Reason, "certificate") {
		t.Fatalf("event %+v", ev)
	}
	if len(f.decider.actions(actions.SecretUse)) != 0 {
		t.Fatal("a secret was used toward an unverified host")
	}
}

// (g) A Decider that denies the request, or the secret's use, gets the
// sandbox's client a 403 with the reason; each is an event.
func TestBrokerDeciderDenies(t *testing.T) {
	f := newBrokerFixture(t, allowBroker)
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	f.decider.setDeny(func(a actions.Action) string {
		if a.Kind == actions.HTTP && a.Method == "POST" {
			return "no POSTs to api.test"
		}
		if a.Kind == actions.SecretUse && a.Secret == "API_KEY" {
			return "API_KEY needs approval"
		}
		return ""
	})
	c, err := f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("POST", "https://api.test/items", strings.NewReader("x"))
	resp, body := c.do(t, req)
	if resp.StatusCode != 403 || !strings.Contains(body, "no POSTs to api.test") || resp.Header.Get("Content-Type") != "text/plain; charset=utf-8" {
		t.Fatalf("POST: %d %q", resp.StatusCode, body)
	}
	c, err = f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	resp, body = c.do(t, get(t, "api.test", "/", "Authorization", phKey))
	if resp.StatusCode != 403 || !strings.Contains(body, "API_KEY needs approval") {
		t.Fatalf("GET with the secret: %d %q", resp.StatusCode, body)
	}
	// Without the secret the request goes through.
	c, err = f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	if resp, body = c.do(t, get(t, "api.test", "/")); resp.StatusCode != 200 || !strings.Contains(body, "method GET") {
		t.Fatalf("GET without the secret: %d %q", resp.StatusCode, body)
	}
	f.waitEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "https" && ev.Verdict == api.VerdictDeny && ev.Status == 403 && ev.Method == "POST"
	})
	f.waitEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "https" && ev.Verdict == api.VerdictDeny && len(ev.Secrets) == 1 && strings.Contains(ev.Reason, "needs approval")
	})
}

// Bodies stream both ways (chunked and Content-Length), a kept-alive
// connection cannot switch hosts, and a protocol switch is relayed raw.
func TestBrokerBodiesUpgradeAndHostSwitch(t *testing.T) {
	f := newBrokerFixture(t, allowBroker)
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	c, err := f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	// A chunked request body (unknown length).
	req, _ := http.NewRequest("POST", "https://api.test/up", io.MultiReader(strings.NewReader("hello "), strings.NewReader("body")))
	req.ContentLength = -1
	if resp, body := c.do(t, req); resp.StatusCode != 200 || !strings.Contains(body, "body hello body\n") {
		t.Fatalf("chunked upload: %d %q", resp.StatusCode, body)
	}
	// A Content-Length body, then a chunked response, on the same connection.
	req, _ = http.NewRequest("PUT", "https://api.test/up", strings.NewReader("sized"))
	if resp, body := c.do(t, req); resp.StatusCode != 200 || !strings.Contains(body, "body sized\n") {
		t.Fatalf("sized upload: %d %q", resp.StatusCode, body)
	}
	if resp, body := c.do(t, get(t, "api.test", "/chunked")); resp.StatusCode != 200 || body != "part one\npart two\n" || len(resp.TransferEncoding) == 0 {
		t.Fatalf("chunked response: %d %q %v", resp.StatusCode, body, resp.TransferEncoding)
	}
	// Expect: 100-continue is answered by the gateway.
	req, _ = http.NewRequest("POST", "https://api.test/up", strings.NewReader("after-100"))
	req.Header.Set("Expect", "100-continue")
	if resp, body := c.do(t, req); resp.StatusCode != 100 {
		t.Fatalf("expect: %d %q", resp.StatusCode, body)
	}
	resp, err := http.ReadResponse(c.br, req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("after 100: %v %v", resp, err)
	}
	b, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(b), "body after-100\n") {
		t.Fatalf("after 100: %q", b)
	}
	// Another host on the same connection: 421, connection closed.
	if resp, body := c.do(t, get(t, "plain.test", "/")); resp.StatusCode != 421 || !strings.Contains(body, "plain.test") {
		t.Fatalf("host switch: %d %q", resp.StatusCode, body)
	}
	// Upgrade: after the 101 the bytes are relayed as they are (a
	// placeholder too: nothing is rewritten any more).
	c, err = f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	req = get(t, "api.test", "/ws", "Upgrade", "echo", "Connection", "Upgrade")
	if resp, _ := c.do(t, req); resp.StatusCode != 101 {
		t.Fatalf("upgrade: %d", resp.StatusCode)
	}
	_ = c.c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := "raw " + phKey + " bytes"
	if _, err := io.WriteString(c.c, msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c.br, got); err != nil || string(got) != msg {
		t.Fatalf("after the upgrade: %q %v", got, err)
	}
}

// A connection allowed by its address alone (a CIDR entry) is still
// intercepted when its SNI names a secret's host the sandbox resolved (the
// name entry only lets it resolve).
func TestBrokerInterceptsByAddress(t *testing.T) {
	f := newBrokerFixture(t, api.NetworkPolicy{AllowOut: []string{"127.0.0.2/32", "api.test:1"}})
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	c, err := f.open(t, "api.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	if _, body := c.do(t, get(t, "api.test", "/", "Authorization", phKey)); !strings.Contains(body, "Authorization: "+realKey+"\n") {
		t.Fatalf("upstream saw:\n%s", body)
	}
}

func TestBrokerConfigValidation(t *testing.T) {
	ca, err := gatewaytest.NewCA("ca")
	if err != nil {
		t.Fatal(err)
	}
	other, _ := gatewaytest.NewCA("other")
	good := brokerconf.Secret{Name: "K", Hosts: []string{"api.test"}, Placeholder: phKey, Value: []byte(realKey)}
	cfg := func(mut func(*brokerconf.Config)) brokerconf.Config {
		c := brokerconf.Config{CACertPEM: ca.CertPEM, CAKeyPEM: ca.KeyPEM, Secrets: []brokerconf.Secret{good}}
		mut(&c)
		return c
	}
	if br, err := compileBroker(cfg(func(*brokerconf.Config) {})); err != nil || br == nil {
		t.Fatalf("good config: %v", err)
	}
	if br, err := compileBroker(brokerconf.Config{}); err != nil || br != nil {
		t.Fatalf("empty config: %v %v", br, err)
	}
	bad := map[string]func(*brokerconf.Config){
		"no CA":             func(c *brokerconf.Config) { c.CACertPEM, c.CAKeyPEM = nil, nil },
		"key of another CA": func(c *brokerconf.Config) { c.CAKeyPEM = other.KeyPEM },
		"not a CA":          func(c *brokerconf.Config) { c.CACertPEM = issuePEM(t, ca) },
		"no name":           func(c *brokerconf.Config) { c.Secrets[0].Name = "" },
		"twice":             func(c *brokerconf.Config) { c.Secrets = append(c.Secrets, good) },
		"short placeholder": func(c *brokerconf.Config) { c.Secrets[0].Placeholder = "x" },
		"value with CRLF":   func(c *brokerconf.Config) { c.Secrets[0].Value = []byte(realKey + "\r\nX-Evil: 1") },
		"no hosts":          func(c *brokerconf.Config) { c.Secrets[0].Hosts = nil },
		"bad host":          func(c *brokerconf.Config) { c.Secrets[0].Hosts = []string{"https://api.test/"} },
		"bare wildcard":     func(c *brokerconf.Config) { c.Secrets[0].Hosts = []string{"*.com"} },
		"header without {}": func(c *brokerconf.Config) { c.Secrets[0].Header = "Authorization: Bearer" },
		"framing header":    func(c *brokerconf.Config) { c.Secrets[0].Header = "Host: {}" },
		"header no colon":   func(c *brokerconf.Config) { c.Secrets[0].Header = "Authorization {}" },
	}
	for what, mut := range bad {
		c := cfg(func(c *brokerconf.Config) { c.Secrets = append([]brokerconf.Secret(nil), c.Secrets...) })
		mut(&c)
		_, err := compileBroker(c)
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v", what, err)
			continue
		}
		if strings.Contains(err.Error(), realKey) || strings.Contains(err.Error(), "PRIVATE") {
			t.Errorf("%s: the error quotes a secret: %v", what, err)
		}
	}
}

func issuePEM(t *testing.T, ca *gatewaytest.CA) []byte {
	c, err := ca.Issue("leaf.test")
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]})
}

// The policy decides before interception: a secret's host the policy does
// not allow gets nothing, even with a name claimed over an allowed one's
// address.
func TestBrokerPolicyFirst(t *testing.T) {
	f := newBrokerFixture(t, api.NetworkPolicy{AllowOut: []string{"plain.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	if err := f.g.SetBroker("sb1", f.config(keySecret("api.test"))); err != nil {
		t.Fatal(err)
	}
	if rc, _, _ := f.sb.Query(t, gatewayAddr, "api.test", dnsmessage.TypeA); rc != dnsmessage.RCodeNameError {
		t.Fatalf("api.test resolved: %v", rc)
	}
	f.open(t, "plain.test", f.upCA) // resolves plain.test to the shared address
	raw, err := f.sb.Dial(ip2, f.port)
	if err != nil {
		t.Fatal(err)
	}
	c := tls.Client(raw, &tls.Config{ServerName: "api.test", RootCAs: f.sbCA.Pool()})
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.Handshake(); err == nil {
		t.Fatal("SNI api.test over plain.test's address was served")
	}
	f.waitEvent(t, func(ev api.NetworkEvent) bool { return ev.Name == "api.test" && ev.Verdict == api.VerdictDeny })
	if len(f.decider.actions(actions.SecretUse)) != 0 || len(f.decider.actions(actions.HTTP)) != 0 {
		t.Fatal("an intercepted request was decided")
	}
}

// A header rule alone (a CA, no secret) is enough to intercept its domain.
func TestBrokerRuleOnly(t *testing.T) {
	p := allowBroker
	p.Rules = []api.HeaderRule{{Domain: "plain.test", SetHeaders: map[string]string{"X-Team": "blue"}, RemoveHeaders: []string{"Cookie"}}}
	f := newBrokerFixture(t, p)
	if err := f.g.SetBroker("sb1", f.config()); err != nil {
		t.Fatal(err)
	}
	c, err := f.open(t, "plain.test", f.sbCA)
	if err != nil {
		t.Fatal(err)
	}
	_, body := c.do(t, get(t, "plain.test", "/", "Cookie", "session=1"))
	if !strings.Contains(body, "X-Team: blue\n") || strings.Contains(body, "Cookie") {
		t.Fatalf("upstream saw:\n%s", body)
	}
	// Without a CA nothing can be intercepted: the rule's domain is relayed.
	if err := f.g.SetBroker("sb1", brokerconf.Config{}); err != nil {
		t.Fatal(err)
	}
	c2 := f.openH1(t, "plain.test")
	if issuer(c2) != "test internet CA" {
		t.Fatalf("intercepted without a config: %s", issuer(c2))
	}
}
