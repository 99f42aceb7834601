package sandbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/store"
)

// Reconcile makes the host match the store after a (possibly unclean) start:
// every recorded sandbox is re-adopted, restarted or cleaned, interrupted
// operations are finished or failed, and every host resource that no record
// owns is swept. It is safe to run at any time.
func (part *Reconciler) Reconcile(ctx context.Context) error {
	m := part.m
	if err := m.pools.load(ctx); err != nil {
		return err
	}
	sbs, err := m.cfg.DB.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		return err
	}
	known := map[string]bool{}
	for _, sb := range sbs {
		known[sb.ID] = true
	}
	// Interrupted operations: create and delete are re-driven (their intent is
	// persisted); anything else is failed with a clear reason.
	ops, err := m.cfg.DB.ListOperations(ctx, store.OperationFilter{Unfinished: true})
	if err != nil {
		return err
	}
	redrive := map[string]api.Operation{}
	for _, op := range ops {
		if known[op.SandboxID] && (op.Kind == api.OpCreate || op.Kind == api.OpDelete) {
			redrive[op.SandboxID] = op
			continue
		}
		fin := time.Now().UTC()
		op.State, op.FinishedAt = api.OpFailed, &fin
		op.Error = &api.ErrorBody{Code: "interrupted", Message: "the server restarted while this operation ran; retry it"}
		m.ops.put(op)
	}
	for _, sb := range sbs {
		if isPoolMember(sb) {
			m.pools.reconcileMember(ctx, sb)
			continue
		}
		m.recon.reconcileOne(ctx, sb, redrive)
	}
	m.recon.sweep(ctx)
	m.net.reconcileNetwork(ctx)
	return nil
}

// sweep asks every available runtime to remove host resources that no
// sandbox record owns.
func (part *Reconciler) sweep(ctx context.Context) {
	m := part.m
	for name, rt := range m.cfg.Runtimes {
		if !rt.Probe(ctx).Available {
			continue
		}
		removed, err := rt.Sweep(ctx, func(id string) bool { return m.recon.stillKnown(ctx, id) })
		if err != nil {
			m.log.Warn("sweep failed", "runtime", name, "err", err)
		}
		for _, id := range removed {
			m.log.Info("swept host resources no record owns", "runtime", name, "sandbox", id)
		}
	}
}

func (part *Reconciler) stillKnown(ctx context.Context, id string) bool {
	m := part.m
	_, err := m.cfg.DB.GetSandbox(ctx, id)
	return !errors.Is(err, errdefs.ErrNotFound)
}

func (part *Reconciler) reconcileOne(ctx context.Context, sb api.Sandbox, redrive map[string]api.Operation) {
	m := part.m
	e := m.entry(sb.ID)
	if !sb.LastActiveAt.IsZero() {
		e.lastActive.Store(sb.LastActiveAt.UnixNano())
	}
	log := m.log.With("sandbox", sb.ID, "state", sb.State)
	if op, ok := redrive[sb.ID]; ok {
		switch op.Kind {
		case api.OpCreate:
			// Throw away whatever the crashed create left, then create again.
			if inst, _, err := m.verbs.instance(ctx, e, sb); err == nil {
				e.expectExit.Store(true)
				m.verbs.destroyInstance(ctx, inst, "re-driven create")
			}
			e.cmu.Lock()
			e.inst = nil
			e.cmu.Unlock()
			m.setState(sb.ID, api.StateCreating, "", op.ID)
			log.Info("re-driving interrupted create", "op", op.ID)
			m.ops.start(op, func(ctx context.Context, p *phases) error { return m.creates.doCreate(ctx, p, sb.ID, true, nil) })
		case api.OpDelete:
			log.Info("re-driving interrupted delete", "op", op.ID)
			m.ops.start(op, func(ctx context.Context, p *phases) error { return m.verbs.doDelete(ctx, p, sb.ID) })
		}
		return
	}
	switch sb.State {
	case api.StateRunning, api.StatePaused, api.StateStarting, api.StateStopping, api.StateSuspended:
		inst, _, err := m.verbs.instance(ctx, e, sb)
		if err != nil {
			log.Warn("cannot re-open sandbox", "err", err)
			m.setState(sb.ID, api.StateError, "re-open after restart failed: "+err.Error(), "")
			return
		}
		// A saved image with nothing running is a suspended sandbox,
		// whatever the record says (a suspend finished, or a restore had
		// not begun, when the server went down). No process is expected.
		if sp, ok := inst.(runtime.Suspender); ok && sb.State != api.StateStopping && !inst.Alive() && sp.Suspended() {
			if sb.State != api.StateSuspended {
				m.setState(sb.ID, api.StateSuspended, "", "")
			}
			log.Info("sandbox is suspended")
			return
		}
		if sb.State == api.StateStopping || !inst.Alive() {
			e.expectExit.Store(true)
			m.verbs.stopInstance(ctx, inst, "reconcile of a dead sandbox")
			m.cmds.markCommandsExited(sb.ID, "the sandbox's processes ended while the server was down")
			note := ""
			switch sb.State {
			case api.StateStopping:
			case api.StateSuspended:
				note = "the suspended image was gone after a server restart; its disk is kept and the next request starts it afresh"
			default:
				note = "the sandbox's processes were gone after a server restart; its disk is kept and the next request starts it"
			}
			m.setState(sb.ID, api.StateStopped, note, "")
			log.Info("sandbox not alive after restart; marked stopped")
			return
		}
		if sb.State == api.StatePaused {
			m.creates.watchExit(e, inst)
			log.Info("re-adopted paused sandbox")
			return
		}
		if err := m.creates.connect(ctx, e, inst); err != nil {
			log.Warn("re-adopted sandbox but its agent does not answer; stopping it", "err", err)
			e.expectExit.Store(true)
			m.verbs.stopInstance(ctx, inst, "reconcile of an unanswering agent")
			m.cmds.markCommandsExited(sb.ID, "the sandbox's agent stopped answering")
			m.setState(sb.ID, api.StateStopped, "agent did not answer after a server restart: "+err.Error(), "")
			return
		}
		m.creates.watchExit(e, inst)
		m.setState(sb.ID, api.StateRunning, "", "")
		log.Info("re-adopted running sandbox")
	case api.StateCreating:
		// A fork child whose fork was interrupted, or a create whose
		// operation record is missing: nothing to re-drive. Whatever
		// instance it got is thrown away; the record says why.
		msg := "create was interrupted and its operation is missing"
		if sb.Labels[LabelForkOf] != "" {
			msg = "the fork that created this sandbox was interrupted by a server restart"
		}
		if inst, _, err := m.verbs.instance(ctx, e, sb); err == nil {
			e.expectExit.Store(true)
			m.verbs.destroyInstance(ctx, inst, "interrupted create")
			e.cmu.Lock()
			e.inst = nil
			e.cmu.Unlock()
		}
		m.setState(sb.ID, api.StateError, msg, "")
	case api.StateDeleting:
		op := newOperation(api.OpDelete, sb.ID)
		m.ops.put(op)
		m.ops.start(op, func(ctx context.Context, p *phases) error { return m.verbs.doDelete(ctx, p, sb.ID) })
	}
}

