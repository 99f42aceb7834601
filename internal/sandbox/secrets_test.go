package sandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/secrets"
)

// secretHarness is a net harness whose manager has a secrets store and a
// FakeBroker.
func secretHarness(t *testing.T, opts fakeruntime.Options) (*harness, *secrets.Store, *FakeBroker) {
	t.Helper()
	h := newNetHarness(t, opts, api.NetworkPolicy{})
	st, err := secrets.Open(context.Background(), h.db.SQL(), h.dir)
	if err != nil {
		t.Fatal(err)
	}
	fb := &FakeBroker{}
	h.m.cfg.Secrets, h.m.cfg.Broker = st, fb
	return h, st, fb
}

func (h *harness) env(id, name string) string {
	h.t.Helper()
	res, err := h.m.cmds.Exec(h.ctx(), id, api.ExecRequest{Cmd: []string{"sh", "-c", "printf %s \"$" + name + "\""}})
	if err != nil {
		h.t.Fatal(err)
	}
	return res.Stdout
}

// brokered finds name in c, checking the gateway's rule: one entry per name.
func brokered(c brokerconf.Config, name string) (brokerconf.Secret, bool) {
	var out []brokerconf.Secret
	for _, s := range c.Secrets {
		if s.Name == name {
			out = append(out, s)
		}
	}
	if len(out) != 1 {
		return brokerconf.Secret{}, false
	}
	return out[0], true
}

const testValue = "sk-live-SECRETVALUE-9f8e7d6c5b4a"

func TestSecretsGrantedAtCreate(t *testing.T) {
	h, st, fb := secretHarness(t, fakeruntime.Options{})
	ctx := h.ctx()
	if _, _, err := st.Set(ctx, secrets.SetRequest{Name: "API_TOKEN", Value: []byte(testValue), Hosts: []string{"api.example.com"}, Header: "Authorization: Bearer {}"}); err != nil {
		t.Fatal(err)
	}
	// Refusals before anything is recorded.
	for _, tc := range []struct {
		req  api.CreateSandboxRequest
		want error
	}{
		{api.CreateSandboxRequest{Secrets: []string{"NOPE"}}, errdefs.ErrNotFound},
		{api.CreateSandboxRequest{Secrets: []string{"bad name"}}, errdefs.ErrInvalidArgument},
		{api.CreateSandboxRequest{Secrets: []string{"API_TOKEN", "API_TOKEN"}}, errdefs.ErrInvalidArgument},
		{api.CreateSandboxRequest{Secrets: []string{"API_TOKEN"}, Env: map[string]string{"API_TOKEN": "x"}}, errdefs.ErrInvalidArgument},
		{api.CreateSandboxRequest{Network: &api.NetworkPolicy{AllowOut: []string{"api.example.com"},
			Rules: []api.HeaderRule{{Domain: "api.example.com", SetHeaders: map[string]string{"X-Key": "{secret:API_TOKEN}"}}}}}, errdefs.ErrInvalidArgument},
	} {
		if _, _, err := h.m.creates.Create(ctx, tc.req); !errors.Is(err, tc.want) {
			t.Errorf("create %+v: err = %v, want %v", tc.req, err, tc.want)
		}
	}
	if ids, _ := st.Sandboxes(ctx); len(ids) != 0 {
		t.Fatalf("refused creates left grants for %v", ids)
	}
	sb := h.create(api.CreateSandboxRequest{Secrets: []string{"API_TOKEN"}, Network: &api.NetworkPolicy{AllowOut: []string{"api.example.com"}}})
	gs, err := h.m.secrets.SandboxSecrets(ctx, sb.ID)
	if err != nil || len(gs) != 1 {
		t.Fatalf("grants: %v %v", err, gs)
	}
	ph := gs[0].Placeholder
	if got := h.env(sb.ID, "API_TOKEN"); got != ph {
		t.Fatalf("env API_TOKEN = %q, want the placeholder %q", got, ph)
	}
	for k, v := range TrustEnv {
		if got := h.env(sb.ID, k); got != v {
			t.Errorf("env %s = %q, want %q", k, got, v)
		}
	}
	// The broker got the value at attach; the record never holds it.
	c, ok := fb.Last(sb.ID)
	if !ok {
		t.Fatal("nothing was pushed to the broker at attach")
	}
	bs, ok := brokered(c, "API_TOKEN")
	if !ok || string(bs.Value) != testValue || bs.Placeholder != ph || bs.Header != "Authorization: Bearer {}" || strings.Join(bs.Hosts, ",") != "api.example.com" {
		t.Fatalf("brokered = %+v", bs)
	}
	rec, _ := json.Marshal(sb)
	if bytes.Contains(rec, []byte(testValue)) {
		t.Fatal("the sandbox record holds the value")
	}
	// The CA is in the sandbox's trust files and is the one the gateway has.
	root := filepath.Join(h.dir, "fake", sb.ID, "root")
	for _, p := range []string{TrustCAPath, TrustAnchorPath, TrustBundlePath} {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil || !bytes.Contains(b, c.CACertPEM) {
			t.Errorf("%s: %v, holds the CA: %v", p, err, bytes.Contains(b, c.CACertPEM))
		}
	}
	if len(c.CAKeyPEM) == 0 || bytes.Contains(c.CACertPEM, []byte("PRIVATE")) {
		t.Fatal("CA key missing from the broker config, or in the certificate")
	}
	// Delete forgets grants and CA.
	op, _ := h.m.verbs.Lifecycle(ctx, sb.ID, api.OpDelete, true)
	h.wait(op)
	if ids, _ := st.Sandboxes(ctx); len(ids) != 0 {
		t.Fatalf("grants or CA outlive the sandbox: %v", ids)
	}
}

