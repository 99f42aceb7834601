package sandbox

// The Creates part: a create request validated and planned, its record
// written, and the instance prepared, booted and connected in the
// background operation.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/template"
)

func (part *Creates) pickRuntime(ctx context.Context, name string) (runtime.Runtime, runtime.Capabilities, error) {
	m := part.m
	if name == "" || name == runtime.Auto {
		rt, err := runtime.PickAuto(ctx, m.cfg.Runtimes)
		if err != nil {
			return nil, runtime.Capabilities{}, fmt.Errorf("%w: %w", err, errdefs.ErrUnprocessable)
		}
		return rt, rt.Probe(ctx), nil
	}
	rt, ok := m.cfg.Runtimes[name]
	if !ok {
		return nil, runtime.Capabilities{}, invalid("unknown runtime %q (known: auto, %s)", truncate(name, 32), strings.Join(slices.Sorted(maps.Keys(m.cfg.Runtimes)), ", "))
	}
	c := rt.Probe(ctx)
	if !c.Available {
		return nil, c, fmt.Errorf("runtime %s is not available on this host: %s: %w", name, c.Reason, errdefs.ErrUnprocessable)
	}
	return rt, c, nil
}

// SetCreated sets (nil: clears) the function told of every sandbox callers
// make — through any API — but not of warm-pool members or build steps,
// which are the server's own.
func (part *Creates) SetCreated(f CreatedFunc) {
	m := part.m
	if f == nil {
		m.created.Store(nil)
		return
	}
	m.created.Store(&f)
}

// tellCreated runs the CreatedFunc for sb; when it fails, sb is deleted.
func (part *Creates) tellCreated(ctx context.Context, sb api.Sandbox, op api.Operation, req api.CreateSandboxRequest) error {
	m := part.m
	f := m.created.Load()
	if f == nil || isPoolMember(sb) || sb.Labels[BuildLabel] != "" {
		return nil
	}
	err := (*f)(ctx, sb, op, req)
	if err == nil {
		return nil
	}
	if _, derr := m.verbs.systemLifecycle(principal.With(context.WithoutCancel(ctx), principal.System), sb.ID, api.OpDelete, true); derr != nil {
		m.log.Warn("deleting a sandbox its creation hook refused", "sandbox", sb.ID, "err", derr)
	}
	return err
}

// Create validates req, persists the sandbox and its create operation, and
// starts the operation in the background.
func (part *Creates) Create(ctx context.Context, req api.CreateSandboxRequest) (api.Sandbox, api.Operation, error) {
	m := part.m
	sb, op, err := m.creates.create(ctx, req)
	if err != nil {
		return sb, op, err
	}
	if err := m.creates.tellCreated(ctx, sb, op, req); err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	return sb, op, nil
}

func (part *Creates) create(ctx context.Context, req api.CreateSandboxRequest) (api.Sandbox, api.Operation, error) {
	m := part.m
	pl, err := part.plan(ctx, req)
	if err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	defer pl.release()
	sb, err := part.record(ctx, pl)
	if err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	if sb, op, handled, err := m.warm.claim(ctx, pl, sb); handled {
		return sb, op, err
	}
	sb.ID = newID("sb")
	undoSecrets, err := m.secrets.createSecrets(ctx, &sb, pl.req.Secrets)
	if err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	op, written, err := part.persist(ctx, &sb)
	if err != nil {
		if !written {
			undoSecrets()
		}
		return api.Sandbox{}, api.Operation{}, err
	}
	tmpl := pl.tmpl
	m.ops.start(op, func(ctx context.Context, p *phases) error { return m.creates.doCreate(ctx, p, sb.ID, false, tmpl) })
	return sb, op, nil
}

