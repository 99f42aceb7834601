package gateway

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/transport/icmp"
	"gvisor.dev/gvisor/pkg/waiter"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/netpolicy"
)

type fixture struct {
	g       *Gateway
	sb      *gatewaytest.SandboxStack
	dns     *gatewaytest.FakeDNS
	dialer  *gatewaytest.GuardDialer
	port    uint16 // HTTP on 127.0.0.2 and 127.0.0.3
	tlsPort uint16 // HTTPS on 127.0.0.2 and 127.0.0.3
	tlsConf *tls.Config
}

func newFixture(t *testing.T, p api.NetworkPolicy, lim ...Limits) *fixture {
	f := &fixture{dialer: &gatewaytest.GuardDialer{T: t}}
	f.dns = gatewaytest.StartDNS(t, map[string][]string{
		"allowed.test":      {"127.0.0.2"},
		"other.test":        {"127.0.0.3"}, // a denied name sharing a "CDN" with nothing
		"alias.test":        {"cname:edge.cdn.test", "127.0.0.2"},
		"a.zone.test":       {"127.0.0.2"},
		"rebind-meta.test":  {"169.254.169.254"},
		"rebind-lan.test":   {"10.1.2.3"},
		"rebind-local.test": {"127.0.0.1"}, // the host itself (protected)
		"rebind-mixed.test": {"10.1.2.3", "127.0.0.2"},
	})
	for _, tlsOn := range []bool{false, true} {
		port, stop, err := gatewaytest.ServeHTTPPair(tlsOn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
		if tlsOn {
			f.tlsPort = port
		} else {
			f.port = port
		}
	}
	f.tlsConf = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // the test servers' own certificate
	g, err := New(Options{
		DNSUpstream: f.dns.Addr,
		Policy: netpolicy.Options{
			AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
			Protected:    []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")},
		},
		Dialer: f.dialer,
		Limits: append(lim, Limits{})[0],
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	f.g = g
	f.sb = f.attachLink(t, "sb1", p)
	return f
}

var (
	// The sandbox addresses loopback servers through the alias range.
	ip2 = netip.MustParseAddr("198.19.0.2")
	ip3 = netip.MustParseAddr("198.19.0.3")
)

func (f *fixture) events(t *testing.T) []api.NetworkEvent {
	var out []api.NetworkEvent
	if err := f.g.Events(context.Background(), "sb1", 0, false, func(ev api.NetworkEvent) error {
		out = append(out, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func (f *fixture) hasEvent(t *testing.T, match func(api.NetworkEvent) bool) bool {
	for range 50 {
		for _, ev := range f.events(t) {
			if match(ev) {
				return true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

func TestAllowedNameResolvesAndConnects(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test", "alias.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	rc, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA)
	if err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 || ips[0] != ip2 {
		t.Fatalf("query allowed.test: rcode %v ips %v err %v", rc, ips, err)
	}
	body, err := f.sb.Get(ip2, f.port, "allowed.test")
	if err != nil || !strings.Contains(body, "127.0.0.2:") {
		t.Fatalf("GET allowed.test: %q %v", body, err)
	}
	// TLS with the allowed SNI.
	c, err := f.sb.Dial(ip2, f.tlsPort)
	if err != nil {
		t.Fatal(err)
	}
	conf := f.tlsConf.Clone()
	conf.ServerName = "allowed.test"
	tc := tls.Client(c, conf)
	_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
	if err := tc.Handshake(); err != nil {
		t.Fatalf("tls to allowed.test: %v", err)
	}
	tc.Close()
	// A CNAME chain binds the name asked for.
	if _, ips, err := f.sb.Query(t, gatewayAddr, "alias.test", dnsmessage.TypeA); err != nil || len(ips) != 1 || ips[0] != ip2 {
		t.Fatalf("alias.test: %v %v", ips, err)
	}
	if body, err := f.sb.Get(ip2, f.port, "alias.test"); err != nil || !strings.Contains(body, "host=alias.test") {
		t.Fatalf("GET alias.test: %q %v", body, err)
	}
	// AAAA: nothing (the link is IPv4 only), and never forwarded.
	if rc, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeAAAA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 0 {
		t.Fatalf("AAAA: %v %v %v", rc, ips, err)
	}
	info, err := f.g.Info("sb1")
	if err != nil || info.Stats.BytesIn == 0 || info.Stats.BytesOut == 0 {
		t.Fatalf("stats: %+v %v", info.Stats, err)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "http" && ev.Verdict == api.VerdictAllow && ev.Name == "allowed.test" && ev.BytesIn > 0
	}) {
		t.Fatalf("no allow event with bytes: %+v", f.events(t))
	}
}

func TestDeniedNamesAndAddresses(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test", "*.zone.test", "rebind-meta.test", "rebind-lan.test", "rebind-local.test", "rebind-mixed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	// A denied name: NXDOMAIN, never forwarded.
	rc, _, err := f.sb.Query(t, gatewayAddr, "other.test", dnsmessage.TypeA)
	if err != nil || rc != dnsmessage.RCodeNameError {
		t.Fatalf("other.test: %v %v", rc, err)
	}
	long := strings.Repeat("x", 60) + ".exfil.denied.test"
	if rc, _, err := f.sb.Query(t, gatewayAddr, long, dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeNameError {
		t.Fatalf("long label to a denied zone: %v %v", rc, err)
	}
	if f.dns.WasAsked("other.test") || f.dns.WasAsked(long) {
		t.Fatal("a denied name reached the upstream resolver")
	}
	// Its IP, never resolved by this sandbox: refused.
	if _, err := f.sb.Get(ip3, f.port, "other.test"); err == nil {
		t.Fatal("connection to a never-resolved IP went through")
	}
	// Shared CDN: allowed name's SNI sent to the IP of a denied name.
	if _, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil {
		t.Fatal(err)
	}
	if _, err := f.sb.Get(ip3, f.port, "allowed.test"); err == nil {
		t.Fatal("Host of an allowed name reached the IP of a denied one")
	}
	// Host mismatch on an allowed IP.
	if _, err := f.sb.Get(ip2, f.port, "other.test"); err == nil {
		t.Fatal("Host of a denied name went through to an allowed IP")
	}
	// TLS without SNI.
	c, err := f.sb.Dial(ip2, f.tlsPort)
	if err == nil {
		tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // no SNI on purpose
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		if tc.Handshake() == nil {
			t.Fatal("TLS without SNI went through")
		}
		c.Close()
	}
	// Rebinding: answers that point inside are removed; a direct dial too.
	for _, name := range []string{"rebind-meta.test", "rebind-lan.test", "rebind-local.test"} {
		rc, ips, err := f.sb.Query(t, gatewayAddr, name, dnsmessage.TypeA)
		if err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 0 {
			t.Fatalf("%s: rcode %v ips %v err %v", name, rc, ips, err)
		}
	}
	if _, ips, _ := f.sb.Query(t, gatewayAddr, "rebind-mixed.test", dnsmessage.TypeA); len(ips) != 1 || ips[0] != ip2 {
		t.Fatalf("rebind-mixed.test: %v", ips)
	}
	for _, dst := range []string{"169.254.169.254", "10.1.2.3", "198.19.0.1"} {
		if _, err := f.sb.Get(netip.MustParseAddr(dst), 80, "allowed.test"); err == nil {
			t.Fatalf("connection to %s went through", dst)
		}
	}
	// DNS to any other address is dropped.
	if _, _, err := f.sb.Query(t, ip2, "allowed.test", dnsmessage.TypeA); err == nil {
		t.Fatal("a DNS query to another address was answered")
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool { return ev.Protocol == "dns" && ev.Verdict == api.VerdictDrop }) {
		t.Fatal("no drop event for DNS to another address")
	}
	for _, v := range []string{api.VerdictDeny, api.VerdictDrop} {
		if !f.hasEvent(t, func(ev api.NetworkEvent) bool { return ev.Verdict == v }) {
			t.Fatalf("no %s event", v)
		}
	}
	if f.dialer.Dialed("127.0.0.3") {
		t.Fatal("the gateway dialed the denied address")
	}
}

// keptAlive opens a connection from the sandbox to ip, has one request
// with host answered on it, and leaves it open (closed when t ends).
func (f *fixture) keptAlive(t *testing.T, ip netip.Addr, host string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := f.sb.Dial(ip, f.port)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("%s: %v", host, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return c, br
}

func TestLivePolicyChangeClosesConnections(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"127.0.0.2/32"}})
	c, br := f.keptAlive(t, ip2, "x")
	if err := f.g.SetPolicy("sb1", api.NetworkPolicy{}); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); err == nil || strings.Contains(err.Error(), "timeout") {
		t.Fatalf("open connection survived a policy that no longer allows it: %v", err)
	}
	if _, err := f.sb.Get(ip2, f.port, "x"); err == nil {
		t.Fatal("new connection allowed after the policy was emptied")
	}
}

func TestZoneExfiltrationBounded(t *testing.T) {
	lim := DefaultLimits
	lim.NamesPerZone = 3
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"*.zone.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, lim)
	for i := range 3 {
		if rc, _, err := f.sb.Query(t, gatewayAddr, fmt.Sprintf("n%d.zone.test", i), dnsmessage.TypeA); err != nil || rc == dnsmessage.RCodeRefused {
			t.Fatalf("query %d: %v %v", i, rc, err)
		}
	}
	if rc, _, _ := f.sb.Query(t, gatewayAddr, "n9.zone.test", dnsmessage.TypeA); rc != dnsmessage.RCodeRefused {
		t.Fatalf("4th distinct name: %v, want REFUSED", rc)
	}
	if rc, _, _ := f.sb.Query(t, gatewayAddr, strings.Repeat("a", 50)+".zone.test", dnsmessage.TypeA); rc != dnsmessage.RCodeRefused {
		t.Fatalf("long label: %v, want REFUSED", rc)
	}
	if f.dns.WasAsked("n9.zone.test") {
		t.Fatal("a refused name reached the upstream")
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool { return ev.Verdict == api.VerdictLimit }) {
		t.Fatal("no limit event")
	}
}

func TestHTTPEveryRequestIsChecked(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	if _, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil {
		t.Fatal(err)
	}
	c, err := f.sb.Dial(ip2, f.port)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	// Two requests on one kept-alive connection: the second names another host.
	fmt.Fprintf(c, "GET /1 HTTP/1.1\r\nHost: allowed.test\r\n\r\nGET /2 HTTP/1.1\r\nHost: other.test\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "host=allowed.test") {
		t.Fatalf("first request: %q", body)
	}
	if resp, err := http.ReadResponse(br, nil); err == nil {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("second request with another Host was answered: %q", b)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.VerdictDeny && ev.Name == "other.test" && strings.Contains(ev.Reason, "later request")
	}) {
		t.Fatalf("no deny event for the second request: %+v", f.events(t))
	}
}

func TestEgressProxyFailsClosed(t *testing.T) {
	px := gatewaytest.StartSocks5(t, "127.0.0.4:0")
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"127.0.0.2/32"}, EgressProxy: "socks5://" + px.Addr})
	body, err := f.sb.Get(ip2, f.port, "anything")
	if err != nil || !strings.Contains(body, "127.0.0.2:") {
		t.Fatalf("through the proxy: %q %v", body, err)
	}
	want := fmt.Sprintf("127.0.0.2:%d", f.port)
	if got := px.Targets(); len(got) != 1 || got[0] != want {
		t.Fatalf("proxy targets %v, want [%s]", got, want)
	}
	if f.dialer.Dialed("tcp " + want) {
		t.Fatal("the gateway dialed the destination directly")
	}
	px.Close()
	if _, err := f.sb.Get(ip2, f.port, "anything"); err == nil {
		t.Fatal("a connection went through with the proxy down")
	}
	if f.dialer.Dialed("tcp " + want) {
		t.Fatal("the gateway fell back to a direct dial")
	}
}

// ping sends one ICMP echo from the sandbox to dst and says whether a
// reply came.
func ping(t *testing.T, sb *gatewaytest.SandboxStack, dst netip.Addr) bool {
	t.Helper()
	var wq waiter.Queue
	ep, terr := sb.S.NewEndpoint(icmp.ProtocolNumber4, ipv4.ProtocolNumber, &wq)
	if terr != nil {
		t.Fatal(terr)
	}
	c := gonet.NewUDPConn(&wq, ep)
	defer c.Close()
	echo := header.ICMPv4(make([]byte, header.ICMPv4MinimumSize+4))
	echo.SetType(header.ICMPv4Echo)
	copy(echo.Payload(), "ping")
	if _, err := c.WriteTo(echo, &net.UDPAddr{IP: dst.AsSlice()}); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 128)
	n, _, err := c.ReadFrom(buf)
	return err == nil && n >= header.ICMPv4MinimumSize && header.ICMPv4(buf[:n]).Type() == header.ICMPv4EchoReply
}

func TestPingAndDNSOverTCP(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	if !ping(t, f.sb, gatewayAddr) {
		t.Fatal("ping of the gateway got no reply")
	}
	if ping(t, f.sb, ip2) {
		t.Fatal("ping of an outside address got a reply")
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool { return ev.Protocol == "icmp" && ev.Verdict == api.VerdictDrop }) {
		t.Fatal("no drop event for ICMP out")
	}
	// DNS over TCP to the gateway.
	c, err := f.sb.Dial(gatewayAddr, 53)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	for _, tc := range []struct {
		name  string
		rcode dnsmessage.RCode
	}{{"allowed.test", dnsmessage.RCodeSuccess}, {"other.test", dnsmessage.RCodeNameError}} {
		m := dnsmessage.Message{Header: dnsmessage.Header{ID: 9, RecursionDesired: true},
			Questions: []dnsmessage.Question{{Name: dnsmessage.MustNewName(tc.name + "."), Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET}}}
		b, _ := m.Pack()
		if _, err := c.Write(append([]byte{byte(len(b) >> 8), byte(len(b))}, b...)); err != nil {
			t.Fatal(err)
		}
		var n [2]byte
		if _, err := io.ReadFull(c, n[:]); err != nil {
			t.Fatal(err)
		}
		resp := make([]byte, int(n[0])<<8|int(n[1]))
		if _, err := io.ReadFull(c, resp); err != nil {
			t.Fatal(err)
		}
		var r dnsmessage.Message
		if err := r.Unpack(resp); err != nil || r.RCode != tc.rcode {
			t.Fatalf("%s over TCP: %v %v", tc.name, r.RCode, err)
		}
		if tc.rcode == dnsmessage.RCodeSuccess && (len(r.Answers) != 1 || r.Answers[0].Body.(*dnsmessage.AResource).A != ip2.As4()) {
			t.Fatalf("%s over TCP: answers %+v", tc.name, r.Answers)
		}
	}
}

func TestPolicyUpdateEndsNameConnections(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test", "other.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	for _, n := range []string{"allowed.test", "other.test"} {
		if _, _, err := f.sb.Query(t, gatewayAddr, n, dnsmessage.TypeA); err != nil {
			t.Fatal(err)
		}
	}
	keep, keepR := f.keptAlive(t, ip2, "allowed.test")
	gone, goneR := f.keptAlive(t, ip3, "other.test")
	if err := f.g.SetPolicy("sb1", api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}); err != nil {
		t.Fatal(err)
	}
	_ = gone.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := goneR.ReadByte(); err == nil || strings.Contains(err.Error(), "timeout") {
		t.Fatalf("connection to a name no longer allowed survived: %v", err)
	}
	// The one still allowed keeps working on the same connection.
	fmt.Fprintf(keep, "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
	_ = keep.SetReadDeadline(time.Now().Add(5 * time.Second))
	if resp, err := http.ReadResponse(keepR, nil); err != nil {
		t.Fatalf("still-allowed connection broken: %v", err)
	} else {
		resp.Body.Close()
	}
}

// TestDialSandbox: the gateway reaches a service listening on the
// sandbox's own address from its side of the link, both ways, half-close
// included; a port nothing listens on is a clear error; each connection is
// an ingress event; an unknown sandbox is not found.
func TestDialSandbox(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{})
	f.sb.Serve(t, 8000, func(c net.Conn) {
		b, _ := io.ReadAll(c) // until the host half-closes
		fmt.Fprintf(c, "got %d bytes: %s", len(b), b)
	})
	ctx := context.Background()
	c, err := f.g.DialSandbox(ctx, "sb1", 8000)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "got 5 bytes: hello" {
		t.Fatalf("reply %q, %v", got, err)
	}
	c.Close()
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "ingress" && ev.Port == 8000 && ev.Verdict == api.VerdictAllow && ev.BytesIn == 5 && ev.BytesOut == int64(len(got))
	}) {
		t.Errorf("no ingress event: %+v", f.events(t))
	}

	_, err = f.g.DialSandbox(ctx, "sb1", 8001)
	if !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, ErrNoListener) || !strings.Contains(err.Error(), "nothing listens on port 8001") {
		t.Errorf("dial of a closed port: %v", err)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "ingress" && ev.Port == 8001 && ev.Verdict == api.VerdictError
	}) {
		t.Errorf("no error event: %+v", f.events(t))
	}
	if _, err := f.g.DialSandbox(ctx, "nope", 8000); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("unknown sandbox: %v", err)
	}

	// Detaching the link ends open ingress connections.
	c, err = f.g.DialSandbox(ctx, "sb1", 8000)
	if err != nil {
		t.Fatal(err)
	}
	f.g.Detach("sb1")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("read on a detached link's connection succeeded")
	}
}

