package sandbox

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/store"
)

// These tests drive the manager's suspend/restore/fork state machine over
// the fake runtime's memory-less Suspender/Forker (see fakeruntime.Options):
// they prove phases, states, failures and restarts, not that memory
// survives (that is the real runtimes' end-to-end tests' job).

// writeFile writes below the sandbox's root through its agent.
func (h *harness) writeFile(id, path, content string) {
	h.t.Helper()
	c, release, err := h.m.Agent(h.ctx(), id)
	if err != nil {
		h.t.Fatal(err)
	}
	defer release()
	if dir := filepath.Dir(path); dir != "/" {
		if _, err := c.Mkdir(h.ctx(), dir, 0o755); err != nil && !errors.Is(err, errdefs.ErrConflict) {
			h.t.Fatal(err)
		}
	}
	if _, err := c.WriteFile(h.ctx(), path, 0o644, strings.NewReader(content)); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) readFile(id, path string) string {
	h.t.Helper()
	c, release, err := h.m.Agent(h.ctx(), id)
	if err != nil {
		h.t.Fatal(err)
	}
	defer release()
	r, err := c.ReadFile(h.ctx(), path)
	if err != nil {
		h.t.Fatal(err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		h.t.Fatal(err)
	}
	return string(b)
}

func (h *harness) failedVerb(id, verb string) api.Operation {
	h.t.Helper()
	op, err := h.m.verbs.Lifecycle(h.ctx(), id, verb, false)
	if err != nil {
		h.t.Fatalf("%s: %v", verb, err)
	}
	op, err = h.m.verbs.Wait(h.ctx(), op.ID)
	if err != nil || op.State != api.OpFailed || op.Error == nil {
		h.t.Fatalf("%s should have failed: %v %+v", verb, err, op)
	}
	return op
}

func (h *harness) exec(id string) {
	h.t.Helper()
	res, err := h.m.cmds.Exec(h.ctx(), id, api.ExecRequest{Cmd: []string{"echo", "up"}})
	if err != nil || res.Stdout != "up\n" {
		h.t.Fatalf("exec in %s: %v %+v", id, err, res)
	}
}

func (h *harness) imageExists(id string) bool {
	_, err := os.Stat(filepath.Join(h.dir, "fake", id, "suspended"))
	return err == nil
}

func (h *harness) ops(id, kind string) []api.Operation {
	h.t.Helper()
	all, err := h.db.ListOperations(h.ctx(), store.OperationFilter{SandboxID: id})
	if err != nil {
		h.t.Fatal(err)
	}
	var out []api.Operation
	for _, op := range all {
		if op.Kind == kind {
			out = append(out, op)
		}
	}
	return out
}

var suspendFork = fakeruntime.Options{Suspend: true, Fork: true}

func TestSuspendAndRestoreRecordPhasesAndStates(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.writeFile(id, "/kept", "disk")

	op := h.verb(id, api.OpSuspend)
	if got := phaseNames(op); got != "quiesce,checkpoint" {
		t.Fatalf("suspend phases %s", got)
	}
	if s := h.state(id); s != api.StateSuspended {
		t.Fatalf("after suspend: %s", s)
	}
	if !h.imageExists(id) {
		t.Fatal("no image after suspend")
	}
	inst, err := h.rt.Open(h.ctx(), fakeSpec(id))
	if err != nil || inst.Alive() {
		t.Fatalf("a suspended sandbox must run nothing: %v alive=%v", err, err == nil && inst.Alive())
	}
	if got := phaseNames(h.verb(id, api.OpSuspend)); got != "" {
		t.Fatalf("suspend of a suspended sandbox is a no-op, ran %s", got)
	}
	for _, verb := range []string{api.OpPause, api.OpResume} {
		if _, err := h.m.verbs.Lifecycle(h.ctx(), id, verb, false); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("%s of a suspended sandbox: %v", verb, err)
		}
	}
	if _, err := h.m.verbs.Fork(h.ctx(), id, api.ForkRequest{}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("fork of a suspended sandbox: %v", err)
	}

	op = h.verb(id, api.OpRestore)
	if got := phaseNames(op); got != "restore,agent_ready,reseed" {
		t.Fatalf("restore phases %s", got)
	}
	if s := h.state(id); s != api.StateRunning || h.imageExists(id) {
		t.Fatalf("after restore: %s, image kept %v", s, h.imageExists(id))
	}
	if got := h.readFile(id, "/kept"); got != "disk" {
		t.Fatalf("file after restore: %q", got)
	}
	if got := phaseNames(h.verb(id, api.OpRestore)); got != "" {
		t.Fatalf("restore of a running sandbox is a no-op, ran %s", got)
	}

	// From paused: thawed first, then saved.
	h.verb(id, api.OpPause)
	op = h.verb(id, api.OpSuspend)
	if got := phaseNames(op); got != "thaw,agent_ready,quiesce,checkpoint" {
		t.Fatalf("suspend of paused: phases %s", got)
	}
	// start of a suspended sandbox restores it.
	op = h.verb(id, api.OpStart)
	if got := phaseNames(op); got != "restore,agent_ready,reseed" || h.state(id) != api.StateRunning {
		t.Fatalf("start of suspended: phases %s state %s", got, h.state(id))
	}
	h.exec(id)
}