// createPlan is a create request decided once, before any way of serving
// it is chosen: validated, its runtime picked, its template looked up (one
// lookup) and the caller's right to use it checked. A cold create and a
// warm pool's claim build their record from it with the one record
// builder (Creates.record) and write it with the one writer
// (Creates.persist).
type createPlan struct {
	req    api.CreateSandboxRequest // validated; Template defaulted; Network cloned
	tenant string
	rt     runtime.Runtime
	caps   runtime.Capabilities
	lim    api.Limits
	// tmpl is the template req names; nil when it does not exist yet (the
	// base template, which the create builds on first need).
	tmpl *api.Template
	// release lets a gc collect tmpl again once the record names it.
	release func()
}

// plan decides req: everything a create checks before it writes anything.
func (part *Creates) plan(ctx context.Context, req api.CreateSandboxRequest) (*createPlan, error) {
	m := part.m
	lim, err := validateCreate(&req)
	if err != nil {
		return nil, err
	}
	if err := validateUser("user", req.User); err != nil {
		return nil, err
	}
	if req.Network != nil {
		if err := validatePolicy(*req.Network); err != nil {
			return nil, err
		}
		p := ClonePolicy(*req.Network)
		req.Network = &p
	}
	rt, caps, err := part.pickRuntime(ctx, req.Runtime)
	if err != nil {
		return nil, err
	}
	if req.Idle != nil && !caps.Verbs[req.Idle.Action] {
		return nil, runtime.NotSupported(rt.Name(), req.Idle.Action, caps.VerbReasons[req.Idle.Action])
	}
	if req.Template == "" {
		req.Template = m.cfg.BaseTemplateRef
	}
	pl := &createPlan{req: req, tenant: tenantOf(ctx), rt: rt, caps: caps, lim: lim, release: func() {}}
	switch t, err := m.cfg.Templates.Get(ctx, req.Template); {
	case err == nil:
		pl.tmpl = &t
		pl.release = m.cfg.Templates.Hold(t.Digest)
	case errors.Is(err, errdefs.ErrNotFound) && isBaseRef(req.Template, m.cfg.BaseTemplateRef):
		// Built by the create's operation, on first need.
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, fmt.Errorf("template %q not found: %w", req.Template, errdefs.ErrNotFound)
	default:
		return nil, fmt.Errorf("template %s: %w", req.Template, err)
	}
	// A build's step runs on the build's own intermediate templates; the
	// build checked its FROM.
	if pl.tmpl != nil && req.Labels[BuildLabel] != BuildLabelStep {
		if err := m.cfg.Tenants.UseTemplate(ctx, req.Template, *pl.tmpl); err != nil {
			pl.release()
			return nil, err
		}
	}
	// Without the template the record's final policy is not known yet:
	// the requested one is held to the boundary now (a 4xx, not a failed
	// operation), the final one by the operation (completeRecord).
	if pl.tmpl == nil && req.Network != nil {
		if err := m.tenancy.bound(ctx, pl.tenant, *req.Network); err != nil {
			return nil, err
		}
	}
	return pl, nil
}

// record builds the sandbox record pl creates, without its id (a cold
// create draws one, a claim takes its member's). With the template known,
// the record is complete: its digest, the template's defaults, the network
// policy and the boundary check.
func (part *Creates) record(ctx context.Context, pl *createPlan) (api.Sandbox, error) {
	req := pl.req
	now := time.Now().UTC()
	sb := api.Sandbox{
		Tenant: pl.tenant, State: api.StateCreating, Runtime: pl.rt.Name(), Isolation: pl.caps.Isolation,
		Template: req.Template, Limits: pl.lim, Env: req.Env, Workdir: req.Workdir, User: req.User, Labels: req.Labels,
		TTLSeconds: req.TTLSeconds, OnExpiry: req.OnExpiry, AllPortsPublic: req.AllPortsPublic, Idle: req.Idle, Network: req.Network,
		CreatedAt: now, UpdatedAt: now, LastActiveAt: now,
	}
	if req.TTLSeconds > 0 {
		exp := now.Add(time.Duration(req.TTLSeconds) * time.Second)
		sb.ExpiresAt = &exp
	}
	if pl.tmpl != nil {
		if err := part.completeRecord(ctx, &sb, *pl.tmpl); err != nil {
			return api.Sandbox{}, err
		}
	}
	return sb, nil
}

