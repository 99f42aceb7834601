package gateway

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/spacehq/space/api"
)

// The shared-CDN setting of issue 25: cdn-a.test (allowed) and cdn-b.test
// (denied) resolve to the same address, one lenient server behind it, and
// the sandbox resolved cdn-a.test. Nothing may ever reach cdn-b.

var ip9 = netip.MustParseAddr("198.19.0.9") // 127.0.0.9 as the sandbox sees it

type cdnFixture struct {
	*fixture
	cdn          *lenientCDN
	port, opPort uint16 // cdn-a.test allowed on port (HTTP/TLS only) and on opPort (any protocol)
}

func newCDNFixture(t *testing.T, lim ...Limits) *cdnFixture {
	t.Helper()
	cdn, ports := startLenientCDN(t, "127.0.0.9", 2)
	pol := api.NetworkPolicy{
		AllowOut:     []string{"cdn-a.test", fmt.Sprintf("cdn-a.test:%d", ports[1])},
		AllowPrivate: []string{"127.0.0.9/32"},
	}
	f := newFixture(t, pol, lim...)
	f.dns.Set("cdn-a.test", []string{"127.0.0.9"})
	f.dns.Set("cdn-b.test", []string{"127.0.0.9"})
	if rc, ips, err := f.sb.Query(t, gatewayAddr, "cdn-a.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 {
		t.Fatalf("resolve cdn-a.test: %v %v %v", rc, ips, err)
	}
	return &cdnFixture{fixture: f, cdn: cdn, port: ports[0], opPort: ports[1]}
}

// step is what the sandbox sends, after a pause.
type step struct {
	wait time.Duration
	data string
}