func TestSecretsSystemBundleAppendedIdempotently(t *testing.T) {
	h, st, _ := secretHarness(t, fakeruntime.Options{})
	ctx := h.ctx()
	st.Set(ctx, secrets.SetRequest{Name: "TOK", Value: []byte(testValue), Hosts: []string{"a.example.com"}})
	sb := h.create(api.CreateSandboxRequest{})
	root := filepath.Join(h.dir, "fake", sb.ID, "root")
	sys := filepath.Join(root, SystemBundlePath)
	os.MkdirAll(filepath.Dir(sys), 0o755)
	orig := "-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----\n"
	os.WriteFile(sys, []byte(orig), 0o644)
	if _, err := h.m.secrets.GrantSecret(ctx, sb.ID, "TOK"); err != nil {
		t.Fatal(err)
	}
	first, _ := os.ReadFile(sys)
	if !strings.HasPrefix(string(first), orig) || strings.Count(string(first), trustBlockBegin) != 1 {
		t.Fatalf("system bundle after install:\n%s", first)
	}
	// A second install (a new host set: a new CA) replaces the block.
	st.Set(ctx, secrets.SetRequest{Name: "TOK2", Value: []byte("v2"), Hosts: []string{"b.example.com"}})
	if _, err := h.m.secrets.GrantSecret(ctx, sb.ID, "TOK2"); err != nil {
		t.Fatal(err)
	}
	second, _ := os.ReadFile(sys)
	if !strings.HasPrefix(string(second), orig) || strings.Count(string(second), trustBlockBegin) != 1 || bytes.Equal(first, second) {
		t.Fatalf("system bundle after a second install:\n%s", second)
	}
	bundle, _ := os.ReadFile(filepath.Join(root, TrustBundlePath))
	if !bytes.Equal(bundle, second) {
		t.Fatal("the space bundle differs from the system bundle + CA")
	}
}