// completeRecord makes tmpl's what sb runs: its digest, its defaults (the
// sandbox's own from now on, so a later template change — a moved tag —
// never changes how an existing sandbox runs) and, without a policy from
// the request or the template, the server's default one. The final policy
// is held to the tenant's boundary, whichever it is.
func (part *Creates) completeRecord(ctx context.Context, sb *api.Sandbox, tmpl api.Template) error {
	m := part.m
	sb.TemplateDigest = tmpl.Digest
	if err := applyTemplateDefaults(sb, tmpl.Config); err != nil {
		return fmt.Errorf("template %s: %w", sb.Template, err)
	}
	if sb.Network == nil {
		p := ClonePolicy(m.cfg.DefaultNetwork)
		sb.Network = &p
	}
	return m.tenancy.bound(ctx, TenantOf(*sb), *sb.Network)
}

// persist writes sb (admitted against its tenant's quotas) and its create
// operation; written says whether the record was written, so a caller
// knows what to undo.
func (part *Creates) persist(ctx context.Context, sb *api.Sandbox) (op api.Operation, written bool, err error) {
	m := part.m
	op = newOperation(api.OpCreate, sb.ID)
	sb.OperationID = op.ID
	if err := m.tenancy.admitAndPut(ctx, TenantOf(*sb), func() error { return m.cfg.DB.PutSandbox(ctx, *sb) }, sb.Limits); err != nil {
		return api.Operation{}, false, err
	}
	if err := m.cfg.DB.PutOperation(ctx, op); err != nil {
		return api.Operation{}, true, err
	}
	m.aud.noteCaller(ctx, op.ID, sb.Tenant)
	return op, true, nil
}

// newSpec builds a runtime spec; runtimes key what they derive from a
// template by its tree digest (templates that differ only in defaults share it).
func newSpec(sb api.Sandbox, tmpl api.Template, rootfs string) runtime.Spec {
	return runtime.Spec{ID: sb.ID, RootFS: rootfs, TemplateDigest: tmpl.TreeDigest, Limits: sb.Limits, Hostname: sb.ID,
		Background: isPoolMember(sb)}
}

// spec resolves everything a runtime needs for an existing sandbox.
func (part *Creates) spec(ctx context.Context, sb api.Sandbox) (runtime.Spec, runtime.Runtime, error) {
	m := part.m
	rt, err := m.runtimeOf(sb)
	if err != nil {
		return runtime.Spec{}, nil, err
	}
	ref := sb.TemplateDigest
	if ref == "" {
		ref = sb.Template
	}
	tmpl, rootfs, err := m.cfg.Templates.Resolve(ctx, ref)
	if err != nil {
		return runtime.Spec{}, rt, fmt.Errorf("resolving template %s: %w", ref, err)
	}
	return newSpec(sb, tmpl, rootfs), rt, nil
}

