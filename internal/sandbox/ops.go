package sandbox

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/store"
)

// The operation engine: every lifecycle change of a sandbox runs as an
// operation whose record is persisted before it acts (pending, then running)
// and after (succeeded or failed, with its phases and their timing), under
// the sandbox's lock, so actions on one sandbox run one after another and
// actions on different sandboxes side by side. Callers wait for an
// operation through GetOperation; shutdown lets running operations finish.
//
// The engine knows nothing of sandboxes beyond their ids: what an operation
// does is the function it is given, and everything else comes in through
// the narrow dependencies below.

// opStore is what the engine needs of the store: operation records.
type opStore interface {
	PutOperation(ctx context.Context, o api.Operation) error
	GetOperation(ctx context.Context, id string) (api.Operation, error)
}

var _ opStore = (*store.DB)(nil)

// opFunc is the body of an operation; it times its steps with p.
type opFunc func(ctx context.Context, p *phases) error

// opEngine runs operations and keeps their records.
type opEngine struct {
	store opStore
	obs   Observer
	log   *slog.Logger
	// lock takes the lock of a sandbox and returns its unlock.
	lock func(sandboxID string) (unlock func())
	// audit is told of every operation that ended, with its error.
	audit func(ctx context.Context, op api.Operation, err error)

	// ended, when set, is told of every operation that ended (SetOperationDone).
	ended atomic.Pointer[func(api.Operation)]

	mu   sync.Mutex
	done map[string]chan struct{} // closed when the operation finishes

	// Operations (and the background work tracked with them) get their own
	// context so shutdown can let them finish (a half-done create would
	// otherwise end in the error state) before cancelling what is left.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// newOpEngine builds an engine; audit may be nil.
func newOpEngine(st opStore, obs Observer, log *slog.Logger, lock func(string) func(), audit func(context.Context, api.Operation, error)) *opEngine {
	if obs == nil {
		obs = nopObserver{}
	}
	if log == nil {
		log = slog.Default()
	}
	if audit == nil {
		audit = func(context.Context, api.Operation, error) {}
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &opEngine{store: st, obs: obs, log: log, lock: lock, audit: audit,
		done: map[string]chan struct{}{}, ctx: ctx, cancel: cancel}
}

func newOperation(kind, sandboxID string) api.Operation {
	return api.Operation{ID: newID("op"), Kind: kind, SandboxID: sandboxID, State: api.OpPending, Phases: []api.Phase{}, CreatedAt: time.Now().UTC()}
}

// phases records the timing of each step of an operation.
type phases struct {
	kind string
	obs  Observer
	mu   sync.Mutex
	list []api.Phase
}

func (p *phases) run(name string, fn func() error) error {
	t := time.Now()
	err := fn()
	d := time.Since(t)
	p.mu.Lock()
	p.list = append(p.list, api.Phase{Name: name, DurationMS: float64(d.Microseconds()) / 1000})
	p.mu.Unlock()
	p.obs.OperationPhase(p.kind, name, d)
	return err
}

// setDone sets (nil: clears) the function told of every operation that
// ended, after its record is stored (Manager.SetOperationDone).
func (o *opEngine) setDone(f func(api.Operation)) {
	if f == nil {
		o.ended.Store(nil)
		return
	}
	o.ended.Store(&f)
}

// start runs fn as operation op in the background, holding the sandbox's lock.
func (o *opEngine) start(op api.Operation, fn opFunc) {
	o.channel(op.ID)
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		unlock := o.lock(op.SandboxID)
		defer unlock()
		o.run(o.ctx, &op, fn)
	}()
}

// run executes fn as op; the caller holds the sandbox's lock.
func (o *opEngine) run(ctx context.Context, op *api.Operation, fn opFunc) error {
	t0 := time.Now()
	done := o.channel(op.ID)
	defer func() {
		o.mu.Lock()
		delete(o.done, op.ID)
		o.mu.Unlock()
		close(done)
	}()
	op.State = api.OpRunning
	o.put(*op)
	p := &phases{kind: op.Kind, obs: o.obs}
	err := fn(ctx, p)
	fin := time.Now().UTC()
	op.FinishedAt = &fin
	p.mu.Lock()
	op.Phases = p.list
	p.mu.Unlock()
	if op.Phases == nil {
		op.Phases = []api.Phase{}
	}
	if err != nil {
		op.State = api.OpFailed
		op.Error = &api.ErrorBody{Code: errdefs.Code(err), Message: err.Error()}
		o.log.Warn("operation failed", "op", op.ID, "kind", op.Kind, "sandbox", op.SandboxID, "err", err)
	} else {
		op.State = api.OpSucceeded
	}
	o.put(*op)
	if f := o.ended.Load(); f != nil {
		(*f)(*op)
	}
	o.obs.OperationDone(op.Kind, op.State, time.Since(t0))
	o.audit(ctx, *op, err)
	return err
}

// put persists op; a failure is logged, not returned.
func (o *opEngine) put(op api.Operation) {
	// Operation records must survive even when the request context is gone.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := o.store.PutOperation(ctx, op); err != nil {
		o.log.Error("persisting operation", "op", op.ID, "err", err)
	}
}

// get returns an operation, waiting up to wait for it to finish (a ctx
// that ends stops the wait, not the call: the record as it stands is
// returned).
func (o *opEngine) get(ctx context.Context, id string, wait time.Duration) (api.Operation, error) {
	if err := ValidID(id); err != nil {
		return api.Operation{}, err
	}
	deadline := time.Now().Add(wait)
	for {
		// Take the channel before reading the record so a finish between
		// the two cannot be missed.
		o.mu.Lock()
		done := o.done[id]
		o.mu.Unlock()
		op, err := o.store.GetOperation(ctx, id)
		left := time.Until(deadline)
		if err != nil || op.Done() || left <= 0 {
			return op, err
		}
		tick := 50 * time.Millisecond // an operation this process is not running yet
		if done != nil {
			tick = left
		}
		select {
		case <-ctx.Done():
			return op, nil
		case <-done:
		case <-time.After(min(tick, left)):
		}
	}
}

// channel registers the completion channel of an operation.
func (o *opEngine) channel(id string) chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	ch := o.done[id]
	if ch == nil {
		ch = make(chan struct{})
		o.done[id] = ch
	}
	return ch
}

// spawn runs fn in the background as work that shutdown waits for like an
// operation (warm pool fills and drains); fn should use baseCtx.
func (o *opEngine) spawn(fn func()) {
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		fn()
	}()
}

// baseCtx is the context operations run in: cancelled when shutdown's
// grace runs out.
func (o *opEngine) baseCtx() context.Context { return o.ctx }

// close waits up to grace for running operations and spawned work to
// finish, then cancels what is left and waits for it to return. It
// reports whether the grace ran out.
func (o *opEngine) close(grace time.Duration) (cancelled bool) {
	done := make(chan struct{})
	go func() { o.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		o.log.Warn("operations still running at shutdown; cancelling them (the next start re-drives creates and deletes)")
		cancelled = true
		o.cancel()
		<-done
	}
	o.cancel()
	return cancelled
}