func TestSecretsLiveGrantRevokeRotate(t *testing.T) {
	h, st, fb := secretHarness(t, fakeruntime.Options{})
	ctx := h.ctx()
	st.Set(ctx, secrets.SetRequest{Name: "TOK", Value: []byte(testValue), Hosts: []string{"api.example.com"}})
	sb := h.create(api.CreateSandboxRequest{Network: &api.NetworkPolicy{AllowOut: []string{"api.example.com"}}})
	if _, ok := fb.Last(sb.ID); ok {
		t.Fatal("a sandbox with nothing to broker was pushed a config")
	}
	if got := h.env(sb.ID, "TOK"); got != "" {
		t.Fatalf("TOK before the grant = %q", got)
	}
	g, err := h.m.secrets.GrantSecret(ctx, sb.ID, "TOK")
	if err != nil {
		t.Fatal(err)
	}
	if got := h.env(sb.ID, "TOK"); got != g.Placeholder {
		t.Fatalf("after grant TOK = %q, want %q", got, g.Placeholder)
	}
	c, _ := fb.Last(sb.ID)
	if bs, ok := brokered(c, "TOK"); !ok || string(bs.Value) != testValue {
		t.Fatalf("after grant: %+v", c.Secrets)
	}
	// Granting again is the same grant.
	if g2, err := h.m.secrets.GrantSecret(ctx, sb.ID, "TOK"); err != nil || g2.Placeholder != g.Placeholder {
		t.Fatalf("second grant: %v %+v", err, g2)
	}
	// Rotation: the next config carries the new value, same placeholder.
	if _, _, err := st.Set(ctx, secrets.SetRequest{Name: "TOK", Value: []byte("rotated-value-2"), Hosts: []string{"api.example.com"}}); err != nil {
		t.Fatal(err)
	}
	if err := h.m.secrets.SecretRotated(ctx, "", "TOK"); err != nil {
		t.Fatal(err)
	}
	c, _ = fb.Last(sb.ID)
	if bs, ok := brokered(c, "TOK"); !ok || string(bs.Value) != "rotated-value-2" || bs.Placeholder != g.Placeholder {
		t.Fatalf("after rotation: %+v", c.Secrets)
	}
	// Revoke: the env var goes and the gateway forgets the secret.
	if err := h.m.secrets.RevokeSecret(ctx, sb.ID, "TOK"); err != nil {
		t.Fatal(err)
	}
	if got := h.env(sb.ID, "TOK"); got != "" {
		t.Fatalf("after revoke TOK = %q", got)
	}
	c, _ = fb.Last(sb.ID)
	if len(c.Secrets) != 0 {
		t.Fatalf("after revoke the gateway still has %+v", c.Secrets)
	}
	if err := h.m.secrets.RevokeSecret(ctx, sb.ID, "TOK"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("revoking again: %v", err)
	}
	// Deleting a granted secret revokes it everywhere.
	h.m.secrets.GrantSecret(ctx, sb.ID, "TOK")
	ids, err := st.Delete(ctx, "", "TOK")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.m.secrets.SecretDeleted(ctx, "TOK", ids); err != nil {
		t.Fatal(err)
	}
	if got := h.env(sb.ID, "TOK"); got != "" {
		t.Fatalf("after delete TOK = %q", got)
	}
	if c, _ := fb.Last(sb.ID); len(c.Secrets) != 0 {
		t.Fatalf("after delete the gateway still has %+v", c.Secrets)
	}
}

func TestSecretsInHeaderRules(t *testing.T) {
	h, st, fb := secretHarness(t, fakeruntime.Options{})
	ctx := h.ctx()
	st.Set(ctx, secrets.SetRequest{Name: "KEY", Value: []byte(testValue)}) // no hosts of its own
	st.Set(ctx, secrets.SetRequest{Name: "TOK", Value: []byte("tok-value"), Hosts: []string{"api.example.com"}})
	sb := h.create(api.CreateSandboxRequest{Network: &api.NetworkPolicy{AllowOut: []string{"*.example.org", "api.example.com"}}})
	pol := api.NetworkPolicy{AllowOut: []string{"*.example.org", "api.example.com"},
		Rules: []api.HeaderRule{
			{Domain: "api.example.org", SetHeaders: map[string]string{"X-Api-Key": "key={secret:KEY}"}},
			{Domain: "up.example.org", SetHeaders: map[string]string{"Authorization": "Bearer {secret:TOK}"}},
		}}
	if _, err := h.m.net.SetNetwork(ctx, sb.ID, pol); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "not granted") {
		t.Fatalf("a rule naming an ungranted secret: %v", err)
	}
	bad := api.NetworkPolicy{AllowOut: pol.AllowOut, Rules: []api.HeaderRule{{Domain: "api.example.org", SetHeaders: map[string]string{"X": "{secret:lower}"}}}}
	if _, err := h.m.net.SetNetwork(ctx, sb.ID, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a malformed reference: %v", err)
	}
	for _, n := range []string{"KEY", "TOK"} {
		if _, err := h.m.secrets.GrantSecret(ctx, sb.ID, n); err != nil {
			t.Fatal(err)
		}
	}
	if c, _ := fb.Last(sb.ID); func() bool { _, ok := brokered(c, "KEY"); return ok }() {
		t.Fatal("a secret without hosts and without a rule naming it was brokered")
	}
	if _, err := h.m.net.SetNetwork(ctx, sb.ID, pol); err != nil {
		t.Fatal(err)
	}
	c, _ := fb.Last(sb.ID)
	key, ok1 := brokered(c, "KEY")
	tok, ok2 := brokered(c, "TOK")
	if !ok1 || !ok2 || string(key.Value) != testValue || strings.Join(key.Hosts, ",") != "api.example.org" ||
		strings.Join(tok.Hosts, ",") != "api.example.com,up.example.org" {
		t.Fatalf("brokered = %+v", c.Secrets)
	}
	ca, _ := st.CA(ctx, sb.ID)
	if strings.Join(ca.Hosts, ",") != "api.example.com,api.example.org,up.example.org" {
		t.Fatalf("CA hosts %v", ca.Hosts)
	}
	if err := h.m.secrets.RevokeSecret(ctx, sb.ID, "KEY"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("revoking a secret a rule names: %v", err)
	}
}