// doCreate runs a create operation; redriven is true when reconcile runs
// it again after a crash. planned is the template the create's plan looked
// up (nil: look it up again, by the digest the record names if it names
// one, building the base template on first need).
func (part *Creates) doCreate(ctx context.Context, p *phases, id string, redriven bool, planned *api.Template) error {
	m := part.m
	e := m.entry(id)
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	fail := func(err error) error {
		m.setState(id, api.StateError, err.Error(), "")
		return err
	}
	rt, err := m.runtimeOf(sb)
	if err != nil {
		return fail(err)
	}
	var (
		tmpl   api.Template
		rootfs string
	)
	if err := p.run("resolve_template", func() error {
		switch {
		case planned != nil:
			tmpl = *planned
			rootfs, err = m.cfg.Templates.Content(tmpl)
		case sb.TemplateDigest != "":
			tmpl, rootfs, err = m.cfg.Templates.Resolve(ctx, sb.TemplateDigest)
		default:
			tmpl, rootfs, err = m.cfg.Templates.Resolve(ctx, sb.Template)
			if errors.Is(err, errdefs.ErrNotFound) && isBaseRef(sb.Template, m.cfg.BaseTemplateRef) {
				m.log.Info("building the base template on first need (this takes a few minutes once)")
				_, err = m.cfg.Templates.EnsureBase(ctx, func(pr template.Progress) {
					m.log.Debug("base template", "phase", pr.Phase, "done", pr.Done, "total", pr.Total, "msg", pr.Message)
				})
				if err == nil {
					tmpl, rootfs, err = m.cfg.Templates.Resolve(ctx, sb.Template)
				}
			}
		}
		return err
	}); err != nil {
		return fail(fmt.Errorf("template %s: %w", sb.Template, err))
	}
	// Until the record names it, nothing but this create keeps an untagged
	// template from a concurrent gc.
	defer m.cfg.Templates.Hold(tmpl.Digest)()
	if sb.TemplateDigest == "" {
		// The plan had no template to complete the record with.
		if err := part.completeRecord(ctx, &sb, tmpl); err != nil {
			return fail(err)
		}
		if err := m.cfg.DB.PutSandbox(ctx, sb); err != nil {
			return fail(err)
		}
	}
	// Sessions left by an attempt that crashed died with its instance. A
	// first attempt has none: no read of them on every create.
	if redriven {
		m.cmds.markCommandsExited(id, "the sandbox's creation was interrupted and started over")
	}
	spec := newSpec(sb, tmpl, rootfs)
	var inst runtime.Instance
	if err := p.run("prepare", func() (err error) {
		inst, err = rt.Create(ctx, spec)
		return err
	}); err != nil {
		return fail(fmt.Errorf("preparing sandbox: %w", err))
	}
	e.cmu.Lock()
	e.inst = inst
	e.cmu.Unlock()
	if err := m.creates.bootWith(ctx, p, e, inst, sb, tmpl.Config.Start); err != nil {
		e.expectExit.Store(true)
		m.verbs.destroyInstance(context.Background(), inst, "failed create")
		return fail(err)
	}
	e.lastActive.Store(time.Now().UnixNano())
	_, err = m.setState(id, api.StateRunning, "", "")
	return err
}

func isBaseRef(ref, base string) bool {
	return ref == base || ref+":latest" == base
}

// boot starts the stopped instance of sandbox e from cold: its runtime, its
// agent, and its template's start command (with the ready wait).
func (part *Creates) boot(ctx context.Context, p *phases, e *entry, inst runtime.Instance) error {
	m := part.m
	sb, err := m.cfg.DB.GetSandbox(ctx, e.id)
	if err != nil {
		return err
	}
	tmpl, err := m.cfg.Templates.Get(ctx, sb.TemplateDigest)
	if err != nil {
		return fmt.Errorf("template %s of sandbox %s: %w", sb.TemplateDigest, sb.ID, err)
	}
	return m.creates.bootWith(ctx, p, e, inst, sb, tmpl.Config.Start)
}

