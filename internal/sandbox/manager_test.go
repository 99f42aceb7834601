package sandbox

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// harness is a manager over the fake runtime (real agent processes, no
// isolation) and a real store and template store.
type harness struct {
	t    *testing.T
	dir  string
	db   *store.DB
	tmpl *template.Store
	m    *Manager
	opts fakeruntime.Options
	rt   *fakeruntime.Runtime // of the current manager
	// netw, when set, is the manager's Network (nil: networking off);
	// defNet its DefaultNetwork.
	netw   *FakeNetwork
	defNet api.NetworkPolicy
	// dec and rec, when set, are the manager's Decider and Audit.
	dec actions.Decider
	rec audit.Sink
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	return newHarnessWith(t, fakeruntime.Options{})
}

// newHarnessWith is newHarness with the fake's optional (memory-less)
// suspend and fork abilities.
func newHarnessWith(t *testing.T, opts fakeruntime.Options) *harness {
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
	os.WriteFile(filepath.Join(src, "etc", "hello"), []byte("hi"), 0o644)
	if _, err := tmpl.ImportDir(context.Background(), src, template.ImportOptions{Tags: []string{"tiny:latest"}, Source: "dir"}); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, dir: dir, db: db, tmpl: tmpl, opts: opts}
	h.m = h.manager()
	t.Cleanup(func() {
		ctx := context.Background()
		sbs, _ := db.ListSandboxes(ctx, store.SandboxFilter{})
		for _, sb := range sbs {
			if op, err := h.m.verbs.Lifecycle(ctx, sb.ID, api.OpDelete, true); err == nil {
				h.m.verbs.Wait(ctx, op.ID)
			}
		}
		h.m.Close()
		db.Close()
	})
	return h
}

func (h *harness) manager() *Manager {
	rt := fakeruntime.NewWithOptions(runtime.Config{DataDir: filepath.Join(h.dir, "fake"), AgentBinary: testenv.AgentBinary(h.t)}, h.opts)
	h.rt = rt
	cfg := Config{
		DB: h.db, Templates: h.tmpl, Runtimes: map[string]runtime.Runtime{fakeruntime.Name: rt},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), BaseTemplateRef: "tiny:latest",
		DefaultNetwork: h.defNet,
	}
	if h.netw != nil {
		cfg.Network = h.netw
	}
	cfg.Decider, cfg.Audit = h.dec, h.rec
	return New(cfg)
}

func (h *harness) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	h.t.Cleanup(cancel)
	return ctx
}

func (h *harness) create(req api.CreateSandboxRequest) api.Sandbox {
	h.t.Helper()
	sb, op, err := h.m.creates.Create(h.ctx(), req)
	if err != nil {
		h.t.Fatal(err)
	}
	h.wait(op)
	sb, err = h.m.Get(h.ctx(), sb.ID)
	if err != nil || sb.State != api.StateRunning {
		h.t.Fatalf("after create: %v %+v", err, sb)
	}
	return sb
}

func (h *harness) wait(op api.Operation) api.Operation {
	h.t.Helper()
	op, err := h.m.verbs.Wait(h.ctx(), op.ID)
	if err != nil || op.State != api.OpSucceeded {
		h.t.Fatalf("operation %s %s: %v %+v", op.Kind, op.ID, err, op.Error)
	}
	return op
}

func (h *harness) verb(id, verb string) api.Operation {
	h.t.Helper()
	op, err := h.m.verbs.Lifecycle(h.ctx(), id, verb, false)
	if err != nil {
		h.t.Fatalf("%s: %v", verb, err)
	}
	return h.wait(op)
}

func (h *harness) state(id string) string {
	sb, err := h.m.Get(h.ctx(), id)
	if err != nil {
		h.t.Fatal(err)
	}
	return sb.State
}

func TestCreateRecordsPhasesAndMergesEnv(t *testing.T) {
	h := newHarness(t)
	sb, op, err := h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{Env: map[string]string{"A": "sandbox", "B": "sandbox"}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.State != api.StateCreating || op.State != api.OpPending || sb.Runtime != fakeruntime.Name {
		t.Fatalf("create returned %+v %+v", sb, op)
	}
	op = h.wait(op)
	var names []string
	for _, p := range op.Phases {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, ","); got != "resolve_template,prepare,start_runtime,agent_ready" {
		t.Fatalf("phases %s", got)
	}
	got, _ := h.m.Get(h.ctx(), sb.ID)
	if !strings.HasPrefix(got.TemplateDigest, "sha256:") || got.Limits != DefaultLimits {
		t.Fatalf("sandbox %+v", got)
	}
	res, err := h.m.cmds.Exec(h.ctx(), sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "echo $A $B"}, Env: map[string]string{"B": "request"}})
	if err != nil || res.Stdout != "sandbox request\n" {
		t.Fatalf("exec: %v %+v", err, res)
	}
}

