package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// TestSecretBrokeredEndToEnd is the whole path: a secret set through the
// API, granted at create, a real native sandbox that curls its host with
// only the placeholder (trusting its CA through the env the platform set,
// nothing written by the test), a local HTTPS server behind the name that
// receives the real value, another allowed host that receives only the
// placeholder, rotation on the next request, revocation stopping it.
//
// The gateway brokers (its probe answers "broker" = "ok") and the shared
// server trusts the local HTTPS host through NetworkOptions.UpstreamCA: a
// gateway that cannot broker is a broken one, so the test fails rather
// than skip (issue 26).
func TestSecretBrokeredEndToEnd(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	prober, ok := e.srv.Network().(interface {
		Probe(context.Context) (map[string]string, error)
	})
	if !ok {
		t.Fatalf("the shared server's network (%T) has no probe", e.srv.Network())
	}
	if p, err := prober.Probe(ctx); err != nil || p["broker"] != "ok" {
		t.Fatalf("the gateway cannot broker: probe broker=%q, err %v", p["broker"], err)
	}
	port, c := e.internet.brokerPort, e.client
	t.Cleanup(func() { c.DeleteSecret(context.Background(), "BROKERED_KEY") })
	value := newSecretValue(t)
	set := func(v string) {
		if _, err := c.SetSecret(ctx, "BROKERED_KEY", api.SetSecretRequest{Value: &v, Hosts: []string{"api.test"}}); err != nil {
			t.Fatal(err)
		}
	}
	set(value)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native", Secrets: []string{"BROKERED_KEY"},
		Network: &api.NetworkPolicy{AllowOut: []string{"api.test", "plain.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
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
		return fmt.Sprintf(`curl -sS --max-time 10 -H "Authorization: Bearer $BROKERED_KEY" "https://%s:%d/v1/x?key=$BROKERED_KEY"`, host, port)
	}
	out, code := run(curl("api.test"))
	if code != 0 || !strings.Contains(out, "Authorization: Bearer "+value+"\n") || !strings.Contains(out, "uri /v1/x?key="+value+"\n") {
		t.Fatalf("brokered request: %d\n%s", code, out)
	}
	// Another allowed host: never intercepted; only the placeholder, and
	// the sandbox's CA cannot vouch for it (curl trusts the platform's
	// bundle, which lacks the test internet's CA: the TLS check fails).
	out, code = run(curl("plain.test") + " -k")
	if code != 0 || !strings.Contains(out, "Authorization: Bearer "+ph+"\n") || strings.Contains(out, value) {
		t.Fatalf("plain.test: %d\n%s", code, out)
	}
	if out, code = run(curl("plain.test")); code == 0 {
		t.Fatalf("plain.test was answered under the sandbox's CA:\n%s", out)
	}
	// Rotation: the next request carries the new value.
	value2 := newSecretValue(t)
	set(value2)
	if out, code = run(curl("api.test")); code != 0 || !strings.Contains(out, "Authorization: Bearer "+value2+"\n") {
		t.Fatalf("after rotation: %d\n%s", code, out)
	}
	// Revocation: only the (old) placeholder goes out.
	if err := c.RevokeSecret(ctx, sb.ID, "BROKERED_KEY"); err != nil {
		t.Fatal(err)
	}
	out, _ = run(fmt.Sprintf(`curl -sS --max-time 10 -H "Authorization: Bearer %s" "https://api.test:%d/"`, ph, port))
	if strings.Contains(out, value2) || strings.Contains(out, value) {
		t.Fatalf("after revocation the value still went out:\n%s", out)
	}
}