// TestHTTPHeadIsBounded: a request whose head never ends is cut off at
// 32 KiB (maxRelayHead); the gateway (which every sandbox shares) holds no
// more of it.
func TestHTTPHeadIsBounded(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	if _, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil {
		t.Fatal(err)
	}
	c, br := f.keptAlive(t, ip2, "allowed.test")
	// The second request's head is a line that never ends.
	go func() {
		line := []byte("GET /2 HTTP/1.1\r\nX-Long: " + strings.Repeat("a", 32<<10))
		for i := 0; i < 8; i++ {
			if _, err := c.Write(line); err != nil {
				return
			}
			line = []byte(strings.Repeat("a", 32<<10))
		}
	}()
	if _, err := br.ReadByte(); err == nil {
		t.Fatal("an endless request head got an answer")
	} else if strings.Contains(err.Error(), "timeout") {
		t.Fatal("the gateway kept reading an endless request head")
	}
}

// TestBandwidthCapIsPerSandbox: two connections of one sandbox share its
// cap: 3 MiB each over a 1 MiB/s cap (1 MiB burst per direction) cannot
// take less than 5 s together.
func TestBandwidthCapIsPerSandbox(t *testing.T) {
	big := make([]byte, 3<<20)
	ln, err := net.Listen("tcp", "127.0.0.5:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(big) })}
	go srv.Serve(ln)
	defer srv.Close()
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	lim := DefaultLimits
	lim.BandwidthBytesPerSecond = 1 << 20
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"127.0.0.5/32"}}, lim)
	start := time.Now()
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			c, err := f.sb.Dial(netip.MustParseAddr("198.19.0.5"), port)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				errs <- err
				return
			}
			n, err := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if err == nil && n != int64(len(big)) {
				err = fmt.Errorf("got %d bytes", n)
			}
			errs <- err
		}()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 4500*time.Millisecond {
		t.Fatalf("6 MiB through a 1 MiB/s cap took %v", d)
	}
}

// TestOpaqueProtocolNeedsAPort: a protocol where the server speaks first
// (no SNI, no Host) reaches an allowed name only if its entry names the port.
func TestOpaqueProtocolNeedsAPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprint(c, "SSH-2.0-test\r\n")
			c.Close()
		}
	}()
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	for _, c := range []struct {
		entry string
		want  bool
	}{{fmt.Sprintf("allowed.test:%d", port), true}, {"allowed.test", false}} {
		f := newFixture(t, api.NetworkPolicy{AllowOut: []string{c.entry}, AllowPrivate: []string{"127.0.0.0/8"}})
		if _, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil {
			t.Fatal(err)
		}
		conn, err := f.sb.Dial(ip2, port)
		if err != nil {
			t.Fatal(err)
		}
		_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
		line, err := bufio.NewReader(conn).ReadString('\n')
		conn.Close()
		if got := err == nil && strings.HasPrefix(line, "SSH-2.0"); got != c.want {
			t.Errorf("allow_out %q: banner %q, err %v; want reached=%v", c.entry, line, err, c.want)
		}
	}
}