func TestVerbsFollowTheStateMachine(t *testing.T) {
	h := newHarness(t)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.verb(id, api.OpPause)
	if s := h.state(id); s != api.StatePaused {
		t.Fatalf("after pause: %s", s)
	}
	h.verb(id, api.OpPause) // idempotent
	h.verb(id, api.OpStop)  // from paused
	if s := h.state(id); s != api.StateStopped {
		t.Fatalf("after stop: %s", s)
	}
	for _, verb := range []string{api.OpPause, api.OpResume} {
		if _, err := h.m.verbs.Lifecycle(h.ctx(), id, verb, false); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("%s on stopped: %v", verb, err)
		}
	}
	_, err := h.m.verbs.Lifecycle(h.ctx(), id, api.OpSuspend, false)
	if !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), "runtime fake cannot suspend") {
		t.Errorf("suspend: %v", err)
	}
	if _, err := h.m.verbs.Lifecycle(h.ctx(), id, "explode", false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("unknown verb: %v", err)
	}
	h.verb(id, api.OpWake)
	if s := h.state(id); s != api.StateRunning {
		t.Fatalf("after wake: %s", s)
	}
	if _, err := h.m.verbs.Lifecycle(h.ctx(), id, api.OpDelete, false); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("delete of running without force: %v", err)
	}
	h.verb(id, api.OpStop)
	h.verb(id, api.OpDelete)
	if _, err := h.m.Get(h.ctx(), id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.dir, "fake", id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("runtime resources left after delete: %v", err)
	}
}

func TestCallsWakeStoppedAndPausedSandboxes(t *testing.T) {
	h := newHarness(t)
	id := h.create(api.CreateSandboxRequest{}).ID
	for _, verb := range []string{api.OpStop, api.OpPause} {
		if verb == api.OpPause {
			h.verb(id, api.OpStart)
		}
		h.verb(id, verb)
		res, err := h.m.cmds.Exec(h.ctx(), id, api.ExecRequest{Cmd: []string{"echo", "up"}})
		if err != nil || res.Stdout != "up\n" {
			t.Fatalf("exec after %s: %v %+v", verb, err, res)
		}
		if s := h.state(id); s != api.StateRunning {
			t.Fatalf("after exec on %s sandbox: %s", verb, s)
		}
	}
	ops, err := h.db.ListOperations(h.ctx(), store.OperationFilter{SandboxID: id})
	if err != nil {
		t.Fatal(err)
	}
	wakes := 0
	for _, op := range ops {
		if op.Kind == api.OpWake && op.State == api.OpSucceeded {
			wakes++
		}
	}
	if wakes != 2 {
		t.Fatalf("want 2 recorded wake operations, got %d", wakes)
	}
}

