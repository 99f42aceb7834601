package gwctl

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/testenv"
)

// TestSupervisedGatewayBroker: the real, confined gateway process
// intercepts for a config pushed over the control socket, verifying the
// real host against the roots of --upstream-ca (read before it confined
// itself), and refuses bad configs and unknown ids by code.
func TestSupervisedGatewayBroker(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	upCA, err := gatewaytest.NewCA("test internet CA")
	if err != nil {
		t.Fatal(err)
	}
	sbCA, err := gatewaytest.NewCA("sandbox CA")
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, "upstream-ca.pem")
	if err := os.WriteFile(caFile, upCA.CertPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	cert, err := upCA.Issue("api.test")
	if err != nil {
		t.Fatal(err)
	}
	port, stop, err := gatewaytest.ServeEcho("127.0.0.2:0", cert)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	dns := gatewaytest.StartDNS(t, map[string][]string{"api.test": {"127.0.0.2"}})
	sup := &Supervisor{
		Binary: testenv.GatewayBinary(t),
		Dir:    filepath.Join(dir, "gw"),
		Settings: Settings{DNSUpstream: dns.Addr, AllowPrivate: []string{"127.0.0.0/8"},
			Protect: []string{"127.0.0.1"}, DialGuard: "loopback", UpstreamCA: caFile},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	ctx := context.Background()
	if err := os.MkdirAll(sup.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := sup.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer sup.Close(true)
	c := sup.Client()
	if p, err := c.Probe(ctx); err != nil || p["broker"] != "ok" {
		t.Fatalf("probe: %v %v", p, err)
	}
	cfg := brokerconf.Config{CACertPEM: sbCA.CertPEM, CAKeyPEM: sbCA.KeyPEM, Secrets: []brokerconf.Secret{{
		Name: "API_KEY", Hosts: []string{"api.test"}, Header: "X-Api-Key: {}", Placeholder: "SPACE_PH_0123456789", Value: []byte("sk-real-value"),
	}}}
	if err := c.SetBroker(ctx, "sb1", cfg); errdefs.Code(err) != "not_found" {
		t.Fatalf("broker for an unattached id: %v", err)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	if err := c.AttachDecide(ctx, "sb1", nic, api.NetworkPolicy{AllowOut: []string{"api.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, false); err != nil {
		t.Fatal(err)
	}
	nic.Close()
	bad := cfg
	bad.CAKeyPEM = upCA.KeyPEM
	if err := c.SetBroker(ctx, "sb1", bad); errdefs.Code(err) != "invalid_argument" || strings.Contains(err.Error(), "sk-real-value") {
		t.Fatalf("broker with a mismatched key: %v", err)
	}
	if err := c.SetBroker(ctx, "sb1", cfg); err != nil {
		t.Fatal(err)
	}

	sb := gatewaytest.NewSandboxStack(t, fds[1])
	if rc, ips, err := sb.Query(t, netip.MustParseAddr(hostnet.GatewayAddr), "api.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 {
		t.Fatalf("resolve: %v %v %v", rc, ips, err)
	}
	raw, err := sb.Dial(netip.MustParseAddr("198.19.0.2"), port)
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(raw, &tls.Config{ServerName: "api.test", RootCAs: sbCA.Pool()})
	defer tc.Close()
	_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(tc, "GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		b, _ := os.ReadFile(filepath.Join(sup.Dir, "gateway.log"))
		t.Fatalf("request: %v\ngateway log:\n%s", err, b)
	}
	body, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(body), "X-Api-Key: sk-real-value\n") {
		t.Fatalf("upstream saw:\n%s", body)
	}
	b, _ := os.ReadFile(filepath.Join(sup.Dir, "gateway.log"))
	if strings.Contains(string(b), "DIAL GUARD VIOLATION") || strings.Contains(string(b), "sk-real-value") {
		t.Fatalf("gateway log:\n%s", b)
	}
}