// send opens a connection to the CDN from the sandbox, sends the steps
// and returns what came back until the gateway or the server ended it.
func (f *cdnFixture) send(t *testing.T, port uint16, steps ...step) (string, error) {
	t.Helper()
	c, err := f.sb.Dial(ip9, port)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(8 * time.Second))
	for _, s := range steps {
		time.Sleep(s.wait)
		if _, err := io.WriteString(c, s.data); err != nil {
			break
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	b, err := io.ReadAll(c)
	return string(b), err
}

// sendDirect sends steps to the CDN from the host, no gateway between.
func sendDirect(t *testing.T, port uint16, steps ...step) {
	t.Helper()
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.9:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	for _, s := range steps {
		time.Sleep(s.wait)
		_, _ = io.WriteString(c, s.data)
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	_, _ = io.ReadAll(c)
}

func TestSmuggledRequestsNeverReachAnotherName(t *testing.T) {
	f := newCDNFixture(t)
	b := "GET / HTTP/1.1\r\nHost: cdn-b.test\r\n\r\n"
	postB := "POST / HTTP/1.1\r\nHost: cdn-b.test\r\nContent-Length: 3\r\n\r\nabc"
	a := func(extra string) string { return "GET / HTTP/1.1\r\nHost: cdn-a.test\r\n" + extra + "\r\n" }
	cases := []struct {
		name  string
		port  uint16
		steps []step
		// notDirect: the lenient server alone does not fall for it (it
		// cannot read the bytes at all), so the self-check is skipped.
		notDirect bool
	}{
		// 1. Upgrade asked, not granted: the next request is still checked.
		{"upgrade websocket not granted", f.port, []step{{0, a("Upgrade: websocket\r\nConnection: Upgrade\r\n") + postB}}, false},
		{"upgrade h2c not granted", f.port, []step{{0, a("Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n")}, {200 * time.Millisecond, b}}, false},
		{"upgrade any token, after the response", f.port, []step{{0, a("Upgrade: foo\r\n")}, {300 * time.Millisecond, postB}}, false},
		// 2. CONNECT the server does not grant (with Upgrade too).
		{"connect refused by the server", f.opPort, []step{{0, fmt.Sprintf("CONNECT cdn-a.test:%d HTTP/1.1\r\nHost: cdn-a.test:%d\r\nUpgrade: x\r\n\r\n", f.opPort, f.opPort)}, {200 * time.Millisecond, b}}, false},
		// 2b. CONNECT the server grants: the tunnel is pinned to its authority.
		{"connect granted, another host inside", f.port, []step{{0, fmt.Sprintf("CONNECT cdn-a.test:%d HTTP/1.1\r\nHost: cdn-a.test:%d\r\nX-Proxy: yes\r\n\r\n", f.port, f.port)}, {200 * time.Millisecond, b}}, false},
		// 3. Framing: every body two readers could end differently.
		{"get with a body", f.port, []step{{0, fmt.Sprintf("GET / HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: %d\r\n\r\n%s", len(b), b)}}, false},
		{"head with a body", f.port, []step{{0, fmt.Sprintf("HEAD / HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: %d\r\n\r\n%s", len(b), b)}}, false},
		{"get chunked", f.port, []step{{0, fmt.Sprintf("GET / HTTP/1.1\r\nHost: cdn-a.test\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", len(b), b)}}, true},
		{"te and cl", f.port, []step{{0, "POST / HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + b}}, false},
		{"te obfuscated", f.port, []step{{0, "POST / HTTP/1.1\r\nHost: cdn-a.test\r\nTransfer-Encoding: xchunked\r\nContent-Length: 0\r\n\r\n0\r\n\r\n" + b}}, false},
		{"two lengths", f.port, []step{{0, "POST / HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 0\r\nContent-Length: 38\r\n\r\n" + b}}, false},
		{"obs-fold host", f.port, []step{{0, "GET / HTTP/1.1\r\nHost: cdn-a.test\r\n cdn-b.test\r\n\r\n"}}, false},
		{"bare lf", f.port, []step{{0, "GET / HTTP/1.1\r\nHost: cdn-a.test\r\n\r\nGET / HTTP/1.1\nHost: cdn-b.test\n\n"}}, false},
		{"space before colon", f.port, []step{{0, a("") + "GET / HTTP/1.1\r\nHost : cdn-b.test\r\n\r\n"}}, false},
		{"trailer host", f.port, []step{{0, "POST / HTTP/1.1\r\nHost: cdn-a.test\r\nTransfer-Encoding: chunked\r\nTrailer: Host\r\n\r\n0\r\nHost: cdn-b.test\r\n\r\n"}}, false},
		{"connection drops length", f.port, []step{{0, "POST / HTTP/1.1\r\nHost: cdn-a.test\r\nConnection: Content-Length\r\nContent-Length: 38\r\n\r\n" + b}}, false},
		// 9. One strict parser for every request, the later ones too.
		{"later host list", f.port, []step{{0, a("") + "GET / HTTP/1.1\r\nHost: cdn-a.test:,cdn-b.test\r\n\r\n"}}, false},
		{"later host in letter case", f.port, []step{{0, a("") + "GET / HTTP/1.1\r\nHost: CDN-B.test\r\n\r\n"}}, false},
		{"later absolute uri", f.port, []step{{0, a("") + "GET http://cdn-b.test/ HTTP/1.1\r\nHost: cdn-a.test\r\n\r\n"}}, false},
		{"later lowercase method", f.port, []step{{0, a("") + "get / HTTP/1.1\r\nHost: cdn-b.test\r\n\r\n"}}, false},
		// 6. Late or oddly prefixed first bytes on the port allowed for any protocol.
		{"late http", f.opPort, []step{{500 * time.Millisecond, b}}, false},
		{"crlf first", f.opPort, []step{{0, "\r\n" + b}}, false},
		{"crlf first, late", f.opPort, []step{{0, "\r\n"}, {500 * time.Millisecond, b}}, false},
		{"space first", f.opPort, []step{{0, " " + b}}, false},
		{"lowercase method", f.opPort, []step{{0, "get / HTTP/1.1\r\nHost: cdn-b.test\r\n\r\n"}}, false},
		{"late lowercase method", f.opPort, []step{{500 * time.Millisecond, "get / http/1.1\r\nhost: cdn-b.test\r\n\r\n"}}, false},
		{"late, allowed then another", f.opPort, []step{{500 * time.Millisecond, a("") + b}}, false},
		{"trickled request line", f.opPort, []step{{500 * time.Millisecond, "GE"}, {100 * time.Millisecond, "T / HTTP/1.1\r\nHost: cdn-b.test\r\n\r\n"}}, false},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			if !c.notDirect {
				// Self-check: sent straight to the lenient server, the
				// same bytes do reach cdn-b (the attack is real).
				f.cdn.forget()
				sendDirect(t, c.port, c.steps...)
				if !f.cdn.reached("cdn-b") {
					t.Fatalf("the attack does not work even without the gateway")
				}
			}
			f.cdn.forget()
			out, _ := f.send(t, c.port, c.steps...)
			if f.cdn.reached("cdn-b") {
				t.Fatalf("cdn-b.test was served; the sandbox read %q", out)
			}
			if strings.Contains(out, "host=cdn-b") {
				t.Fatalf("the sandbox read cdn-b's answer: %q", out)
			}
		})
	}
	// The refusals are events that name what was refused.
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.VerdictDeny && ev.Name == "cdn-b.test" && strings.Contains(ev.Reason, "cdn-b.test")
	}) {
		t.Errorf("no deny event naming cdn-b.test: %+v", f.events(t))
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.VerdictDeny && strings.Contains(ev.Reason, "ambiguous message framing")
	}) {
		t.Errorf("no framing refusal event: %+v", f.events(t))
	}
}

