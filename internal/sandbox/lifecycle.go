package sandbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

func wrongState(id, state, verb string) error {
	return fmt.Errorf("sandbox %s is %s; cannot %s it: %w", id, state, verb, errdefs.ErrConflict)
}

// instance returns the runtime instance of sb, re-opening it if this server
// has not touched it yet (e.g. after a restart).
func (part *Verbs) instance(ctx context.Context, e *entry, sb api.Sandbox) (runtime.Instance, runtime.Runtime, error) {
	m := part.m
	spec, rt, err := m.creates.spec(ctx, sb)
	if err != nil {
		return nil, rt, err
	}
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	if inst != nil {
		return inst, rt, nil
	}
	inst, err = rt.Open(ctx, spec)
	if err != nil {
		return nil, rt, err
	}
	e.cmu.Lock()
	e.inst = inst
	e.cmu.Unlock()
	return inst, rt, nil
}

func (part *Verbs) dropClient(e *entry) {
	e.cmu.Lock()
	if e.client != nil {
		e.client.Close()
		e.client = nil
	}
	e.cmu.Unlock()
}

// Lifecycle requests a verb (api.Op*) on a sandbox and returns its
// operation. It is the entry of every front door (REST, E2B, a cluster
// node's reconciler): the temporal policy decides the verb, after the
// checks that refuse it anyway and before anything happens.
func (part *Verbs) Lifecycle(ctx context.Context, id, verb string, force bool) (api.Operation, error) {
	m := part.m
	return m.verbs.lifecycle(ctx, id, verb, force, true, nil)
}

// systemLifecycle is Lifecycle for the platform's own housekeeping
// (deadlines, rollbacks, build steps, snapshots): not decided, so a
// tenant's rule cannot keep the platform from cleaning up.
func (part *Verbs) systemLifecycle(ctx context.Context, id, verb string, force bool) (api.Operation, error) {
	m := part.m
	return m.verbs.lifecycle(ctx, id, verb, force, false, nil)
}

// Discard force-deletes sandbox id as the platform's own cleanup — what is
// left of a create that failed, a cluster node's orphan or stale copy —
// which no tenant's rule decides. A caller's delete goes through Lifecycle.
func (part *Verbs) Discard(ctx context.Context, id string) (api.Operation, error) {
	m := part.m
	return m.verbs.systemLifecycle(ctx, id, api.OpDelete, true)
}

// lifecycle is Lifecycle, decided or not, with an optional guard the
// operation runs first, under the sandbox's lock; a guard error fails the
// operation untouched.
func (part *Verbs) lifecycle(ctx context.Context, id, verb string, force, decide bool, guard func() error) (api.Operation, error) {
	m := part.m
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.Operation{}, err
	}
	var fn func(ctx context.Context, p *phases) error
	switch verb {
	case api.OpDelete:
		if !force {
			switch sb.State {
			case api.StateStopped, api.StateSuspended, api.StateError:
			default:
				return api.Operation{}, fmt.Errorf("sandbox %s is %s; stop it first or delete with force: %w", id, sb.State, errdefs.ErrConflict)
			}
		}
		fn = func(ctx context.Context, p *phases) error { return m.verbs.doDelete(ctx, p, id) }
	case api.OpStop, api.OpStart, api.OpPause, api.OpResume, api.OpWake:
		if err := m.verbs.checkVerb(sb, verb); err != nil {
			return api.Operation{}, err
		}
		fn = func(ctx context.Context, p *phases) error { return m.verbs.doVerb(ctx, p, id, verb) }
	case api.OpSuspend:
		if err := m.verbs.checkVerb(sb, verb); err != nil {
			return api.Operation{}, err
		}
		fn = func(ctx context.Context, p *phases) error { return m.verbs.doSuspend(ctx, p, id) }
	case api.OpRestore:
		if err := m.verbs.checkVerb(sb, verb); err != nil {
			return api.Operation{}, err
		}
		fn = func(ctx context.Context, p *phases) error { return m.verbs.doVerb(ctx, p, id, api.OpRestore) }
	case api.OpFork:
		return m.verbs.forkAndTell(ctx, id, api.ForkRequest{Count: 1}, decide)
	default:
		return api.Operation{}, invalid("unknown lifecycle verb %q", truncate(verb, 32))
	}
	if decide {
		if err := m.decide(ctx, sb, actions.Action{Kind: actions.Lifecycle, Verb: verb}); err != nil {
			return api.Operation{}, err
		}
	}
	if guard != nil {
		do := fn
		fn = func(ctx context.Context, p *phases) error {
			if err := guard(); err != nil {
				return err
			}
			return do(ctx, p)
		}
	}
	op := newOperation(verb, id)
	if err := m.cfg.DB.PutOperation(ctx, op); err != nil {
		return op, err
	}
	m.aud.noteCaller(ctx, op.ID, sb.Tenant)
	m.ops.start(op, fn)
	return op, nil
}