func fakeSpec(id string) runtime.Spec { return runtime.Spec{ID: id} }

func TestFailedCheckpointLeavesTheSandboxRunning(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.rt.FailNext(api.OpSuspend, errors.New("runsc: Cannot save endpoint with bound host socket"), false)
	op := h.failedVerb(id, api.OpSuspend)
	if got := phaseNames(op); got != "quiesce,checkpoint,reconnect" {
		t.Fatalf("phases %s", got)
	}
	if !strings.Contains(op.Error.Message, "Cannot save endpoint with bound host socket") || !strings.Contains(op.Error.Message, "keeps running") {
		t.Fatalf("error %+v", op.Error)
	}
	if s := h.state(id); s != api.StateRunning {
		t.Fatalf("after failed checkpoint: %s", s)
	}
	// The agent was reconnected by the operation, not by this call.
	e := h.m.peek(id)
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c == nil {
		t.Fatal("no agent client after the reconnect phase")
	}
	h.exec(id)
	// A later suspend works.
	h.verb(id, api.OpSuspend)
	h.verb(id, api.OpWake)
	h.exec(id)
}

func TestFailedRestoreKeepsSuspendedUnlessTheImageIsGone(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.verb(id, api.OpSuspend)

	h.rt.FailNext(api.OpRestore, errors.New("runsc: restore: bad image header"), false)
	op := h.failedVerb(id, api.OpRestore)
	if !strings.Contains(op.Error.Message, "bad image header") || phaseNames(op) != "restore" {
		t.Fatalf("failed restore %+v phases %s", op.Error, phaseNames(op))
	}
	if s := h.state(id); s != api.StateSuspended || !h.imageExists(id) {
		t.Fatalf("after a failed restore that kept its image: %s", s)
	}
	// The next call wakes it for real.
	h.exec(id)

	h.verb(id, api.OpSuspend)
	h.rt.FailNext(api.OpRestore, errors.New("runsc: image file vanished"), true)
	op = h.failedVerb(id, api.OpWake)
	if !strings.Contains(op.Error.Message, "image file vanished") {
		t.Fatalf("failed wake %+v", op.Error)
	}
	sb, _ := h.m.Get(h.ctx(), id)
	if sb.State != api.StateStopped || !strings.Contains(sb.Error, "image is gone") || !strings.Contains(sb.Error, "image file vanished") {
		t.Fatalf("after a restore that lost the image: %+v", sb)
	}
	// A stopped sandbox boots afresh.
	h.exec(id)
}

