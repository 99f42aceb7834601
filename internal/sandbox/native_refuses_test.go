package sandbox

import (
	"errors"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/testenv"
)

// TestNativeRefusesSuspendAndFork: a runtime whose probe says it cannot
// suspend or fork is refused up front with its own reason (422
// not_supported), never with a failed operation or a child record.
func TestNativeRefusesSuspendAndFork(t *testing.T) {
	h := newHarness(t)
	rt, err := native.New(runtime.Config{DataDir: filepath.Join(h.dir, "native"), AgentBinary: testenv.AgentBinary(t), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := rt.(interface{ Close() error }); ok {
		t.Cleanup(func() { c.Close() })
	}
	caps := rt.Probe(h.ctx())
	testenv.Require(t, "native runtime", caps.Available, caps.Reason)
	m := New(Config{DB: h.db, Templates: h.tmpl, Runtimes: map[string]runtime.Runtime{native.Name: rt},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), BaseTemplateRef: "tiny:latest"})
	t.Cleanup(m.Close)

	// A record is enough: the refusal comes before any instance is touched.
	now := time.Now().UTC()
	sb := api.Sandbox{ID: newID("sb"), State: api.StateRunning, Runtime: native.Name, Template: "tiny:latest",
		Limits: DefaultLimits, CreatedAt: now, UpdatedAt: now, LastActiveAt: now}
	if err := h.db.PutSandbox(h.ctx(), sb); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.db.DeleteSandbox(h.ctx(), sb.ID) })
	check := func(what string, err error, verb string) {
		t.Helper()
		want := "runtime native cannot " + verb + ": " + caps.VerbReasons[verb]
		if !errors.Is(err, errdefs.ErrNotSupported) || errdefs.HTTPStatus(err) != http.StatusUnprocessableEntity ||
			errdefs.Code(err) != "not_supported" || !strings.Contains(err.Error(), want) || caps.VerbReasons[verb] == "" {
			t.Errorf("%s: %v (want %q)", what, err, want)
		}
	}
	for _, verb := range []string{api.OpSuspend, api.OpRestore, api.OpFork} {
		_, err := m.verbs.Lifecycle(h.ctx(), sb.ID, verb, false)
		check(verb, err, verb)
	}
	_, err = m.verbs.Fork(h.ctx(), sb.ID, api.ForkRequest{Count: 3})
	check("fork of 3", err, api.OpFork)
	_, _, err = m.creates.Create(h.ctx(), api.CreateSandboxRequest{Runtime: native.Name, Idle: &api.IdlePolicy{AfterSeconds: 60, Action: api.OpSuspend}})
	check("create with idle suspend", err, api.OpSuspend)
	sbs, _ := h.db.ListSandboxes(h.ctx(), store.SandboxFilter{})
	if len(sbs) != 1 {
		t.Fatalf("refusals left records: %d sandboxes", len(sbs))
	}
	ops, _ := h.db.ListOperations(h.ctx(), store.OperationFilter{SandboxID: sb.ID})
	if len(ops) != 0 {
		t.Fatalf("refusals recorded operations: %+v", ops)
	}
}