// checkVerb rejects verbs that make no sense in the sandbox's current state,
// synchronously, so the caller gets a 409 instead of a failed operation.
func (part *Verbs) checkVerb(sb api.Sandbox, verb string) error {
	m := part.m
	ok := false
	switch verb {
	case api.OpStop:
		ok = sb.State == api.StateRunning || sb.State == api.StatePaused || sb.State == api.StateStopped || sb.State == api.StateSuspended
	case api.OpStart:
		ok = sb.State == api.StateStopped || sb.State == api.StateRunning || sb.State == api.StateSuspended
	case api.OpSuspend:
		// What the runtime cannot do at all is said first, whatever the state.
		if err := m.verbs.verbSupported(sb, verb); err != nil {
			return err
		}
		ok = sb.State == api.StateRunning || sb.State == api.StatePaused || sb.State == api.StateSuspended
	case api.OpRestore:
		if err := m.verbs.verbSupported(sb, verb); err != nil {
			return err
		}
		ok = sb.State == api.StateSuspended || sb.State == api.StateRunning
	case api.OpPause:
		ok = sb.State == api.StateRunning || sb.State == api.StatePaused
		if ok {
			if err := m.verbs.verbSupported(sb, verb); err != nil {
				return err
			}
		}
	case api.OpResume:
		ok = sb.State == api.StatePaused || sb.State == api.StateRunning
	case api.OpWake:
		ok = sb.State == api.StatePaused || sb.State == api.StateStopped || sb.State == api.StateRunning || sb.State == api.StateSuspended
	}
	if !ok {
		return wrongState(sb.ID, sb.State, verb)
	}
	return nil
}

func (part *Verbs) verbSupported(sb api.Sandbox, verb string) error {
	m := part.m
	rt, err := m.runtimeOf(sb)
	if err != nil {
		return err
	}
	c := rt.Probe(context.Background())
	if !c.Verbs[verb] {
		return runtime.NotSupported(sb.Runtime, verb, c.VerbReasons[verb])
	}
	return nil
}

// doVerb runs stop/start/pause/resume/wake/restore; the caller holds e.mu.
func (part *Verbs) doVerb(ctx context.Context, p *phases, id, verb string) error {
	m := part.m
	e := m.entry(id)
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	if verb == api.OpWake {
		switch sb.State {
		case api.StateRunning:
			return nil
		case api.StatePaused:
			verb = api.OpResume
		case api.StateStopped:
			verb = api.OpStart
		case api.StateSuspended:
			verb = api.OpRestore
		default:
			return wrongState(id, sb.State, "wake")
		}
	}
	if verb == api.OpStart && sb.State == api.StateSuspended {
		verb = api.OpRestore
	}
	// Re-check under the lock: another operation may have run meanwhile.
	if err := m.verbs.checkVerb(sb, verb); err != nil {
		return err
	}
	inst, _, err := m.verbs.instance(ctx, e, sb)
	if err != nil {
		return err
	}
	switch verb {
	case api.OpRestore:
		if sb.State == api.StateRunning {
			return nil
		}
		return m.verbs.doRestore(ctx, p, e, sb)
	case api.OpStop:
		if sb.State == api.StateStopped {
			return nil
		}
		m.setState(id, api.StateStopping, "", "")
		e.expectExit.Store(true)
		m.verbs.dropClient(e)
		m.net.detachNetwork(id, "stop")
		// Stopping a suspended instance discards its saved image.
		if err := p.run("stop_runtime", func() error { return inst.Stop(ctx) }); err != nil {
			m.setState(id, api.StateError, err.Error(), "")
			return err
		}
		if sp, ok := inst.(runtime.Suspender); ok && sp.Suspended() {
			// The runtime broke its contract; the record says what is
			// true: nothing runs and the image is there.
			err := fmt.Errorf("runtime %s kept the saved image of sandbox %s after a stop (a runtime bug); it stays suspended", sb.Runtime, id)
			m.setState(id, api.StateSuspended, err.Error(), "")
			return err
		}
		m.cmds.markCommandsExited(id, "the sandbox was stopped")
		_, err = m.setState(id, api.StateStopped, "", "")
		return err
	case api.OpStart:
		if sb.State == api.StateRunning {
			return nil
		}
		m.setState(id, api.StateStarting, "", "")
		if err := m.creates.boot(ctx, p, e, inst); err != nil {
			e.expectExit.Store(true)
			m.verbs.stopInstance(context.Background(), inst, "failed start")
			m.setState(id, api.StateStopped, err.Error(), "")
			return err
		}
		e.lastActive.Store(time.Now().UnixNano())
		_, err = m.setState(id, api.StateRunning, "", "")
		return err
	case api.OpPause:
		if sb.State == api.StatePaused {
			return nil
		}
		pz, err := pauser(sb, inst)
		if err != nil {
			return err
		}
		m.verbs.dropClient(e)
		if err := p.run("freeze", func() error { return pz.Pause(ctx) }); err != nil {
			return err
		}
		_, err = m.setState(id, api.StatePaused, "", "")
		return err
	case api.OpResume:
		if sb.State == api.StateRunning {
			return nil
		}
		pz, err := pauser(sb, inst)
		if err != nil {
			return err
		}
		if err := p.run("thaw", func() error { return pz.Resume(ctx) }); err != nil {
			return err
		}
		if err := p.run("agent_ready", func() error { return m.creates.connect(ctx, e, inst) }); err != nil {
			return err
		}
		e.lastActive.Store(time.Now().UnixNano())
		_, err = m.setState(id, api.StateRunning, "", "")
		return err
	}
	return invalid("unknown verb %q", verb)
}

