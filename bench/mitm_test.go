package bench

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/gateway"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

// TestMITMBench measures what TLS interception (credential brokering) adds
// per HTTPS request over the plain relay: the same local HTTPS upstream
// behind two allowed names, one a brokered secret's host (intercepted: a
// placeholder replaced in Authorization) and one not (relayed as bytes),
// from a netstack "sandbox" through an in-process gateway, interleaved.
// Kept-alive: one request on an open connection; new connection: TCP, TLS
// handshake (with the gateway's leaf, then the upstream's), one request.
// SPACE_BENCH_MITM_N sets the samples per case (400).
func TestMITMBench(t *testing.T) {
	requireBench(t)
	n := envInt("SPACE_BENCH_MITM_N", 400)
	upCA, err := gatewaytest.NewCA("bench internet CA")
	if err != nil {
		t.Fatal(err)
	}
	sbCA, err := gatewaytest.NewCA("bench sandbox CA")
	if err != nil {
		t.Fatal(err)
	}
	cert, err := upCA.Issue("api.test", "plain.test")
	if err != nil {
		t.Fatal(err)
	}
	port, stop, err := gatewaytest.ServeEcho("127.0.0.2:0", cert)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	dns := gatewaytest.StartDNS(t, map[string][]string{"api.test": {"127.0.0.2"}, "plain.test": {"127.0.0.2"}})
	g, err := gateway.New(gateway.Options{
		DNSUpstream:   dns.Addr,
		Policy:        netpolicy.Options{AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}},
		Dialer:        &gatewaytest.GuardDialer{T: t},
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		UpstreamRoots: upCA.Pool(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	if err := g.Attach("sb", nic, api.NetworkPolicy{AllowOut: []string{"api.test", "plain.test"}, AllowPrivate: []string{"127.0.0.0/8"}}); err != nil {
		t.Fatal(err)
	}
	nic.Close()
	const ph = "SPACE_PH_bench_0123456789"
	if err := g.SetBroker("sb", brokerconf.Config{CACertPEM: sbCA.CertPEM, CAKeyPEM: sbCA.KeyPEM, Secrets: []brokerconf.Secret{{
		Name: "KEY", Hosts: []string{"api.test"}, Placeholder: ph, Value: []byte("sk-bench-real")}}}); err != nil {
		t.Fatal(err)
	}
	sb := gatewaytest.NewSandboxStack(t, fds[1])
	for _, name := range []string{"api.test", "plain.test"} {
		if rc, _, err := sb.Query(t, netip.MustParseAddr(hostnet.GatewayAddr), name, dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess {
			t.Fatalf("resolve %s: %v %v", name, rc, err)
		}
	}
	ip := netip.MustParseAddr("198.19.0.2")
	roots := map[string]*gatewaytest.CA{"api.test": sbCA, "plain.test": upCA}
	type conn struct {
		c  *tls.Conn
		br *bufio.Reader
	}
	open := func(name string) *conn {
		raw, err := sb.Dial(ip, port)
		if err != nil {
			t.Fatal(err)
		}
		c := tls.Client(raw, &tls.Config{ServerName: name, RootCAs: roots[name].Pool(), NextProtos: []string{"http/1.1"},
			ClientSessionCache: nil})
		if err := c.Handshake(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return &conn{c: c, br: bufio.NewReader(c)}
	}
	do := func(cn *conn, name string) {
		fmt.Fprintf(cn.c, "GET /x HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n\r\n", name, ph)
		resp, err := http.ReadResponse(cn.br, nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	kept := map[string]*conn{"api.test": open("api.test"), "plain.test": open("plain.test")}
	for _, cn := range kept {
		defer cn.c.Close()
	}
	res := map[string]samples{}
	for range 20 { // warm: leaf cached, pools and buffers sized
		for name, cn := range kept {
			do(cn, name)
		}
	}
	for range n {
		for _, name := range []string{"plain.test", "api.test"} {
			start := time.Now()
			do(kept[name], name)
			res[name+" kept-alive"] = append(res[name+" kept-alive"], time.Since(start))
			start = time.Now()
			cn := open(name)
			do(cn, name)
			cn.c.Close()
			res[name+" new-conn"] = append(res[name+" new-conn"], time.Since(start))
		}
	}
	line := func(label, key string) {
		s := res[key]
		fmt.Printf("%-34s n=%d p50=%.3fms p99=%.3fms\n", label, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
	}
	line("plain relay, kept-alive", "plain.test kept-alive")
	line("intercepted, kept-alive", "api.test kept-alive")
	line("plain relay, new connection", "plain.test new-conn")
	line("intercepted, new connection", "api.test new-conn")
	for _, kind := range []string{"kept-alive", "new-conn"} {
		p, m := res["plain.test "+kind], res["api.test "+kind]
		fmt.Printf("interception overhead, %-11s p50=+%.3fms p99=+%.3fms\n", kind, ms(m.pct(0.5)-p.pct(0.5)), ms(m.pct(0.99)-p.pct(0.99)))
	}
}
