package e2e

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/gateway/gwctl"
)

// TestBrokerInterceptsFromSandbox: a real native sandbox curls a brokered
// host with only a placeholder; the local HTTPS server standing in for the
// host (its own CA, trusted by the gateway through --egress-upstream-ca)
// receives the real value, a second allowed host receives the placeholder
// through the plain relay, a rotated value is sent on the next request, and
// no event carries a value. The config goes to the gateway over gwctl
// directly (the server's secrets API wires it later).
func TestBrokerInterceptsFromSandbox(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	upCA, port, data, c := e.internet.upCA, e.internet.brokerPort, e.data, e.client
	sbCA, err := gatewaytest.NewCA("sandbox CA")
	if err != nil {
		t.Fatal(err)
	}
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native", Network: &api.NetworkPolicy{AllowOut: []string{"api.test", "plain.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	for path, pem := range map[string][]byte{"/tmp/space-ca.pem": sbCA.CertPEM, "/tmp/internet-ca.pem": upCA.CertPEM} {
		if _, err := c.WriteFile(ctx, sb.ID, path, strings.NewReader(string(pem)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const ph = "SPACE_PH_e2e_0123456789abcdef"
	secret := func(value string) brokerconf.Config {
		return brokerconf.Config{CACertPEM: sbCA.CertPEM, CAKeyPEM: sbCA.KeyPEM, Secrets: []brokerconf.Secret{{
			Name: "API_KEY", Hosts: []string{"api.test"}, Placeholder: ph, Value: []byte(value)}}}
	}
	gw := &gwctl.Client{Path: filepath.Join(data, "network", "ctl.sock")}
	if err := gw.SetBroker(ctx, sb.ID, secret("sk-e2e-real-1")); err != nil {
		t.Fatal(err)
	}
	run := func(script string) (string, int) {
		t.Helper()
		res, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", script}, Env: map[string]string{"API_KEY": ph}})
		if err != nil {
			t.Fatalf("exec %q: %v", script, err)
		}
		return res.Stdout + res.Stderr, res.ExitCode
	}
	curl := fmt.Sprintf(`curl -sS --max-time 10 -H "Authorization: Bearer $API_KEY" "https://%%s:%d/v1/x?key=$API_KEY"`, port)
	brokered := "CURL_CA_BUNDLE=/tmp/space-ca.pem " + fmt.Sprintf(curl, "api.test")
	out, code := run(brokered)
	if code != 0 || !strings.Contains(out, "Authorization: Bearer sk-e2e-real-1\n") || !strings.Contains(out, "uri /v1/x?key=sk-e2e-real-1\n") || strings.Contains(out, ph) {
		t.Fatalf("brokered request: %d\n%s", code, out)
	}
	// Another allowed host: the plain relay, its real certificate, the
	// placeholder as sent (worthless there).
	out, code = run("CURL_CA_BUNDLE=/tmp/internet-ca.pem " + fmt.Sprintf(curl, "plain.test"))
	if code != 0 || !strings.Contains(out, "Authorization: Bearer "+ph+"\n") || strings.Contains(out, "sk-e2e-real") {
		t.Fatalf("plain.test: %d\n%s", code, out)
	}
	if out, code = run("CURL_CA_BUNDLE=/tmp/space-ca.pem " + fmt.Sprintf(curl, "plain.test")); code == 0 {
		t.Fatalf("plain.test presented a certificate of the sandbox CA:\n%s", out)
	}
	// Rotation: the next request carries the new value.
	if err := gw.SetBroker(ctx, sb.ID, secret("sk-e2e-real-2")); err != nil {
		t.Fatal(err)
	}
	if out, code = run(brokered); code != 0 || !strings.Contains(out, "Authorization: Bearer sk-e2e-real-2\n") {
		t.Fatalf("after rotation: %d\n%s", code, out)
	}
	var evs []api.NetworkEvent
	if err := c.NetworkEvents(ctx, sb.ID, 0, false, func(ev api.NetworkEvent) error { evs = append(evs, ev); return nil }); err != nil {
		t.Fatal(err)
	}
	var https []api.NetworkEvent
	for _, ev := range evs {
		if ev.Protocol == "https" {
			https = append(https, ev)
		}
	}
	if len(https) != 2 || https[0].Name != "api.test" || https[0].Path != "/v1/x" || https[0].Status != 200 || len(https[0].Secrets) != 1 || https[0].Secrets[0] != "API_KEY" {
		t.Fatalf("request events %+v", https)
	}
	if b, _ := json.Marshal(evs); strings.Contains(string(b), "sk-e2e-real") {
		t.Fatalf("an event carries a secret value: %s", b)
	}
}