func TestIdlePolicyAndTTL(t *testing.T) {
	h := newHarness(t)
	h.m.recon.Run()
	idle := h.create(api.CreateSandboxRequest{Idle: &api.IdlePolicy{AfterSeconds: 1, Action: "stop"}}).ID
	ttl := h.create(api.CreateSandboxRequest{TTLSeconds: 1}).ID
	deadline := time.Now().Add(15 * time.Second)
	for h.state(idle) != api.StateStopped {
		if time.Now().After(deadline) {
			t.Fatalf("idle sandbox is %s", h.state(idle))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for {
		_, err := h.m.Get(h.ctx(), ttl)
		if errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("TTL sandbox still exists")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestAgentDeathStopsSandboxAndNextCallRestarts(t *testing.T) {
	h := newHarness(t)
	id := h.create(api.CreateSandboxRequest{}).ID
	// The sandbox's code kills its agent (the fake's agent is the process group leader).
	h.m.cmds.Exec(h.ctx(), id, api.ExecRequest{Cmd: []string{"sh", "-c", "kill -9 $PPID"}})
	deadline := time.Now().Add(10 * time.Second)
	for h.state(id) != api.StateStopped {
		if time.Now().After(deadline) {
			t.Fatalf("sandbox is %s after its agent died", h.state(id))
		}
		time.Sleep(20 * time.Millisecond)
	}
	sb, _ := h.m.Get(h.ctx(), id)
	if !strings.Contains(sb.Error, "exited unexpectedly") {
		t.Fatalf("no reason recorded: %+v", sb)
	}
	res, err := h.m.cmds.Exec(h.ctx(), id, api.ExecRequest{Cmd: []string{"true"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec after agent death: %v %+v", err, res)
	}
}

func TestReconcileReadoptsRedrivesAndSweeps(t *testing.T) {
	h := newHarness(t)
	id := h.create(api.CreateSandboxRequest{}).ID
	// A create whose server died right after persisting intent.
	now := time.Now().UTC()
	pending := api.Sandbox{ID: newID("sb"), State: api.StateCreating, Runtime: fakeruntime.Name, Template: "tiny:latest",
		Limits: DefaultLimits, CreatedAt: now, UpdatedAt: now, LastActiveAt: now}
	op := newOperation(api.OpCreate, pending.ID)
	if err := h.db.PutSandbox(h.ctx(), pending); err != nil {
		t.Fatal(err)
	}
	if err := h.db.PutOperation(h.ctx(), op); err != nil {
		t.Fatal(err)
	}
	// An operation that cannot be re-driven, and host junk no record owns.
	stale := newOperation(api.OpPause, id)
	stale.State = api.OpRunning
	h.db.PutOperation(h.ctx(), stale)
	orphan := filepath.Join(h.dir, "fake", "sb-orphanorphanorph")
	os.MkdirAll(orphan, 0o755)

	h.m.Close() // the "server" goes away; its sandboxes keep running
	h.m = h.manager()
	if err := h.m.recon.Reconcile(h.ctx()); err != nil {
		t.Fatal(err)
	}
	res, err := h.m.cmds.Exec(h.ctx(), id, api.ExecRequest{Cmd: []string{"echo", "readopted"}})
	if err != nil || res.Stdout != "readopted\n" {
		t.Fatalf("exec after reconcile: %v %+v", err, res)
	}
	if got := h.wait(op); got.Kind != api.OpCreate {
		t.Fatalf("re-driven op %+v", got)
	}
	if s := h.state(pending.ID); s != api.StateRunning {
		t.Fatalf("re-driven create left %s", s)
	}
	got, _ := h.db.GetOperation(h.ctx(), stale.ID)
	if got.State != api.OpFailed || got.Error == nil || got.Error.Code != "interrupted" {
		t.Fatalf("stale op %+v", got)
	}
	if _, err := os.Stat(orphan); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("orphan not swept: %v", err)
	}
}

func TestCreateValidation(t *testing.T) {
	h := newHarness(t)
	bad := []api.CreateSandboxRequest{
		{Limits: api.Limits{MemoryMiB: -1}},
		{Limits: api.Limits{MemoryMiB: 1}},
		{Limits: api.Limits{CPUs: 1000}},
		{Limits: api.Limits{Pids: 1 << 40}},
		{Limits: api.Limits{DiskMiB: 3}},
		{Env: map[string]string{"1BAD": "x"}},
		{Env: map[string]string{"OK": "a\x00b"}},
		{Workdir: "relative"},
		{Labels: map[string]string{"": "x"}},
		{TTLSeconds: -5},
		{Idle: &api.IdlePolicy{AfterSeconds: 0, Action: "pause"}},
		{Runtime: "nope"},
	}
	for _, req := range bad {
		if _, _, err := h.m.creates.Create(h.ctx(), req); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("create %+v: want invalid argument, got %v", req, err)
		}
	}
	if _, _, err := h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{Idle: &api.IdlePolicy{AfterSeconds: 5, Action: "suspend"}}); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("idle suspend on a runtime without suspend: %v", err)
	}
	sbs, _ := h.db.ListSandboxes(h.ctx(), store.SandboxFilter{})
	if len(sbs) != 0 {
		t.Fatalf("rejected creates left records: %+v", sbs)
	}
}

// TestCreateMalformedTemplateRef: a template reference that can never
// resolve is refused by Create itself (400, naming the problem) and leaves
// no sandbox behind; it used to be accepted and end in state error.
func TestCreateMalformedTemplateRef(t *testing.T) {
	h := newHarness(t)
	for ref, want := range map[string]string{
		"../../etc":     "template name",
		"Tiny:latest":   "template name",
		"tiny:a/b":      "template tag",
		"sha256:xyz":    "template digest",
		"sha256:abc123": "template digest", // a prefix needs 12 digits
	} {
		_, _, err := h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{Template: ref})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), want) {
			t.Errorf("template %q: %v, want invalid argument naming the %s", ref, err, want)
		}
	}
	sbs, err := h.db.ListSandboxes(h.ctx(), store.SandboxFilter{})
	if err != nil || len(sbs) != 0 {
		t.Fatalf("refused creates left sandboxes: %v %+v", err, sbs)
	}
}