func (part *Verbs) doDelete(ctx context.Context, p *phases, id string) error {
	m := part.m
	e := m.entry(id)
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	m.setState(id, api.StateDeleting, "", "")
	e.expectExit.Store(true)
	m.verbs.dropClient(e)
	m.net.detachNetwork(id, "delete")
	if err := p.run("destroy", func() error {
		inst, rt, err := m.verbs.instance(ctx, e, sb)
		if err != nil {
			// The template may be gone; the runtime can still sweep the id.
			if rt != nil {
				_, serr := rt.Sweep(ctx, func(x string) bool { return x != id })
				return serr
			}
			return err
		}
		return inst.Destroy(ctx)
	}); err != nil {
		m.setState(id, api.StateError, "delete failed: "+err.Error(), "")
		return err
	}
	if err := m.cfg.DB.DeleteSandbox(ctx, id); err != nil {
		return err
	}
	m.secrets.forgetSecrets(id)
	m.forget(id)
	m.forgetPolicy(id)
	return nil
}

// Wait blocks until the operation finishes or ctx ends.
func (part *Verbs) Wait(ctx context.Context, opID string) (api.Operation, error) {
	m := part.m
	for {
		op, err := m.GetOperation(ctx, opID, 30*time.Second)
		if err != nil || op.Done() {
			return op, err
		}
		if ctx.Err() != nil {
			return op, ctx.Err()
		}
	}
}

// ensureRunning returns the live entry of a sandbox, its client and the
// record it found running, waking it transparently when it is paused or
// stopped, and waiting out transitional states.
func (part *Verbs) ensureRunning(ctx context.Context, id string) (*entry, *agentClient, api.Sandbox, error) {
	m := part.m
	if err := ValidID(id); err != nil {
		return nil, nil, api.Sandbox{}, err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		sb, err := m.Get(ctx, id)
		if err != nil {
			return nil, nil, api.Sandbox{}, err
		}
		e := m.entry(id)
		switch sb.State {
		case api.StateRunning:
			e.cmu.RLock()
			c := e.client
			e.cmu.RUnlock()
			if c != nil {
				select {
				case <-c.Done():
				default:
					e.lastActive.Store(time.Now().UnixNano())
					return e, c, sb, nil
				}
			}
			// Running but no client: re-dial (after a restart or a dropped
			// stream). An operation (a suspend) may hold the lock and
			// change the state meanwhile: re-read it under the lock.
			e.mu.Lock()
			cur, err := m.cfg.DB.GetSandbox(ctx, id)
			if err == nil && cur.State == api.StateRunning {
				err = m.verbs.redial(ctx, e, cur)
			}
			e.mu.Unlock()
			if err != nil {
				return nil, nil, api.Sandbox{}, err
			}
			continue
		case api.StatePaused, api.StateStopped, api.StateSuspended:
			op := newOperation(api.OpWake, id)
			if err := m.cfg.DB.PutOperation(ctx, op); err != nil {
				return nil, nil, api.Sandbox{}, err
			}
			e.mu.Lock()
			err := m.ops.run(ctx, &op, func(ctx context.Context, p *phases) error { return m.verbs.doVerb(ctx, p, id, api.OpWake) })
			e.mu.Unlock()
			if err != nil {
				return nil, nil, api.Sandbox{}, fmt.Errorf("waking sandbox %s: %w", id, err)
			}
			continue
		case api.StateCreating, api.StateStarting, api.StateStopping:
			if time.Now().After(deadline) {
				return nil, nil, api.Sandbox{}, fmt.Errorf("sandbox %s stayed %s for too long: %w", id, sb.State, errdefs.ErrConflict)
			}
			select {
			case <-ctx.Done():
				return nil, nil, api.Sandbox{}, ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
			continue
		default:
			msg := ""
			if sb.Error != "" {
				msg = " (" + sb.Error + ")"
			}
			return nil, nil, api.Sandbox{}, fmt.Errorf("sandbox %s is %s%s: %w", id, sb.State, msg, errdefs.ErrConflict)
		}
	}
}

func (part *Verbs) redial(ctx context.Context, e *entry, sb api.Sandbox) error {
	m := part.m
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c != nil {
		select {
		case <-c.Done():
		default:
			return nil
		}
	}
	inst, _, err := m.verbs.instance(ctx, e, sb)
	if err != nil {
		return err
	}
	if !inst.Alive() {
		return fmt.Errorf("sandbox %s is not alive: %w", sb.ID, errdefs.ErrUnavailable)
	}
	return m.creates.connect(ctx, e, inst)
}

func pauser(sb api.Sandbox, inst runtime.Instance) (runtime.Pauser, error) {
	pz, ok := inst.(runtime.Pauser)
	if !ok {
		return nil, runtime.NotSupported(sb.Runtime, "pause", "the runtime has no pause support")
	}
	return pz, nil
}