func TestCallsWakeASuspendedSandbox(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.verb(id, api.OpSuspend)
	h.exec(id)
	if s := h.state(id); s != api.StateRunning {
		t.Fatalf("after exec: %s", s)
	}
	wakes := h.ops(id, api.OpWake)
	if len(wakes) != 1 || wakes[0].State != api.OpSucceeded || phaseNames(wakes[0]) != "restore,agent_ready,reseed" {
		t.Fatalf("wake operations %+v", wakes)
	}
}

func TestIdleSuspendThenNextCallWakes(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	h.m.recon.Run()
	id := h.create(api.CreateSandboxRequest{Idle: &api.IdlePolicy{AfterSeconds: 1, Action: api.OpSuspend}}).ID
	deadline := time.Now().Add(15 * time.Second)
	for h.state(id) != api.StateSuspended {
		if time.Now().After(deadline) {
			t.Fatalf("idle sandbox is %s", h.state(id))
		}
		time.Sleep(50 * time.Millisecond)
	}
	sus := h.ops(id, api.OpSuspend)
	if len(sus) != 1 || sus[0].State != api.OpSucceeded {
		t.Fatalf("suspend operations %+v", sus)
	}
	h.exec(id)
	if s := h.state(id); s != api.StateRunning {
		t.Fatalf("after exec: %s", s)
	}
	if w := h.ops(id, api.OpWake); len(w) != 1 || w[0].State != api.OpSucceeded {
		t.Fatalf("wake operations %+v", w)
	}
}

func TestStopAndDeleteOfASuspendedSandbox(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.writeFile(id, "/kept", "disk")
	h.verb(id, api.OpSuspend)
	h.verb(id, api.OpStop)
	if s := h.state(id); s != api.StateStopped || h.imageExists(id) {
		t.Fatalf("stop of suspended: %s, image kept %v", s, h.imageExists(id))
	}
	op := h.verb(id, api.OpStart)
	if got := phaseNames(op); got != "start_runtime,agent_ready" {
		t.Fatalf("start after the image was discarded: %s", got)
	}
	if got := h.readFile(id, "/kept"); got != "disk" {
		t.Fatalf("disk after stop of suspended: %q", got)
	}
	h.verb(id, api.OpSuspend)
	// Nothing runs: delete needs no force.
	h.verb(id, api.OpDelete)
	if _, err := h.m.Get(h.ctx(), id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.dir, "fake", id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("resources left after delete of suspended: %v", err)
	}
}