// Run applies TTLs and idle policies, persists activity, re-attaches
// network links a restarted gateway lost, and re-sweeps host resources
// periodically, until the manager is closed.
func (part *Reconciler) Run() {
	m := part.m
	m.pools.run()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		lastSweep, lastNet := time.Now(), time.Now()
		for {
			select {
			case <-m.ctx.Done():
				return
			case <-tick.C:
			case <-m.netKick:
				// A new gateway: give the running sandboxes their links
				// back now rather than at the next round.
				lastNet = time.Now()
				m.net.reconcileNetwork(m.ctx)
				continue
			}
			m.recon.tick(m.ctx)
			if time.Since(lastNet) >= netReconcileEvery {
				lastNet = time.Now()
				m.net.reconcileNetwork(m.ctx)
			}
			if time.Since(lastSweep) > time.Minute {
				lastSweep = time.Now()
				m.recon.sweep(m.ctx)
			}
		}
	}()
}

func (part *Reconciler) tick(ctx context.Context) {
	m := part.m
	sbs, err := m.cfg.DB.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		return
	}
	now := time.Now()
	for _, sb := range sbs {
		if sb.ExpiresAt != nil && now.After(*sb.ExpiresAt) && sb.State != api.StateDeleting {
			m.verbs.expire(ctx, sb)
			continue
		}
		if sb.Idle == nil || sb.State != api.StateRunning {
			continue
		}
		e := m.peek(sb.ID)
		if e == nil || e.active.Load() > 0 || !e.mu.TryLock() {
			continue
		}
		e.mu.Unlock()
		idleFor := now.Sub(time.Unix(0, e.lastActive.Load()))
		if idleFor < time.Duration(sb.Idle.AfterSeconds)*time.Second {
			continue
		}
		m.log.Info("sandbox idle; applying idle policy", "sandbox", sb.ID, "action", sb.Idle.Action, "idle_for", idleFor.Round(time.Second))
		after := time.Duration(sb.Idle.AfterSeconds) * time.Second
		// A request may arrive between this check and the operation taking
		// the sandbox's lock: a pause or suspend would then cut it off (a
		// suspend quiesces the agent). The operation checks again.
		m.verbs.lifecycle(ctx, sb.ID, sb.Idle.Action, false, false, func() error {
			if e.active.Load() > 0 || time.Since(time.Unix(0, e.lastActive.Load())) < after {
				return fmt.Errorf("sandbox %s became active; idle %s skipped: %w", sb.ID, sb.Idle.Action, errdefs.ErrConflict)
			}
			return nil
		})
	}
}
