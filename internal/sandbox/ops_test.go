package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// The operation engine on its own: a fake store, per-sandbox mutexes for
// the lock, no runtime.

// fakeOpStore keeps operation records in memory and every write in order.
type fakeOpStore struct {
	mu     sync.Mutex
	ops    map[string]api.Operation
	writes []api.Operation
}

var _ opStore = (*fakeOpStore)(nil)

func (s *fakeOpStore) PutOperation(_ context.Context, o api.Operation) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ops == nil {
		s.ops = map[string]api.Operation{}
	}
	o.Phases = slices.Clone(o.Phases)
	s.ops[o.ID] = o
	s.writes = append(s.writes, o)
	return nil
}

func (s *fakeOpStore) GetOperation(_ context.Context, id string) (api.Operation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.ops[id]
	if !ok {
		return api.Operation{}, fmt.Errorf("operation %s: %w", id, errdefs.ErrNotFound)
	}
	return o, nil
}

// states lists the states written for operation id, in order.
func (s *fakeOpStore) states(id string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, o := range s.writes {
		if o.ID == id {
			out = append(out, o.State)
		}
	}
	return out
}

// recObserver records what the engine measures.
type recObserver struct {
	mu     sync.Mutex
	phases []string
	done   []string
}

func (o *recObserver) OperationPhase(kind, phase string, _ time.Duration) {
	o.mu.Lock()
	o.phases = append(o.phases, kind+"/"+phase)
	o.mu.Unlock()
}

func (o *recObserver) OperationDone(kind, state string, _ time.Duration) {
	o.mu.Lock()
	o.done = append(o.done, kind+"/"+state)
	o.mu.Unlock()
}

func (o *recObserver) Exec(string) {}

// opsRig is an engine over a fake store whose lock is one mutex per sandbox.
type opsRig struct {
	store *fakeOpStore
	obs   *recObserver
	eng   *opEngine

	mu      sync.Mutex
	locks   map[string]*sync.Mutex
	audited []api.Operation
	auditEr []error
}

func newOpsRig(t *testing.T) *opsRig {
	t.Helper()
	r := &opsRig{store: &fakeOpStore{}, obs: &recObserver{}, locks: map[string]*sync.Mutex{}}
	lock := func(id string) func() {
		r.mu.Lock()
		l := r.locks[id]
		if l == nil {
			l = &sync.Mutex{}
			r.locks[id] = l
		}
		r.mu.Unlock()
		l.Lock()
		return l.Unlock
	}
	audit := func(_ context.Context, op api.Operation, err error) {
		r.mu.Lock()
		r.audited = append(r.audited, op)
		r.auditEr = append(r.auditEr, err)
		r.mu.Unlock()
	}
	r.eng = newOpEngine(r.store, r.obs, slog.New(slog.NewTextHandler(io.Discard, nil)), lock, audit)
	t.Cleanup(func() { r.eng.close(5 * time.Second) })
	return r
}

