package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// TestSecretBrokeredEndToEnd is the whole path: a secret set through the
// API, granted at create, a real native sandbox that curls its host with
// only the placeholder (trusting its CA through the env the platform set,
// nothing written by the test), a local HTTPS server behind the name that
// receives the real value, another allowed host that receives only the
// placeholder, rotation on the next request, revocation stopping it.
//
// FULL PATH: it needs the gateway's TLS interception (the "mitm" slice):
// it skips while the gateway's probe lacks "broker" = "ok", or while
// server.NetworkOptions has no UpstreamCA (how a test makes the gateway
// trust its local HTTPS host).
func TestSecretBrokeredEndToEnd(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	prober, ok := e.srv.Network().(interface {
		Probe(context.Context) (map[string]string, error)
	})
	if !ok {
		t.Skip("FULL PATH: the server's network has no probe")
	}
	if p, err := prober.Probe(ctx); err != nil || p["broker"] != "ok" {
		t.Skipf("FULL PATH: the gateway cannot broker yet (probe broker=%q, err %v)", p["broker"], err)
	}
	root, err := os.MkdirTemp("", "sec-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	// The fake internet: one HTTPS echo server on 127.0.0.2 for two names,
	// its certificate from a CA only the gateway trusts.
	upCA, err := secrets.NewCA("test-internet", []string{"api.test", "plain.test"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	leaf := issueLeaf(t, upCA, "api.test", "plain.test")
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "host %s\nauthorization %s\nuri %s\n", r.Host, r.Header.Get("Authorization"), r.RequestURI)
	}))
	up.Listener.Close()
	up.Listener = ln
	up.TLS = &tls.Config{Certificates: []tls.Certificate{leaf}}
	up.StartTLS()
	defer up.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	dns, stopDNS, err := gatewaytest.ServeDNS("127.0.0.1:0", map[string][]string{"api.test": {"127.0.0.2"}, "plain.test": {"127.0.0.2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer stopDNS()
	caFile := filepath.Join(root, "upstream-ca.pem")
	os.WriteFile(caFile, upCA.CertPEM, 0o600)
	opts := server.NetworkOptions{AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, DNSUpstream: dns.Addr,
		DialGuard: "loopback", GatewayBinary: testenv.GatewayBinary(t)}
	f := reflect.ValueOf(&opts).Elem().FieldByName("UpstreamCA")
	if !f.IsValid() {
		t.Skip("FULL PATH: server.NetworkOptions has no UpstreamCA yet")
	}
	f.SetString(caFile)
	data := filepath.Join(root, "data")
	s, err := server.New(context.Background(), server.Config{DataDir: data, CacheDir: testenv.CacheDir(), AgentBinary: testenv.AgentBinary(t),
		JailBinary: testenv.JailBinary(t), APIKeyOut: os.Stderr, Network: opts})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: s.Handler()}
	go hs.Serve(l)
	c, err := sdk.New("http://"+l.Addr().String(), s.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		sbs, _ := c.ListSandboxes(context.Background(), sdk.ListOptions{})
		for _, sb := range sbs {
			if op, err := c.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
				c.WaitOperation(context.Background(), op.ID)
			}
		}
		hs.Close()
		s.Close()
	}()
	value := newSecretValue(t)
	set := func(v string) {
		if _, err := c.SetSecret(ctx, "API_KEY", api.SetSecretRequest{Value: &v, Hosts: []string{"api.test"}}); err != nil {
			t.Fatal(err)
		}
	}
	set(value)
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native", Secrets: []string{"API_KEY"},
		Network: &api.NetworkPolicy{AllowOut: []string{"api.test", "plain.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	gs, _ := c.SandboxSecrets(ctx, sb.ID)
	if len(gs) != 1 {
		t.Fatalf("grants %+v", gs)
	}
	ph := gs[0].Placeholder
	run := func(script string) (string, int) {
		t.Helper()
		res, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", script}})
		if err != nil {
			t.Fatalf("exec %q: %v", script, err)
		}
		return res.Stdout + res.Stderr, res.ExitCode
	}
	// The CA comes from the platform: CURL_CA_BUNDLE is already set.
	curl := func(host string) string {
		return fmt.Sprintf(`curl -sS --max-time 10 -H "Authorization: Bearer $API_KEY" "https://%s:%d/v1/x?key=$API_KEY"`, host, port)
	}
	out, code := run(curl("api.test"))
	if code != 0 || !strings.Contains(out, "authorization Bearer "+value+"\n") || !strings.Contains(out, "uri /v1/x?key="+value+"\n") {
		t.Fatalf("brokered request: %d\n%s", code, out)
	}
	// Another allowed host: never intercepted; only the placeholder, and
	// the sandbox's CA cannot vouch for it (curl trusts the platform's
	// bundle, which lacks the test internet's CA: the TLS check fails).
	out, code = run(curl("plain.test") + " -k")
	if code != 0 || !strings.Contains(out, "authorization Bearer "+ph+"\n") || strings.Contains(out, value) {
		t.Fatalf("plain.test: %d\n%s", code, out)
	}
	if out, code = run(curl("plain.test")); code == 0 {
		t.Fatalf("plain.test was answered under the sandbox's CA:\n%s", out)
	}
	// Rotation: the next request carries the new value.
	value2 := newSecretValue(t)
	set(value2)
	if out, code = run(curl("api.test")); code != 0 || !strings.Contains(out, "authorization Bearer "+value2+"\n") {
		t.Fatalf("after rotation: %d\n%s", code, out)
	}
	// Revocation: only the (old) placeholder goes out.
	if err := c.RevokeSecret(ctx, sb.ID, "API_KEY"); err != nil {
		t.Fatal(err)
	}
	out, _ = run(fmt.Sprintf(`curl -sS --max-time 10 -H "Authorization: Bearer %s" "https://api.test:%d/"`, ph, port))
	if strings.Contains(out, value2) || strings.Contains(out, value) {
		t.Fatalf("after revocation the value still went out:\n%s", out)
	}
}

// issueLeaf signs a server certificate for names with ca.
func issueLeaf(t *testing.T, ca secrets.CA, names ...string) tls.Certificate {
	t.Helper()
	cb, _ := pem.Decode(ca.CertPEM)
	caCert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := pem.Decode(ca.KeyPEM)
	caKey, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}