func TestForkCreatesIndependentChildren(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	parent := h.create(api.CreateSandboxRequest{Env: map[string]string{"A": "1"}, Labels: map[string]string{"team": "x"},
		Idle: &api.IdlePolicy{AfterSeconds: 3600, Action: api.OpStop}, TTLSeconds: 3600})
	h.writeFile(parent.ID, "/etc/hostname", parent.ID+"\n")
	h.writeFile(parent.ID, "/state", "parent's")

	for _, n := range []int{-1, 17} {
		if _, err := h.m.verbs.Fork(h.ctx(), parent.ID, api.ForkRequest{Count: n}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("fork count %d: %v", n, err)
		}
	}
	op, err := h.m.verbs.Fork(h.ctx(), parent.ID, api.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(op.Children) != 2 || op.Kind != api.OpFork || op.SandboxID != parent.ID {
		t.Fatalf("fork op %+v", op)
	}
	// The child records exist at once.
	for _, cid := range op.Children {
		sb, err := h.m.Get(h.ctx(), cid)
		if err != nil || (sb.State != api.StateCreating && sb.State != api.StateRunning) {
			t.Fatalf("child record right after fork: %v %+v", err, sb)
		}
	}
	op = h.wait(op)
	if got := phaseNames(op); got != "quiesce,fork,reconnect,agent_ready,reseed,agent_ready,reseed" {
		t.Fatalf("fork phases %s", got)
	}
	if stored, _ := h.db.GetOperation(h.ctx(), op.ID); !slices.Equal(stored.Children, op.Children) {
		t.Fatalf("stored op children %v", stored.Children)
	}
	if s := h.state(parent.ID); s != api.StateRunning {
		t.Fatalf("parent after fork: %s", s)
	}
	h.exec(parent.ID)
	for _, cid := range op.Children {
		sb, _ := h.m.Get(h.ctx(), cid)
		if sb.State != api.StateRunning || sb.Labels[LabelForkOf] != parent.ID || sb.Labels["team"] != "x" ||
			sb.Env["A"] != "1" || sb.TemplateDigest != parent.TemplateDigest || sb.Runtime != parent.Runtime ||
			sb.Limits != parent.Limits || sb.Idle == nil || *sb.Idle != *parent.Idle || sb.TTLSeconds != 3600 || sb.ExpiresAt == nil {
			t.Fatalf("child %+v", sb)
		}
		if got := h.readFile(cid, "/state"); got != "parent's" {
			t.Fatalf("child's copy of the disk: %q", got)
		}
		// The reseed reached the child's agent: it took its own id as hostname.
		if got := h.readFile(cid, "/etc/hostname"); got != cid+"\n" {
			t.Fatalf("child hostname %q, want %s", got, cid)
		}
		h.exec(cid)
	}
	if parent, _ := h.m.Get(h.ctx(), parent.ID); parent.Labels[LabelForkOf] != "" {
		t.Fatalf("the parent got a fork label: %+v", parent.Labels)
	}
	// Children are independent: their disks and lifecycles are their own.
	h.writeFile(op.Children[0], "/state", "child's")
	if got := h.readFile(parent.ID, "/state"); got != "parent's" {
		t.Fatalf("parent's file after the child wrote its own: %q", got)
	}
	h.verb(op.Children[0], api.OpStop)
	h.exec(parent.ID)
	h.exec(op.Children[1])
	if kids, _ := h.m.List(h.ctx(), "", map[string]string{LabelForkOf: parent.ID}); len(kids) != 2 {
		t.Fatalf("children by label: %d", len(kids))
	}

	// A paused parent is refused, not resumed behind the caller's back.
	h.verb(parent.ID, api.OpPause)
	if _, err := h.m.verbs.Fork(h.ctx(), parent.ID, api.ForkRequest{}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("fork of paused: %v", err)
	}
}

func TestFailedForkLeavesNoChildAndTheParentRunning(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	parent := h.create(api.CreateSandboxRequest{}).ID
	h.rt.FailNext(api.OpFork, errors.New("runsc: checkpoint: something broke"), false)
	op, err := h.m.verbs.Fork(h.ctx(), parent, api.ForkRequest{Count: 3})
	if err != nil {
		t.Fatal(err)
	}
	op, err = h.m.verbs.Wait(h.ctx(), op.ID)
	if err != nil || op.State != api.OpFailed || !strings.Contains(op.Error.Message, "something broke") {
		t.Fatalf("fork %v %+v", err, op)
	}
	if got := phaseNames(op); got != "quiesce,fork,reconnect" {
		t.Fatalf("phases %s", got)
	}
	for _, cid := range op.Children {
		sb, err := h.m.Get(h.ctx(), cid)
		if err != nil || sb.State != api.StateError || !strings.Contains(sb.Error, "something broke") {
			t.Fatalf("child after failed fork: %v %+v", err, sb)
		}
		if _, err := os.Stat(filepath.Join(h.dir, "fake", cid)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("child instance left: %v", err)
		}
	}
	if s := h.state(parent); s != api.StateRunning {
		t.Fatalf("parent after failed fork: %s", s)
	}
	h.exec(parent)
}

func TestVerbsARuntimeCannotDoAreNotSupported(t *testing.T) {
	h := newHarness(t) // the fake without its optional abilities
	id := h.create(api.CreateSandboxRequest{}).ID
	for _, verb := range []string{api.OpSuspend, api.OpRestore, api.OpFork} {
		_, err := h.m.verbs.Lifecycle(h.ctx(), id, verb, false)
		if !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), "runtime fake cannot "+verb+": the fake runtime keeps no memory images") {
			t.Errorf("%s: %v", verb, err)
		}
	}
	if _, err := h.m.verbs.Fork(h.ctx(), id, api.ForkRequest{Count: 2}); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("fork: %v", err)
	}
	if sbs, _ := h.m.List(h.ctx(), "", nil); len(sbs) != 1 {
		t.Fatalf("a refused fork left records: %d sandboxes", len(sbs))
	}
}