// begin persists a pending operation and starts fn as it.
func (r *opsRig) begin(t *testing.T, kind, sandbox string, fn opFunc) api.Operation {
	t.Helper()
	op := newOperation(kind, sandbox)
	if err := r.store.PutOperation(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	r.eng.start(op, fn)
	return op
}

// wait returns op once done, failing the test after 5s.
func (r *opsRig) wait(t *testing.T, id string) api.Operation {
	t.Helper()
	op, err := r.eng.get(context.Background(), id, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !op.Done() {
		t.Fatalf("operation %s still %s after 5s", id, op.State)
	}
	return op
}

// blocker is an operation body that signals it started and returns when
// released (or its ctx ends, with the ctx's error).
type blocker struct {
	started chan struct{}
	release chan struct{}
}

func newBlocker() *blocker {
	return &blocker{started: make(chan struct{}), release: make(chan struct{})}
}

func (b *blocker) fn(ctx context.Context, _ *phases) error {
	close(b.started)
	select {
	case <-b.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s did not happen within 5s", what)
	}
}

func TestOpsPhasesRecordedInOrderWithDurations(t *testing.T) {
	r := newOpsRig(t)
	op := r.begin(t, api.OpStop, "sb-aaaaaa", func(_ context.Context, p *phases) error {
		for _, name := range []string{"first", "second", "third"} {
			if err := p.run(name, func() error { time.Sleep(5 * time.Millisecond); return nil }); err != nil {
				return err
			}
		}
		return nil
	})
	got := r.wait(t, op.ID)
	if got.State != api.OpSucceeded || got.Error != nil || got.FinishedAt == nil {
		t.Fatalf("operation = %+v, want succeeded with a finish time and no error", got)
	}
	if len(got.Phases) != 3 {
		t.Fatalf("phases = %+v, want 3", got.Phases)
	}
	for i, name := range []string{"first", "second", "third"} {
		if got.Phases[i].Name != name || got.Phases[i].DurationMS < 4 {
			t.Errorf("phase %d = %+v, want %s taking ≥ 4 ms", i, got.Phases[i], name)
		}
	}
	if s := r.store.states(op.ID); fmt.Sprint(s) != fmt.Sprint([]string{api.OpPending, api.OpRunning, api.OpSucceeded}) {
		t.Errorf("records written = %v, want pending, running, succeeded", s)
	}
	r.obs.mu.Lock()
	defer r.obs.mu.Unlock()
	if want := []string{"stop/first", "stop/second", "stop/third"}; fmt.Sprint(r.obs.phases) != fmt.Sprint(want) {
		t.Errorf("observed phases = %v, want %v", r.obs.phases, want)
	}
	if want := []string{"stop/succeeded"}; fmt.Sprint(r.obs.done) != fmt.Sprint(want) {
		t.Errorf("observed done = %v, want %v", r.obs.done, want)
	}
}

func TestOpsNoPhasesIsAnEmptyList(t *testing.T) {
	r := newOpsRig(t)
	op := r.begin(t, api.OpStop, "sb-aaaaaa", func(context.Context, *phases) error { return nil })
	if got := r.wait(t, op.ID); got.Phases == nil {
		t.Fatal("phases = nil, want an empty list (the API promises an array)")
	}
}

func TestOpsFailureSetsFailedWithTheErrorCode(t *testing.T) {
	r := newOpsRig(t)
	boom := fmt.Errorf("sandbox is busy: %w", errdefs.ErrConflict)
	op := r.begin(t, api.OpPause, "sb-aaaaaa", func(_ context.Context, p *phases) error {
		p.run("ok", func() error { return nil })
		return p.run("bad", func() error { return boom })
	})
	got := r.wait(t, op.ID)
	if got.State != api.OpFailed {
		t.Fatalf("state = %s, want failed", got.State)
	}
	if got.Error == nil || got.Error.Code != api.CodeConflict || got.Error.Message != boom.Error() {
		t.Fatalf("error = %+v, want code %s and message %q", got.Error, api.CodeConflict, boom)
	}
	if len(got.Phases) != 2 || got.Phases[1].Name != "bad" {
		t.Errorf("phases = %+v, want ok then bad (a failed phase is recorded too)", got.Phases)
	}
}

func TestOpsRunReturnsTheErrorAndUpdatesTheCallersRecord(t *testing.T) {
	r := newOpsRig(t)
	op := newOperation(api.OpWake, "sb-aaaaaa")
	err := r.eng.run(context.Background(), &op, func(context.Context, *phases) error { return errdefs.ErrUnavailable })
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("run = %v, want the body's error", err)
	}
	if op.State != api.OpFailed || op.Error == nil || op.Error.Code != api.CodeUnavailable {
		t.Fatalf("op after run = %+v, want failed/unavailable", op)
	}
	if stored, _ := r.store.GetOperation(context.Background(), op.ID); stored.State != api.OpFailed {
		t.Fatalf("stored state = %s, want failed", stored.State)
	}
}

func TestOpsGetOperationWaitsAndReturnsPromptlyOnFinish(t *testing.T) {
	r := newOpsRig(t)
	b := newBlocker()
	op := r.begin(t, api.OpStop, "sb-aaaaaa", b.fn)
	waitClosed(t, b.started, "the operation's start")
	type res struct {
		op  api.Operation
		err error
		at  time.Time
	}
	got := make(chan res, 1)
	go func() {
		o, err := r.eng.get(context.Background(), op.ID, 30*time.Second)
		got <- res{o, err, time.Now()}
	}()
	select {
	case g := <-got:
		t.Fatalf("get returned %+v before the operation finished", g.op)
	case <-time.After(100 * time.Millisecond):
	}
	released := time.Now()
	close(b.release)
	select {
	case g := <-got:
		if g.err != nil || g.op.State != api.OpSucceeded {
			t.Fatalf("get = %+v, %v; want succeeded", g.op, g.err)
		}
		if d := g.at.Sub(released); d > time.Second {
			t.Errorf("get returned %v after the finish, want promptly", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("get did not return within 5s of the finish")
	}
}

func TestOpsGetOperationTimesOut(t *testing.T) {
	r := newOpsRig(t)
	b := newBlocker()
	defer close(b.release)
	op := r.begin(t, api.OpStop, "sb-aaaaaa", b.fn)
	waitClosed(t, b.started, "the operation's start")
	t0 := time.Now()
	got, err := r.eng.get(context.Background(), op.ID, 150*time.Millisecond)
	d := time.Since(t0)
	if err != nil || got.State != api.OpRunning {
		t.Fatalf("get = %+v, %v; want the running record", got, err)
	}
	if d < 150*time.Millisecond || d > 2*time.Second {
		t.Errorf("get took %v, want about the 150ms wait", d)
	}
	// No wait: the record as it stands at once.
	if got, err := r.eng.get(context.Background(), op.ID, 0); err != nil || got.State != api.OpRunning {
		t.Fatalf("get without wait = %+v, %v; want running", got, err)
	}
}

func TestOpsGetOperationHonoursCtx(t *testing.T) {
	r := newOpsRig(t)
	b := newBlocker()
	defer close(b.release)
	op := r.begin(t, api.OpStop, "sb-aaaaaa", b.fn)
	waitClosed(t, b.started, "the operation's start")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	got, err := r.eng.get(ctx, op.ID, 30*time.Second)
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("get took %v after its ctx ended, want promptly", d)
	}
	if err != nil || got.State != api.OpRunning {
		t.Fatalf("get = %+v, %v; want the running record and no error", got, err)
	}
}

func TestOpsGetOperationUnknownAndMalformed(t *testing.T) {
	r := newOpsRig(t)
	if _, err := r.eng.get(context.Background(), "op-missing0", time.Second); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("unknown id: %v, want not found", err)
	}
	if _, err := r.eng.get(context.Background(), "../etc", time.Second); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("malformed id: %v, want not found", err)
	}
}