func TestSecretsForkGetsNewPlaceholdersAndCA(t *testing.T) {
	h, st, fb := secretHarness(t, fakeruntime.Options{Fork: true, Suspend: true})
	ctx := h.ctx()
	st.Set(ctx, secrets.SetRequest{Name: "TOK", Value: []byte(testValue), Hosts: []string{"api.example.com"}})
	sb := h.create(api.CreateSandboxRequest{Secrets: []string{"TOK"}})
	parentPH := h.env(sb.ID, "TOK")
	parentCfg, _ := fb.Last(sb.ID)
	op, err := h.m.verbs.Fork(ctx, sb.ID, api.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	if op = h.wait(op); op.State != api.OpSucceeded {
		t.Fatalf("fork: %+v", op.Error)
	}
	seen := map[string]bool{parentPH: true}
	for _, kid := range op.Children {
		ph := h.env(kid, "TOK")
		if !strings.HasPrefix(ph, secrets.PlaceholderPrefix) || seen[ph] {
			t.Fatalf("child %s placeholder %q (seen: %v)", kid, ph, seen)
		}
		seen[ph] = true
		c, ok := fb.Last(kid)
		bs, _ := brokered(c, "TOK")
		if !ok || bs.Placeholder != ph || bytes.Equal(c.CACertPEM, parentCfg.CACertPEM) {
			t.Fatalf("child %s broker config: ok=%v placeholder %q, same CA as the parent: %v", kid, ok, bs.Placeholder, bytes.Equal(c.CACertPEM, parentCfg.CACertPEM))
		}
		b, _ := os.ReadFile(filepath.Join(h.dir, "fake", kid, "root", TrustCAPath))
		if !bytes.Equal(b, c.CACertPEM) {
			t.Fatalf("child %s trusts %q, not its own CA", kid, b)
		}
	}
	// The parent keeps its own.
	if c, _ := fb.Last(sb.ID); !bytes.Equal(c.CACertPEM, parentCfg.CACertPEM) {
		t.Fatal("the fork changed the parent's CA")
	}
	// Suspend and restore: the same placeholder.
	op, err = h.m.verbs.Lifecycle(ctx, sb.ID, api.OpSuspend, false)
	if err != nil {
		t.Fatal(err)
	}
	h.wait(op)
	if got := h.env(sb.ID, "TOK"); got != parentPH {
		t.Fatalf("after suspend/wake TOK = %q, want %q", got, parentPH)
	}
}

func TestSecretsBrokerFailureFailsAttach(t *testing.T) {
	h, st, fb := secretHarness(t, fakeruntime.Options{})
	ctx := h.ctx()
	st.Set(ctx, secrets.SetRequest{Name: "TOK", Value: []byte(testValue), Hosts: []string{"api.example.com"}})
	fb.FailWith(errors.New("gateway says no"))
	sb, op, err := h.m.creates.Create(ctx, api.CreateSandboxRequest{Secrets: []string{"TOK"}})
	if err != nil {
		t.Fatal(err)
	}
	if op, _ = h.m.verbs.Wait(ctx, op.ID); op.State != api.OpFailed || op.Error.Code != api.CodeUnavailable || !strings.Contains(op.Error.Message, "gateway says no") {
		t.Fatalf("create with a failing broker: %+v", op)
	}
	if strings.Contains(op.Error.Message, testValue) {
		t.Fatal("the error quotes the value")
	}
	// A sandbox with nothing to broker is not affected.
	h.create(api.CreateSandboxRequest{})
	_ = sb
}
