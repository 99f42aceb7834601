package e2b

import (
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
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// verbDecider denies the lifecycle verbs in deny (with "no <verb>") and
// allows the rest.
type verbDecider struct {
	mu   sync.Mutex
	deny map[string]bool
}

func (d *verbDecider) Decide(_ context.Context, a actions.Action) actions.Decision {
	d.mu.Lock()
	defer d.mu.Unlock()
	if a.Kind == actions.Lifecycle && d.deny[a.Verb] {
		return actions.Decision{Verdict: actions.Deny, Reason: "no " + a.Verb, Rule: "e2b-test"}
	}
	return actions.Decision{Verdict: actions.Allow}
}

func (d *verbDecider) set(verbs ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.deny = map[string]bool{}
	for _, v := range verbs {
		d.deny[v] = true
	}
}

// newManagedHandler is the E2B layer over a real sandbox manager on the
// fake runtime (suspend and fork without memory), whose Decider is dec.
func newManagedHandler(t *testing.T, dec actions.Decider) (*Handler, *sandbox.Manager) {
	t.Helper()
	testenv.RequireRoot(t) // template imports keep ownership
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), log)
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	if _, err := tmpl.ImportDir(context.Background(), src, template.ImportOptions{Tags: []string{"tiny:latest"}, Source: "dir"}); err != nil {
		t.Fatal(err)
	}
	rt := fakeruntime.NewWithOptions(runtime.Config{DataDir: filepath.Join(dir, "fake"), AgentBinary: testenv.AgentBinary(t)},
		fakeruntime.Options{Suspend: true, Fork: true})
	m := sandbox.New(sandbox.Config{DB: db, Templates: tmpl, Runtimes: map[string]runtime.Runtime{fakeruntime.Name: rt},
		Logger: log, BaseTemplateRef: "tiny:latest", Decider: dec})
	h := New(Config{
		Manager:      m,
		Authenticate: func(string) (principal.Principal, error) { return principal.System, nil },
		Secret:       []byte("test"),
		PortToken:    func(api.Sandbox) string { return "t" },
		Domain:       func(*http.Request) string { return "localhost" },
		Logger:       log,
	})
	t.Cleanup(func() {
		h.Close()
		ctx := context.Background()
		sbs, _ := db.ListSandboxes(ctx, store.SandboxFilter{})
		for _, sb := range sbs {
			if op, err := m.Verbs().Discard(ctx, sb.ID); err == nil {
				m.Verbs().Wait(ctx, op.ID)
			}
		}
		m.Close()
		db.Close()
	})
	return h, m
}

// TestE2BLifecycleIsDecided: E2B's kill, pause, connect (a wake) and fork
// reach the manager's policy decision: a denied verb is a 403 in E2B's
// error shape naming the rule's reason and changes nothing; allowed, each
// works.
func TestE2BLifecycleIsDecided(t *testing.T) {
	dec := &verbDecider{}
	h, m := newManagedHandler(t, dec)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, op, err := m.Creates().Create(ctx, api.CreateSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if op, err = m.Verbs().Wait(ctx, op.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("create: %v %+v", err, op)
	}
	call := func(method, path string) (int, string) {
		t.Helper()
		req := httptest.NewRequest(method, Prefix+path, strings.NewReader("{}"))
		req.Header.Set("X-API-KEY", "k")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code, rec.Body.String()
	}
	state := func() string {
		t.Helper()
		got, err := m.Get(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		return got.State
	}
	count := func() int {
		list, err := m.List(ctx, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		return len(list)
	}
	wantRefused := func(what string, code int, body, reason string) {
		t.Helper()
		var e apiError
		if code != http.StatusForbidden || json.Unmarshal([]byte(body), &e) != nil || e.Code != http.StatusForbidden || !strings.Contains(e.Message, reason) {
			t.Fatalf("%s: %d %s, want 403 saying %q", what, code, body, reason)
		}
	}
	id := sb.ID

	dec.set(api.OpDelete, api.OpSuspend, api.OpFork, api.OpWake)
	code, body := call("DELETE", "/sandboxes/"+id)
	wantRefused("kill", code, body, "no delete")
	code, body = call("POST", "/sandboxes/"+id+"/pause")
	wantRefused("pause", code, body, "no suspend")
	code, body = call("POST", "/sandboxes/"+id+"/fork")
	wantRefused("fork", code, body, "no fork")
	if s, n := state(), count(); s != api.StateRunning || n != 1 {
		t.Fatalf("after refusals: %s, %d sandboxes", s, n)
	}

	dec.set(api.OpWake)
	if code, body = call("POST", "/sandboxes/"+id+"/pause"); code != http.StatusNoContent || state() != api.StateSuspended {
		t.Fatalf("allowed pause: %d %s, %s", code, body, state())
	}
	// Connect wakes a paused sandbox: the verb "wake", as native /wake.
	code, body = call("POST", "/v2/sandboxes/"+id+"/connect")
	wantRefused("connect", code, body, "no wake")
	if s := state(); s != api.StateSuspended {
		t.Fatalf("a refused connect left it %s", s)
	}

	dec.set()
	if code, body = call("POST", "/v2/sandboxes/"+id+"/connect"); code != http.StatusCreated || state() != api.StateRunning {
		t.Fatalf("allowed connect: %d %s, %s", code, body, state())
	}
	if code, body = call("POST", "/sandboxes/"+id+"/fork"); code != http.StatusOK || count() != 2 {
		t.Fatalf("allowed fork: %d %s, %d sandboxes", code, body, count())
	}
	if code, body = call("DELETE", "/sandboxes/"+id); code != http.StatusNoContent {
		t.Fatalf("allowed kill: %d %s", code, body)
	}
	if _, err := m.Get(ctx, id); err == nil {
		t.Fatal("the killed sandbox is still there")
	}
}
