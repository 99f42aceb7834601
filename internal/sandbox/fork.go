package sandbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
)

// Fork limits and the label that ties a child to its parent.
const (
	MaxForkCount = api.MaxForkCount
	// forkReadyParallel bounds how many children are dialled and reseeded
	// at once.
	forkReadyParallel = 4
	// LabelForkOf is set on every fork child to its parent's id.
	LabelForkOf = api.LabelForkOf
)

// Fork clones a running sandbox into req.Count (default 1, at most
// MaxForkCount) new sandboxes. The child records exist (state creating)
// when Fork returns; their ids are in the operation's Children. A paused or
// suspended parent is refused (wake it first): forking must not change the
// parent's state. The temporal policy decides it (lifecycle verb fork)
// before any child exists.
func (part *Verbs) Fork(ctx context.Context, id string, req api.ForkRequest) (api.Operation, error) {
	m := part.m
	return m.verbs.forkAndTell(ctx, id, req, true)
}

// forkAndTell is Fork, decided or not (a snapshot's own fork is not).
func (part *Verbs) forkAndTell(ctx context.Context, id string, req api.ForkRequest, decide bool) (api.Operation, error) {
	m := part.m
	op, err := m.verbs.fork(ctx, id, req, decide)
	if err != nil || m.created.Load() == nil {
		return op, err
	}
	var errs []error
	for _, child := range op.Children {
		sb, err := m.Get(principal.With(ctx, principal.System), child)
		if err != nil {
			continue // already gone (the fork failed): nothing to record
		}
		req := api.CreateSandboxRequest{Template: sb.Template, Runtime: sb.Runtime, Labels: sb.Labels, Limits: sb.Limits}
		if err := m.creates.tellCreated(ctx, sb, op, req); err != nil {
			errs = append(errs, fmt.Errorf("fork child %s: %w", child, err))
		}
	}
	return op, errors.Join(errs...)
}

func (part *Verbs) fork(ctx context.Context, id string, req api.ForkRequest, decide bool) (api.Operation, error) {
	m := part.m
	if req.Count == 0 {
		req.Count = 1
	}
	if req.Count < 1 || req.Count > MaxForkCount {
		return api.Operation{}, invalid("count must be between 1 and %d, got %d", MaxForkCount, req.Count)
	}
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.Operation{}, err
	}
	if err := m.verbs.verbSupported(sb, api.OpFork); err != nil {
		return api.Operation{}, err
	}
	if sb.State != api.StateRunning {
		return api.Operation{}, fmt.Errorf("sandbox %s is %s; only a running sandbox can be forked (wake it first): %w", id, sb.State, errdefs.ErrConflict)
	}
	if sb.Network != nil {
		// The boundary may have narrowed since the parent's policy was set.
		if err := m.tenancy.bound(ctx, TenantOf(sb), *sb.Network); err != nil {
			return api.Operation{}, err
		}
	}
	if decide {
		if err := m.decide(ctx, sb, actions.Action{Kind: actions.Lifecycle, Verb: api.OpFork}); err != nil {
			return api.Operation{}, err
		}
	}
	op := newOperation(api.OpFork, id)
	now := time.Now().UTC()
	var kids []*entry
	// The children count against the parent's tenant's quotas, all or
	// none. Checked before any child record exists; the lock covers the
	// inserts below.
	add := make([]api.Limits, req.Count)
	for i := range add {
		add[i] = sb.Limits
	}
	release, err := m.tenancy.admit(ctx, TenantOf(sb), add...)
	if err != nil {
		return api.Operation{}, err
	}
	defer release()
	for range req.Count {
		child := api.Sandbox{
			ID: newID("sb"), Tenant: sb.Tenant, State: api.StateCreating, Runtime: sb.Runtime, Isolation: sb.Isolation,
			Template: sb.Template, TemplateDigest: sb.TemplateDigest, Limits: sb.Limits,
			Env: maps.Clone(sb.Env), Workdir: sb.Workdir, User: sb.User, Labels: maps.Clone(sb.Labels),
			TTLSeconds: sb.TTLSeconds, OnExpiry: sb.OnExpiry, AllPortsPublic: sb.AllPortsPublic, Idle: sb.Idle, CreatedAt: now, UpdatedAt: now, LastActiveAt: now,
			OperationID: op.ID,
		}
		if sb.Network != nil {
			// Children inherit the parent's policy, as they do its disk.
			pol := ClonePolicy(*sb.Network)
			child.Network = &pol
		}
		if child.Labels == nil {
			child.Labels = map[string]string{}
		}
		child.Labels[LabelForkOf] = id
		if err := m.secrets.forkSecrets(ctx, sb, &child); err != nil {
			m.verbs.abandonChildren(kids, op.Children, err)
			return api.Operation{}, err
		}
		if sb.Idle != nil {
			idle := *sb.Idle
			child.Idle = &idle
		}
		if sb.TTLSeconds > 0 {
			exp := now.Add(time.Duration(sb.TTLSeconds) * time.Second)
			child.ExpiresAt = &exp
		}
		// The child is locked before anyone can see it, so nothing (a
		// forced delete, a wake) acts on it before the fork settles it.
		ce := m.entry(child.ID)
		ce.mu.Lock()
		kids = append(kids, ce)
		if err := m.cfg.DB.PutSandbox(ctx, child); err != nil {
			m.verbs.abandonChildren(kids, op.Children, err)
			return api.Operation{}, err
		}
		op.Children = append(op.Children, child.ID)
	}
	if err := m.cfg.DB.PutOperation(ctx, op); err != nil {
		m.verbs.abandonChildren(kids, op.Children, err)
		return api.Operation{}, err
	}
	children := op.Children
	m.aud.noteCaller(ctx, op.ID, sb.Tenant)
	m.ops.start(op, func(ctx context.Context, p *phases) error {
		defer func() {
			for _, ce := range kids {
				ce.mu.Unlock()
			}
		}()
		return m.verbs.doFork(ctx, p, id, children)
	})
	return op, nil
}