func TestRestartKeepsSuspendedSandboxesAndRestoresThem(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	id := h.create(api.CreateSandboxRequest{}).ID
	h.writeFile(id, "/kept", "disk")
	h.verb(id, api.OpSuspend)
	// A second sandbox whose server died between a finished checkpoint and
	// recording it: its record still says running, with an op in flight.
	mid := h.create(api.CreateSandboxRequest{}).ID
	h.verb(mid, api.OpSuspend)
	sb, _ := h.db.GetSandbox(h.ctx(), mid)
	sb.State = api.StateRunning
	h.db.PutSandbox(h.ctx(), sb)
	stale := newOperation(api.OpSuspend, mid)
	stale.State = api.OpRunning
	h.db.PutOperation(h.ctx(), stale)

	// A suspended sandbox whose image vanished while the server was down.
	lost := h.create(api.CreateSandboxRequest{}).ID
	h.verb(lost, api.OpSuspend)
	if err := os.Remove(filepath.Join(h.dir, "fake", lost, "suspended")); err != nil {
		t.Fatal(err)
	}
	// A fork child whose fork was cut off: its record says creating and an
	// instance of it exists.
	parent := h.create(api.CreateSandboxRequest{}).ID
	forkOp, err := h.m.verbs.Fork(h.ctx(), parent, api.ForkRequest{})
	if err != nil {
		t.Fatal(err)
	}
	h.wait(forkOp)
	child := forkOp.Children[0]
	sb, _ = h.db.GetSandbox(h.ctx(), child)
	sb.State = api.StateCreating
	h.db.PutSandbox(h.ctx(), sb)
	forkOp.State, forkOp.FinishedAt = api.OpRunning, nil
	h.db.PutOperation(h.ctx(), forkOp)

	h.m.Close()
	h.m = h.manager()
	if err := h.m.recon.Reconcile(h.ctx()); err != nil {
		t.Fatal(err)
	}
	if sb, _ := h.m.Get(h.ctx(), lost); sb.State != api.StateStopped || !strings.Contains(sb.Error, "suspended image was gone") {
		t.Fatalf("suspended sandbox without its image after a restart: %+v", sb)
	}
	h.exec(lost)
	if sb, _ := h.m.Get(h.ctx(), child); sb.State != api.StateError || !strings.Contains(sb.Error, "fork that created this sandbox was interrupted") {
		t.Fatalf("child of an interrupted fork: %+v", sb)
	}
	if _, err := os.Stat(filepath.Join(h.dir, "fake", child)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the interrupted child's instance was kept: %v", err)
	}
	if got, _ := h.db.GetOperation(h.ctx(), forkOp.ID); got.State != api.OpFailed || got.Error.Code != "interrupted" || len(got.Children) != 1 {
		t.Fatalf("interrupted fork %+v", got)
	}
	h.exec(parent)
	for _, x := range []string{id, mid} {
		if s := h.state(x); s != api.StateSuspended {
			t.Fatalf("%s after restart: %s", x, s)
		}
		inst, err := h.rt.Open(h.ctx(), fakeSpec(x))
		if err != nil || inst.Alive() {
			t.Fatalf("a suspended sandbox runs something after a restart")
		}
	}
	got, _ := h.db.GetOperation(h.ctx(), stale.ID)
	if got.State != api.OpFailed || got.Error == nil || got.Error.Code != "interrupted" {
		t.Fatalf("interrupted suspend %+v", got)
	}
	op := h.verb(id, api.OpRestore)
	if got := phaseNames(op); got != "restore,agent_ready,reseed" {
		t.Fatalf("restore after restart: %s", got)
	}
	if got := h.readFile(id, "/kept"); got != "disk" {
		t.Fatalf("file after restart and restore: %q", got)
	}
	h.exec(mid)
}