func TestLateTLSNameIsProved(t *testing.T) {
	f := newCDNFixture(t)
	for _, c := range []struct {
		sni  string
		want bool
	}{{"cdn-b.test", false}, {"cdn-a.test", true}} {
		conn, err := f.sb.Dial(ip9, f.opPort)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond) // past the wait for a server that speaks first
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		// The CDN speaks no TLS: what matters is whether the gateway let
		// the ClientHello through (the plain server then answers 400ish
		// bytes, or nothing, instead of a reset).
		tc := tls.Client(conn, &tls.Config{ServerName: c.sni, InsecureSkipVerify: true}) //nolint:gosec // never completes
		_ = tc.Handshake()
		conn.Close()
		sniEv := f.hasEvent(t, func(ev api.NetworkEvent) bool {
			return ev.Protocol == "tls" && ev.Name == c.sni && ev.Verdict == api.VerdictDeny
		})
		if sniEv == c.want {
			t.Errorf("late ClientHello naming %s: refused=%v, want refused=%v (%+v)", c.sni, sniEv, !c.want, f.events(t))
		}
	}
}

func TestUpgradeAndTunnelsThatAreReal(t *testing.T) {
	f := newCDNFixture(t)
	// A real switch (101) becomes a raw relay both ways.
	c, err := f.sb.Dial(ip9, f.port)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprint(c, "GET /ws HTTP/1.1\r\nHost: cdn-a.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	frame := "\x81\x05hello not-http at all\r\n\r\n"
	fmt.Fprint(c, frame)
	got := make([]byte, len(frame))
	if _, err := io.ReadFull(br, got); err != nil || string(got) != frame {
		t.Fatalf("echo after the switch: %q %v", got, err)
	}

	// Kept-alive requests, a body, an Expect: 100-continue, an absolute URI.
	out, _ := f.send(t, f.port, step{0, "GET /1 HTTP/1.1\r\nHost: CDN-A.test\r\n\r\n" +
		"POST /2 HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 5\r\n\r\nhello" +
		"POST /3 HTTP/1.1\r\nHost: cdn-a.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n" +
		"GET http://cdn-a.test/4 HTTP/1.1\r\nHost: cdn-a.test\r\nConnection: close\r\n\r\n"})
	if n := strings.Count(out, "host=cdn-a.test"); n != 4 {
		t.Fatalf("kept-alive requests: %d answers in %q", n, out)
	}
	// A CONNECT the server grants, then HTTP for the same name inside.
	out, _ = f.send(t, f.port, step{0, fmt.Sprintf("CONNECT cdn-a.test:%d HTTP/1.1\r\nHost: cdn-a.test:%d\r\nX-Proxy: yes\r\n\r\n", f.port, f.port)},
		step{200 * time.Millisecond, "GET / HTTP/1.1\r\nHost: cdn-a.test\r\n\r\n"})
	if !strings.Contains(out, "200 Connection established") || !strings.Contains(out, "host=cdn-a.test") {
		t.Fatalf("tunnel: %q", out)
	}
	// Late but honest HTTP on the any-protocol port.
	out, _ = f.send(t, f.opPort, step{500 * time.Millisecond, "GET / HTTP/1.1\r\nHost: cdn-a.test\r\nConnection: close\r\n\r\n"})
	if !strings.Contains(out, "host=cdn-a.test") {
		t.Fatalf("late request for the allowed name: %q", out)
	}
	// The server's answer to an Expect: 100-continue reaches the client
	// before it sends its body.
	c2, err := f.sb.Dial(ip9, f.port)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	_ = c2.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprint(c2, "POST /e HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
	time.Sleep(200 * time.Millisecond)
	fmt.Fprint(c2, "ok")
	br2 := bufio.NewReader(c2)
	resp, err = http.ReadResponse(br2, nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("expect: %v %v", resp, err)
	}
	if f.cdn.reached("cdn-b") {
		t.Fatal("cdn-b.test was served")
	}
}

// A sandbox holding connections it never speaks on cannot pass the cap,
// and another sandbox on the same gateway stays served.
func TestConnectionCapCountsSilentConnections(t *testing.T) {
	lim := DefaultLimits
	lim.MaxConns = 40
	lim.ConnsPerSecond = 1000
	f := newCDNFixture(t, lim)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.HeapInuse
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	refused := 0
	for range lim.MaxConns + 20 {
		c, err := f.sb.Dial(ip9, f.port)
		if err != nil {
			refused++
			continue
		}
		held = append(held, c)
	}
	// A connection the gateway refused at once may still have looked
	// open to the dialer: each one still open answers or not.
	time.Sleep(200 * time.Millisecond)
	if len(held) > lim.MaxConns {
		t.Errorf("%d connections open, cap %d (%d refused)", len(held), lim.MaxConns, refused)
	}
	if refused < 20 {
		t.Errorf("only %d of %d connections over the cap refused", refused, lim.MaxConns+20)
	}
	runtime.ReadMemStats(&ms)
	t.Logf("%d held, %d refused; gateway heap %+d KiB", len(held), refused, (int64(ms.HeapInuse)-int64(before))>>10)
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.VerdictLimit && strings.Contains(ev.Reason, "open connections")
	}) {
		t.Error("no limit event")
	}
	// A second sandbox of the same gateway is served meanwhile.
	other := f.attachLink(t, "sb2", api.NetworkPolicy{AllowOut: []string{"cdn-a.test"}, AllowPrivate: []string{"127.0.0.9/32"}})
	if _, _, err := other.Query(t, gatewayAddr, "cdn-a.test", dnsmessage.TypeA); err != nil {
		t.Fatal(err)
	}
	if body, err := other.Get(ip9, f.port, "cdn-a.test"); err != nil || body != "host=cdn-a.test" {
		t.Fatalf("second sandbox: %q %v", body, err)
	}
	// Closing what it held frees the first sandbox's share.
	for _, c := range held {
		c.Close()
	}
	held = nil
	deadline := time.Now().Add(10 * time.Second)
	for {
		body, err := f.sb.Get(ip9, f.port, "cdn-a.test")
		if err == nil && body == "host=cdn-a.test" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no connection after the held ones closed: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestRequestHeadTrickleIsLinear(t *testing.T) {
	// 60 KiB of header lines, read by the relay as it arrives: the scan
	// for the end of the head must not start over on every read.
	in := "GET / HTTP/1.1\r\nHost: a.test\r\n" + strings.Repeat("X-A: b\r\n", 7000) + "\r\n"
	br := bufio.NewReaderSize(oneByteReader{strings.NewReader(in)}, maxRequestHead)
	start := time.Now()
	if _, res, err := readRequest(br); err != nil || res.Name != "a.test" {
		t.Fatalf("%+v %v", res, err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("took %v", d)
	}
}

type oneByteReader struct{ r io.Reader }

func (o oneByteReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	return o.r.Read(p[:1])
}

// FuzzRelayAgreesWithLenientUpstream feeds the relay's request reader and
// writer a byte stream from a sandbox allowed only a.test, and reads what
// it would forward the way a lenient upstream does: the upstream must see
// exactly the requests the relay checked, each naming a.test.
func FuzzRelayAgreesWithLenientUpstream(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: A.TEST\r\n\r\nGET /2 HTTP/1.1\r\nHost: a.test\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 35\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
		"\r\n\r\nGET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
		"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.test\r\n b.test\r\n\r\n",
		"GET / HTTP/1.0\r\nHost: a.test\r\nConnection: keep-alive\r\n\r\n",
		"DELETE / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 35\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
		"OPTIONS * HTTP/1.1\r\nHost: a.test\r\n\r\n",
		"PUT / HTTP/1.1\r\nHost: a.test:80\r\nContent-Length: 0\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		br := bufio.NewReaderSize(bytes.NewReader(in), maxRequestHead)
		var out bytes.Buffer
		bw := bufio.NewWriter(&out)
		forwarded := 0
		for {
			req, res, err := readRequest(br)
			if err != nil || res.Name != "a.test" || req.Method == http.MethodConnect {
				break // refused (or a tunnel): nothing more goes upstream
			}
			if err := forwardRequest(bw, req, res); err != nil {
				// The body ended early or broke: the relay stops there;
				// what went out is checked below as far as it parses.
				break
			}
			forwarded++
			if res.Upgrade {
				break // what follows depends on the upstream's answer
			}
		}
		_ = bw.Flush()
		got, _ := lenientAll(out.Bytes())
		if len(got) > forwarded {
			t.Fatalf("forwarded %d requests, a lenient upstream reads %d from %q", forwarded, len(got), out.Bytes())
		}
		for _, r := range got {
			for _, h := range r.Names {
				if h != "a.test" {
					t.Fatalf("a lenient upstream reads Host %q from %q (input %q)", h, out.Bytes(), in)
				}
			}
		}
	})
}

// 512 kept-alive HTTP connections, each idle after one exchange: what the
// relay holds per connection stays bounded (docs/network.md: the relay
// buffers of a sandbox's 512 connections within 64 MiB). The figure
// includes this process's sandbox netstack and the test server, so it is
// an upper bound on the gateway's.
func TestRelayMemoryPerIdleConnection(t *testing.T) {
	lim := DefaultLimits
	lim.ConnsPerSecond = 2000
	f := newCDNFixture(t, lim)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.HeapInuse + ms.StackInuse
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := range lim.MaxConns {
		c, err := f.sb.Dial(ip9, f.port)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		held = append(held, c)
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprint(c, "GET / HTTP/1.1\r\nHost: cdn-a.test\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	per := (int64(ms.HeapInuse+ms.StackInuse) - int64(before)) / int64(len(held))
	t.Logf("%d idle kept-alive HTTP connections: %d KiB each (gateway, sandbox stack and server together), %d MiB in all",
		len(held), per>>10, per*int64(len(held))>>20)
	if per > 128<<10 {
		t.Errorf("%d KiB per idle connection, over the 128 KiB the 64 MiB bound allows", per>>10)
	}
}