// An operation this process is not running (another server's, or one not
// started yet) is polled until its record says done.
func TestOpsGetOperationPollsARecordItDoesNotRun(t *testing.T) {
	r := newOpsRig(t)
	op := newOperation(api.OpStop, "sb-aaaaaa")
	op.State = api.OpRunning
	r.store.PutOperation(context.Background(), op)
	go func() {
		time.Sleep(100 * time.Millisecond)
		op.State = api.OpSucceeded
		r.store.PutOperation(context.Background(), op)
	}()
	got, err := r.eng.get(context.Background(), op.ID, 5*time.Second)
	if err != nil || got.State != api.OpSucceeded {
		t.Fatalf("get = %+v, %v; want succeeded", got, err)
	}
}

func TestOpsOneSandboxRunsOneAfterAnother(t *testing.T) {
	r := newOpsRig(t)
	a := newBlocker()
	opA := r.begin(t, api.OpStop, "sb-aaaaaa", a.fn)
	waitClosed(t, a.started, "the first operation's start")
	bStarted := make(chan struct{})
	opB := r.begin(t, api.OpStart, "sb-aaaaaa", func(context.Context, *phases) error { close(bStarted); return nil })
	select {
	case <-bStarted:
		t.Fatal("the second operation on the sandbox ran while the first held its lock")
	case <-time.After(150 * time.Millisecond):
	}
	if got, _ := r.store.GetOperation(context.Background(), opB.ID); got.State != api.OpPending {
		t.Errorf("the waiting operation is %s, want still pending", got.State)
	}
	close(a.release)
	waitClosed(t, bStarted, "the second operation's start after the first ended")
	r.wait(t, opA.ID)
	r.wait(t, opB.ID)
}

func TestOpsTwoSandboxesRunSideBySide(t *testing.T) {
	r := newOpsRig(t)
	a := newBlocker()
	defer close(a.release)
	r.begin(t, api.OpStop, "sb-aaaaaa", a.fn)
	waitClosed(t, a.started, "the first sandbox's operation start")
	opB := r.begin(t, api.OpStop, "sb-bbbbbb", func(context.Context, *phases) error { return nil })
	if got := r.wait(t, opB.ID); got.State != api.OpSucceeded {
		t.Fatalf("the other sandbox's operation = %s, want succeeded while the first still runs", got.State)
	}
}