// abandonChildren undoes a Fork that failed before its operation started.
func (part *Verbs) abandonChildren(kids []*entry, ids []string, cause error) {
	m := part.m
	for _, id := range ids {
		m.setState(id, api.StateError, "fork failed: "+cause.Error(), "")
	}
	for _, ce := range kids {
		ce.mu.Unlock()
	}
}

// doFork runs a fork operation; the caller holds the parent's and every
// child's entry lock. All or nothing: on any error every child instance is
// destroyed and every child record is left in the error state with the
// reason, and the parent keeps running.
func (part *Verbs) doFork(ctx context.Context, p *phases, id string, children []string) (err error) {
	m := part.m
	e := m.entry(id)
	var insts []runtime.Instance
	defer func() {
		if err == nil {
			return
		}
		for _, inst := range insts {
			if inst != nil {
				m.verbs.destroyInstance(context.Background(), inst, "fork rollback")
			}
		}
		for _, cid := range children {
			ce := m.entry(cid)
			ce.expectExit.Store(true)
			m.verbs.dropClient(ce)
			ce.cmu.Lock()
			ce.inst = nil
			ce.cmu.Unlock()
			m.setState(cid, api.StateError, "fork failed: "+err.Error(), "")
		}
	}()
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	if sb.State != api.StateRunning {
		return fmt.Errorf("sandbox %s is %s; only a running sandbox can be forked: %w", id, sb.State, errdefs.ErrConflict)
	}
	inst, _, err := m.verbs.instance(ctx, e, sb)
	if err != nil {
		return err
	}
	fk, ok := inst.(runtime.Forker)
	if !ok {
		return runtime.NotSupported(sb.Runtime, "fork", "its instances cannot be cloned")
	}
	specs := make([]runtime.Spec, len(children))
	policies := make([]api.NetworkPolicy, len(children))
	for i, cid := range children {
		child, err := m.cfg.DB.GetSandbox(ctx, cid)
		if err != nil {
			return err
		}
		policies[i] = policyOf(child)
		if specs[i], _, err = m.creates.spec(ctx, child); err != nil {
			return err
		}
		specs[i].Hostname = cid
	}
	c, err := m.verbs.liveClient(ctx, p, e, inst)
	if err != nil {
		return err
	}
	if err := p.run("quiesce", func() error { return c.Quiesce(ctx) }); err != nil {
		return fmt.Errorf("the sandbox's agent did not quiesce: %w", err)
	}
	m.verbs.dropClient(e)
	ferr := p.run("fork", func() (err error) {
		insts, err = fk.Fork(ctx, specs)
		return err
	})
	// The parent runs on either way; its agent listens again.
	if rerr := p.run("reconnect", func() error { return m.creates.connect(ctx, e, inst) }); rerr != nil {
		m.log.Warn("parent's agent did not come back after a fork; the next request re-dials", "sandbox", id, "err", rerr)
	}
	if ferr != nil {
		return fmt.Errorf("fork failed: %w", ferr)
	}
	if len(insts) != len(children) {
		return fmt.Errorf("runtime %s returned %d instances for %d fork children", sb.Runtime, len(insts), len(children))
	}
	// Children come up side by side (mostly waiting on their agents);
	// their phases are recorded in children order all the same.
	kidPhases := make([]*phases, len(children))
	errs := make([]error, len(children))
	sem := make(chan struct{}, forkReadyParallel)
	var wg sync.WaitGroup
	for i, cid := range children {
		ce := m.entry(cid)
		ce.cmu.Lock()
		ce.inst = insts[i]
		ce.cmu.Unlock()
		ce.expectExit.Store(false)
		kp := &phases{kind: p.kind, obs: p.obs}
		kidPhases[i] = kp
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := m.net.attachNetwork(ctx, kp, insts[i], policies[i]); err != nil {
				errs[i] = fmt.Errorf("child %s: %w", cid, err)
				return
			}
			if err := kp.run("agent_ready", func() error { return m.creates.connect(ctx, ce, insts[i]) }); err != nil {
				errs[i] = fmt.Errorf("child %s: %w", cid, err)
				return
			}
			// A child that has not reseeded shares its parent's random
			// streams: that is a failed fork, not a warning.
			if err := kp.run("reseed", func() error { return m.verbs.reseed(ctx, ce, cid) }); err != nil {
				errs[i] = fmt.Errorf("child %s did not reseed: %w", cid, err)
				return
			}
			// Its own CA replaces the parent's in its trust stores.
			if child, err := m.cfg.DB.GetSandbox(ctx, cid); err != nil {
				errs[i] = err
			} else if _, err := m.secrets.secretsReady(ctx, kp, ce, child); err != nil {
				errs[i] = fmt.Errorf("child %s: %w", cid, err)
			}
		}()
	}
	wg.Wait()
	p.mu.Lock()
	for _, kp := range kidPhases {
		p.list = append(p.list, kp.list...)
	}
	p.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for i, cid := range children {
		ce := m.entry(cid)
		m.creates.watchExit(ce, insts[i])
		ce.lastActive.Store(time.Now().UnixNano())
		if _, err := m.setState(cid, api.StateRunning, "", ""); err != nil {
			return err
		}
	}
	return nil
}