// bootWith is boot with the sandbox record and start command at hand. On
// error the caller stops or destroys inst.
func (part *Creates) bootWith(ctx context.Context, p *phases, e *entry, inst runtime.Instance, sb api.Sandbox, start *api.StartCommand) error {
	m := part.m
	e.expectExit.Store(false)
	if err := p.run("start_runtime", func() error { return inst.Start(ctx) }); err != nil {
		return fmt.Errorf("starting sandbox: %w", err)
	}
	// The link is up before anything in the sandbox (its start command)
	// runs; on error the caller's stop detaches it again. The agent is the
	// runtime's, not the sandbox's: the gateway attaches the link while
	// the agent starts up (its Go start-up is most of agent_ready).
	netErr := make(chan error, 1)
	go func() { netErr <- m.net.attachNetwork(ctx, p, inst, policyOf(sb)) }()
	readyErr := p.run("agent_ready", func() error { return m.creates.connect(ctx, e, inst) })
	if err := <-netErr; err != nil {
		if readyErr == nil {
			m.verbs.dropClient(e)
		}
		return err
	}
	if readyErr != nil {
		return readyErr
	}
	m.creates.watchExit(e, inst)
	// The CA is trusted before anything of the sandbox's own runs.
	sb, err := m.secrets.secretsReady(ctx, p, e, sb)
	if err != nil {
		return err
	}
	// A pool member runs its start command when claimed, with the
	// claimer's env.
	if start == nil || isBuildStep(sb) || isPoolMember(sb) {
		return nil
	}
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if err := m.cmds.startFromTemplate(ctx, p, c, sb, start); err != nil {
		m.verbs.dropClient(e)
		return err
	}
	return nil
}

// connect dials the agent and waits for its health, bounded by AgentReadyTimeout.
func (part *Creates) connect(ctx context.Context, e *entry, inst runtime.Instance) error {
	m := part.m
	ctx, cancel := context.WithTimeout(ctx, m.cfg.AgentReadyTimeout)
	defer cancel()
	var last error
	delay := time.Millisecond
	for {
		c, err := m.creates.dial(ctx, inst)
		if err == nil {
			e.cmu.Lock()
			if e.client != nil {
				e.client.Close()
			}
			e.client = c
			e.cmu.Unlock()
			return nil
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent did not become ready within %s: %w: %w", m.cfg.AgentReadyTimeout, last, errdefs.ErrUnavailable)
		case <-inst.Exited():
			if why := exitReason(inst); why != "" {
				return fmt.Errorf("sandbox init exited before its agent became ready: %s: %w", why, errdefs.ErrUnavailable)
			}
			return fmt.Errorf("sandbox init exited before its agent became ready (last error: %v): %w", last, errdefs.ErrUnavailable)
		case <-time.After(delay):
		}
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

func (part *Creates) dial(ctx context.Context, inst runtime.Instance) (*agentclient.Client, error) {
	conn, err := inst.DialAgent(ctx)
	if err != nil {
		return nil, err
	}
	c, err := agentclient.New(conn)
	if err != nil {
		conn.Close()
		return nil, err
	}
	hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := c.Health(hctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// exitReason is the runtime's account of why inst's init ended, if it has one.
func exitReason(inst runtime.Instance) string {
	if r, ok := inst.(runtime.ExitReasoner); ok {
		return r.ExitReason()
	}
	return ""
}

// watchExit marks the sandbox stopped (with the reason) when its init dies
// without us asking: hostile code may kill the agent; the disk is kept and
// the next request starts it again.
func (part *Creates) watchExit(e *entry, inst runtime.Instance) {
	m := part.m
	ch := inst.Exited()
	if ch == nil {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		select {
		case <-m.ctx.Done():
			return
		case <-ch:
		}
		if e.expectExit.Load() {
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.expectExit.Load() {
			return
		}
		e.cmu.Lock()
		same := e.inst == inst
		if same && e.client != nil {
			e.client.Close()
			e.client = nil
		}
		e.cmu.Unlock()
		if !same {
			return
		}
		why := exitReason(inst)
		m.verbs.stopInstance(context.Background(), inst, "init exited")
		m.log.Warn("sandbox init exited unexpectedly", "sandbox", e.id, "reason", why)
		m.cmds.markCommandsExited(e.id, "the sandbox's init exited")
		msg := "sandbox init (the agent) exited unexpectedly; start or wake it to run again"
		if why != "" {
			msg = "sandbox init exited unexpectedly: " + why + "; start or wake it to run again"
		}
		m.setState(e.id, api.StateStopped, msg, "")
	}()
}