func TestOpsDoneAndAuditHooksSeeTheFinalRecord(t *testing.T) {
	r := newOpsRig(t)
	var mu sync.Mutex
	var ended []api.Operation
	heard := func() []api.Operation {
		mu.Lock()
		defer mu.Unlock()
		return append([]api.Operation(nil), ended...)
	}
	r.eng.setDone(func(op api.Operation) {
		// The record is stored before the hook hears of it.
		stored, _ := r.store.GetOperation(context.Background(), op.ID)
		mu.Lock()
		ended = append(ended, op, stored)
		mu.Unlock()
	})
	op := r.begin(t, api.OpDelete, "sb-aaaaaa", func(_ context.Context, p *phases) error {
		return p.run("destroy", func() error { return errdefs.ErrUnavailable })
	})
	final := r.wait(t, op.ID)
	got := heard()
	if len(got) != 2 {
		t.Fatalf("done hook heard %d operations, want 1", len(got)/2)
	}
	for i, o := range got {
		if o.ID != op.ID || o.State != api.OpFailed || o.FinishedAt == nil || len(o.Phases) != 1 || o.Error == nil || o.Error.Code != api.CodeUnavailable {
			t.Errorf("done hook's record %d = %+v, want the final failed one", i, o)
		}
	}
	r.mu.Lock()
	audited, auditEr := append([]api.Operation(nil), r.audited...), append([]error(nil), r.auditEr...)
	r.mu.Unlock()
	if len(audited) != 1 {
		t.Fatalf("audit heard %d operations, want 1", len(audited))
	}
	if a := audited[0]; a.ID != final.ID || a.State != api.OpFailed || a.FinishedAt == nil || len(a.Phases) != 1 {
		t.Errorf("audited %+v, want the final record", a)
	}
	if !errors.Is(auditEr[0], errdefs.ErrUnavailable) {
		t.Errorf("audited error = %v, want the operation's", auditEr[0])
	}

	// Cleared, the hook hears nothing more.
	r.eng.setDone(nil)
	r.wait(t, r.begin(t, api.OpStop, "sb-aaaaaa", func(context.Context, *phases) error { return nil }).ID)
	if n := len(heard()); n != 2 {
		t.Errorf("a cleared done hook still heard an operation")
	}
}

func TestOpsCloseWaitsForARunningOperation(t *testing.T) {
	r := newOpsRig(t)
	b := newBlocker()
	op := r.begin(t, api.OpStop, "sb-aaaaaa", b.fn)
	waitClosed(t, b.started, "the operation's start")
	spawned := make(chan struct{})
	r.eng.spawn(func() { <-b.release; close(spawned) })
	closed := make(chan bool, 1)
	go func() { closed <- r.eng.close(30 * time.Second) }()
	select {
	case <-closed:
		t.Fatal("close returned while an operation ran")
	case <-time.After(150 * time.Millisecond):
	}
	close(b.release)
	select {
	case cancelled := <-closed:
		if cancelled {
			t.Error("close cancelled an operation that finished within its grace")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("close did not return within 5s of the operation's end")
	}
	waitClosed(t, spawned, "the spawned work's end before close returned")
	if got, _ := r.store.GetOperation(context.Background(), op.ID); got.State != api.OpSucceeded {
		t.Errorf("operation = %s after close, want succeeded (it was let finish)", got.State)
	}
}

func TestOpsCloseCancelsWhatOutlivesTheGrace(t *testing.T) {
	r := newOpsRig(t)
	b := newBlocker() // never released: ends only when its ctx does
	op := r.begin(t, api.OpStop, "sb-aaaaaa", b.fn)
	waitClosed(t, b.started, "the operation's start")
	t0 := time.Now()
	if !r.eng.close(100 * time.Millisecond) {
		t.Error("close = not cancelled, want cancelled after its grace")
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Errorf("close took %v", d)
	}
	got, _ := r.store.GetOperation(context.Background(), op.ID)
	if got.State != api.OpFailed || got.Error == nil {
		t.Errorf("operation = %+v after close, want failed by the cancellation", got)
	}
	if r.eng.baseCtx().Err() == nil {
		t.Error("the operations' context is still live after close")
	}
}
