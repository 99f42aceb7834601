package server

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// recordingSink is an audit.Sink that keeps every event.
type recordingSink struct {
	mu  sync.Mutex
	evs []audit.Event
}

func (r *recordingSink) Record(_ context.Context, e audit.Event) {
	r.mu.Lock()
	r.evs = append(r.evs, e)
	r.mu.Unlock()
}

func (r *recordingSink) events() []audit.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]audit.Event(nil), r.evs...)
}

var _ audit.Sink = (*recordingSink)(nil)

// TestSecretsAPIKeepsValuesOut drives the secrets routes over a fake
// runtime and a FakeBroker: the value reaches the broker and nothing
// else — no answer, log line (the server's and slog's default), audit
// event or error; rotation, grant, revoke and delete are audited; another
// tenant's key sees none of it.
func TestSecretsAPIKeepsValuesOut(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	var logMu sync.Mutex
	log := slog.New(slog.NewJSONHandler(lockedWriter{&logs, &logMu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	prev := slog.Default()
	slog.SetDefault(log)
	defer slog.SetDefault(prev)
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), log)
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	if _, err := tmpl.ImportDir(context.Background(), src, template.ImportOptions{Tags: []string{"tiny:latest"}, Source: "dir"}); err != nil {
		t.Fatal(err)
	}
	sec, err := secrets.Open(context.Background(), db.SQL(), dir)
	if err != nil {
		t.Fatal(err)
	}
	rt := fakeruntime.New(runtime.Config{DataDir: filepath.Join(dir, "fake"), AgentBinary: testenv.AgentBinary(t)})
	fb := &sandbox.FakeBroker{}
	keys := testKeyStore(t, db, "sk_test_key_1234567890")
	mgr := sandbox.New(sandbox.Config{DB: db, Templates: tmpl, Runtimes: map[string]runtime.Runtime{fakeruntime.Name: rt},
		Logger: log, BaseTemplateRef: "tiny:latest", Network: sandbox.NewFakeNetwork(), Tenants: &tenantsOf{keys: keys}, Secrets: sec, Broker: fb})
	sink := &recordingSink{}
	s := &Server{cfg: Config{Logger: log}, db: db, tmpl: tmpl, mgr: mgr, metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890",
		keys: keys, audit: sink, secrets: sec, portSecret: []byte("0123456789abcdef0123456789abcdef")}
	s.handler = s.routes()
	hs := httptest.NewServer(s.handler)
	t.Cleanup(func() {
		ctx := context.Background()
		sbs, _ := db.ListSandboxes(ctx, store.SandboxFilter{})
		for _, sb := range sbs {
			if op, err := mgr.Verbs().Lifecycle(ctx, sb.ID, api.OpDelete, true); err == nil {
				mgr.Verbs().Wait(ctx, op.ID)
			}
		}
		hs.Close()
		mgr.Close()
		tmpl.Close()
		db.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	other, err := keys.CreateKey(ctx, api.CreateKeyRequest{Name: "b", Tenant: "team-b", Scopes: []string{principal.ScopeSecretsWrite, principal.ScopeSandboxWrite}})
	if err != nil {
		t.Fatal(err)
	}
	var answers bytes.Buffer
	call := func(key, method, path, body string, want int) []byte {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, method, hs.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		answers.Write(b)
		if resp.StatusCode != want {
			t.Fatalf("%s %s: %d %s, want %d", method, path, resp.StatusCode, b, want)
		}
		return b
	}
	admin := s.apiKey
	const v1, v2 = "sk-server-test-VALUE-one", "sk-server-test-VALUE-two"
	call(admin, "PUT", "/v1/secrets/TOK", `{"value":"`+v1+`","hosts":["api.example.com"],"header":"Authorization: Bearer {}"}`, 201)
	var got api.Secret
	json.Unmarshal(call(admin, "PUT", "/v1/secrets/TOK", `{"value":"`+v2+`","hosts":["api.example.com"]}`, 200), &got)
	if got.Version != 2 || got.Tenant != "default" || got.Header != "" {
		t.Fatalf("rotated secret %+v", got)
	}
	// Another tenant: not visible, and its own namespace.
	call(other.Key, "GET", "/v1/secrets/TOK", "", 404)
	var list api.SecretList
	json.Unmarshal(call(other.Key, "GET", "/v1/secrets", "", 200), &list)
	if len(list.Secrets) != 0 {
		t.Fatalf("tenant b sees %+v", list.Secrets)
	}
	if b := call(other.Key, "POST", "/v1/sandboxes", `{"secrets":["TOK"]}`, 404); !bytes.Contains(b, []byte("TOK")) {
		t.Fatalf("tenant b's create naming tenant default's secret: %s", b)
	}
	var created api.CreateSandboxResponse
	json.Unmarshal(call(admin, "POST", "/v1/sandboxes", `{"secrets":["TOK"],"network":{"allow_out":["api.example.com"]}}`, 202), &created)
	if op, err := mgr.Verbs().Wait(ctx, created.Operation.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("create: %v %+v", err, op)
	}
	id := created.Sandbox.ID
	call(admin, "GET", "/v1/sandboxes/"+id, "", 200)
	call(admin, "GET", "/v1/sandboxes/"+id+"/secrets", "", 200)
	call(other.Key, "GET", "/v1/sandboxes/"+id+"/secrets", "", 404)
	call(admin, "DELETE", "/v1/sandboxes/"+id+"/secrets/TOK", "", 204)
	call(admin, "PUT", "/v1/sandboxes/"+id+"/secrets/TOK", "", 200)
	call(admin, "DELETE", "/v1/secrets/TOK", "", 204)
	call(admin, "DELETE", "/v1/secrets/TOK", "", 404)

	// The broker had the value; nothing else does.
	sawValue := false
	for _, c := range fb.Calls(id) {
		for _, bs := range c.Config.Secrets {
			sawValue = sawValue || string(bs.Value) == v1 || string(bs.Value) == v2
		}
	}
	if !sawValue {
		t.Fatal("the broker never got the value: the test proves nothing")
	}
	evs := sink.events()
	ej, _ := json.Marshal(evs)
	logMu.Lock()
	lg := logs.String()
	logMu.Unlock()
	for what, text := range map[string]string{"answers": answers.String(), "audit events": string(ej), "logs": lg} {
		if strings.Contains(text, v1) || strings.Contains(text, v2) {
			t.Errorf("%s hold a secret value", what)
		}
	}
	var actions []string
	for _, e := range evs {
		if e.Kind == audit.KindSecret {
			actions = append(actions, e.Action+":"+e.Target+":"+e.Result)
		}
	}
	if want := "set:TOK:ok,rotate:TOK:ok,revoke:TOK:ok,grant:TOK:ok,delete:TOK:ok"; strings.Join(actions, ",") != want {
		t.Errorf("audited %v, want %s", actions, want)
	}
}

type lockedWriter struct {
	b  *bytes.Buffer
	mu *sync.Mutex
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}
