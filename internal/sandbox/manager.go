// Package sandbox is the lifecycle manager: it turns API intents into
// persisted operations, drives runtimes through them, keeps one agent client
// per running sandbox, wakes sandboxes on demand, applies idle policies and
// TTLs, and reconciles the store with the host after a restart.
//
// Every lifecycle change follows DESIGN.md's rule: persist intent, act,
// record the result. Actions on one sandbox are serialised by its entry lock.
package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/base32"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
)

// Observer receives measurements (Prometheus in production).
type Observer interface {
	OperationPhase(kind, phase string, d time.Duration)
	OperationDone(kind, state string, d time.Duration)
	Exec(kind string)
}

type nopObserver struct{}

func (nopObserver) OperationPhase(string, string, time.Duration) {}
func (nopObserver) OperationDone(string, string, time.Duration)  {}
func (nopObserver) Exec(string)                                  {}

var _ Observer = nopObserver{}

// Config wires a Manager.
type Config struct {
	DB        *store.DB
	Templates *template.Store
	Runtimes  map[string]runtime.Runtime
	Logger    *slog.Logger
	Observer  Observer
	// AgentReadyTimeout bounds how long a start waits for the agent's health.
	AgentReadyTimeout time.Duration
	// BaseTemplateRef is built on first need when missing (default "base:latest").
	BaseTemplateRef string
	// Network is the gateway that serves sandboxes' virtual NICs; nil
	// disables networking (sandboxes get no link at all).
	Network Network
	// DefaultNetwork is the policy of a sandbox whose request and template
	// set none. The zero value reaches nothing.
	DefaultNetwork api.NetworkPolicy
	// Audit receives the manager's audit events (lifecycle operations,
	// command starts and exits, files changes); nil discards them.
	Audit audit.Sink
	// Tenants gives tenants' quotas and network boundaries; nil: none.
	Tenants Tenants
	// Decider decides the actions the manager sees (exec starts, files
	// calls, lifecycle verbs) against the temporal policy; nil allows all.
	Decider actions.Decider
	// Secrets keeps secrets, grants and sandbox CAs (secrets.go); nil: no
	// brokering (a create naming secrets is refused).
	Secrets *secrets.Store
	// Broker hands the gateway each sandbox's brokered secrets; nil: the
	// gateway cannot broker (placeholders pass unreplaced).
	Broker Broker
	// PoolMemFloor is the host MemAvailable (bytes) under which warm pools
	// do not fill and shed idle members (default DefaultPoolMemFloor).
	PoolMemFloor int64
}

// Manager owns every sandbox of this server.
type Manager struct {
	cfg Config
	log *slog.Logger
	obs Observer
	// created, when set, hears of every sandbox a caller makes (SetCreated).
	created atomic.Pointer[CreatedFunc]
	opEnded atomic.Pointer[func(api.Operation)]

	mu      sync.Mutex
	entries map[string]*entry
	opDone  map[string]chan struct{} // closed when the operation finishes

	ctx    context.Context // cancelled on Close: background loops and watchers
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// Operations get their own context so Close can let them finish (a
	// half-done create would otherwise end in the error state) before
	// cancelling what is left.
	opCtx    context.Context
	opCancel context.CancelFunc
	opWG     sync.WaitGroup

	netKick chan struct{} // NetworkRestarted → reconcile the links now

	// admitMu makes a tenant's quota check and the insert it admits one
	// step (tenants.go).
	admitMu sync.Mutex
	// Audit state (audit.go, netaudit.go): who asked for each running
	// operation, and the follower recording each link's network verdicts.
	opCallers    sync.Map // operation id → opCaller
	netAuditMu   sync.Mutex
	netFollowers map[string]*netFollower
	netWG        sync.WaitGroup

	pools *pools // warm pools (pool.go)

	// The parts (parts.go).
	secrets  *Secrets
	net      *Networking
	cmds     *Commands
	warm     *WarmPools
	builds   *Builds
	tenancy  *Tenancy
	aud      *Auditor
	verbs    *Verbs
	recon    *Reconciler
	files    *Files
	creates  *Creates
	poolKick chan struct{} // wake the pool filler now
}

// closeGrace is how long Close lets running operations finish.
const closeGrace = 30 * time.Second

// entry is the in-memory side of one sandbox.
type entry struct {
	id string
	mu sync.Mutex // serialises lifecycle actions

	cmu    sync.RWMutex // guards inst, client
	inst   runtime.Instance
	client *agentclient.Client

	expectExit atomic.Bool  // set while we stop/destroy it ourselves
	active     atomic.Int64 // in-flight attaches and file transfers
	lastActive atomic.Int64 // unix nanos

	cpu cpuMeter // the last CPU sample Stats took (stats.go)
}

// New builds a Manager. Call Reconcile before serving.
func New(cfg Config) *Manager {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	if cfg.Audit == nil {
		cfg.Audit = audit.Nop{}
	}
	if cfg.Tenants == nil {
		cfg.Tenants = noTenants{}
	}
	if cfg.Decider == nil {
		cfg.Decider = actions.AllowAll{}
	}
	if cfg.AgentReadyTimeout == 0 {
		cfg.AgentReadyTimeout = 20 * time.Second
	}
	if cfg.BaseTemplateRef == "" {
		cfg.BaseTemplateRef = "base:latest"
	}
	if cfg.PoolMemFloor == 0 {
		cfg.PoolMemFloor = DefaultPoolMemFloor
	}
	ctx, cancel := context.WithCancel(context.Background())
	opCtx, opCancel := context.WithCancel(context.Background())
	m := &Manager{netKick: make(chan struct{}, 1), cfg: cfg, log: cfg.Logger, obs: cfg.Observer, entries: map[string]*entry{}, opDone: map[string]chan struct{}{},
		ctx: ctx, cancel: cancel, opCtx: opCtx, opCancel: opCancel, poolKick: make(chan struct{}, 1)}
	m.pools = newPools(m)
	m.secrets = &Secrets{m}
	m.net = &Networking{m}
	m.cmds = &Commands{m}
	m.warm = &WarmPools{m}
	m.builds = &Builds{m}
	m.tenancy = &Tenancy{m}
	m.aud = &Auditor{m}
	m.verbs = &Verbs{m}
	m.recon = &Reconciler{m}
	m.files = &Files{m}
	m.creates = &Creates{m}
	return m
}

// Close stops background work and waits for running operations to notice.
// Sandboxes keep running: a restarted server re-adopts them.
func (m *Manager) Close() {
	m.cancel()
	m.wg.Wait()
	m.net.stopNetAudit()
	done := make(chan struct{})
	go func() { m.opWG.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(closeGrace):
		m.log.Warn("operations still running at shutdown; cancelling them (the next start re-drives creates and deletes)")
		m.opCancel()
		<-done
	}
	m.opCancel()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range m.entries {
		e.cmu.Lock()
		if e.client != nil {
			e.client.Close()
			e.client = nil
		}
		e.cmu.Unlock()
	}
}

func (m *Manager) entry(id string) *entry {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entries[id]
	if e == nil {
		e = &entry{id: id}
		e.lastActive.Store(time.Now().UnixNano())
		m.entries[id] = e
	}
	return e
}

func (m *Manager) forget(id string) {
	m.mu.Lock()
	delete(m.entries, id)
	m.mu.Unlock()
}

func newID(prefix string) string {
	var b [10]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return prefix + "-" + strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b[:]))
}

// Info reports every runtime's probe.
func (m *Manager) Info(ctx context.Context) api.Info {
	info := api.Info{Version: Version}
	for _, name := range slices.Sorted(maps.Keys(m.cfg.Runtimes)) {
		c := m.cfg.Runtimes[name].Probe(ctx)
		info.Runtimes = append(info.Runtimes, api.RuntimeInfo{
			Name: name, Available: c.Available, Reason: c.Reason, Isolation: c.Isolation,
			Verbs: c.Verbs, VerbReasons: c.VerbReasons, Details: c.Details,
		})
	}
	if rt, err := runtime.PickAuto(ctx, m.cfg.Runtimes); err == nil {
		info.AutoRuntime = rt.Name()
	}
	return info
}

// Version is set by the build (-ldflags) or stays "dev".
var Version = "dev"

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

// CreatedFunc hears of a sandbox a caller made (a create, or a fork's
// child) before the call returns; an error deletes the sandbox and fails
// the call. A cluster node records its sandboxes in the cluster this way.
type CreatedFunc func(ctx context.Context, sb api.Sandbox, op api.Operation, req api.CreateSandboxRequest) error

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

// SetOperationDone sets (nil: clears) a function told of every operation
// that ended (after its record is stored). It must not block: a cluster
// node nudges its reconciler with it, so the cluster's rows catch up at
// once instead of at the next poll.
func (m *Manager) SetOperationDone(f func(api.Operation)) {
	if f == nil {
		m.opEnded.Store(nil)
		return
	}
	m.opEnded.Store(&f)
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
	lim, err := validateCreate(&req)
	if err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	if err := validateUser("user", req.User); err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	if req.Network != nil {
		if err := validatePolicy(*req.Network); err != nil {
			return api.Sandbox{}, api.Operation{}, err
		}
		p := ClonePolicy(*req.Network)
		req.Network = &p
	}
	tenant := tenantOf(ctx)
	if req.Network != nil {
		if err := m.tenancy.bound(ctx, tenant, *req.Network); err != nil {
			return api.Sandbox{}, api.Operation{}, err
		}
	}
	rt, caps, err := m.creates.pickRuntime(ctx, req.Runtime)
	if err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	if req.Idle != nil && !caps.Verbs[req.Idle.Action] {
		return api.Sandbox{}, api.Operation{}, runtime.NotSupported(rt.Name(), req.Idle.Action, caps.VerbReasons[req.Idle.Action])
	}
	if req.Template == "" {
		req.Template = m.cfg.BaseTemplateRef
	}
	// A build's step runs on the build's own intermediate templates; the
	// build checked its FROM.
	if req.Labels[BuildLabel] != BuildLabelStep {
		if err := m.cfg.Tenants.UseTemplate(ctx, req.Template); err != nil {
			return api.Sandbox{}, api.Operation{}, err
		}
	}
	if sb, op, handled, err := m.warm.claim(ctx, req, rt, caps, lim, tenant); handled {
		return sb, op, err
	}
	now := time.Now().UTC()
	sb := api.Sandbox{
		ID: newID("sb"), Tenant: tenant, State: api.StateCreating, Runtime: rt.Name(), Isolation: caps.Isolation,
		Template: req.Template, Limits: lim, Env: req.Env, Workdir: req.Workdir, User: req.User, Labels: req.Labels,
		TTLSeconds: req.TTLSeconds, OnExpiry: req.OnExpiry, AllPortsPublic: req.AllPortsPublic, Idle: req.Idle, Network: req.Network, CreatedAt: now, UpdatedAt: now, LastActiveAt: now,
	}
	if req.TTLSeconds > 0 {
		exp := now.Add(time.Duration(req.TTLSeconds) * time.Second)
		sb.ExpiresAt = &exp
	}
	undoSecrets, err := m.secrets.createSecrets(ctx, &sb, req.Secrets)
	if err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	op := newOperation(api.OpCreate, sb.ID)
	sb.OperationID = op.ID
	if err := m.tenancy.admitAndPut(ctx, tenant, func() error { return m.cfg.DB.PutSandbox(ctx, sb) }, sb.Limits); err != nil {
		undoSecrets()
		return api.Sandbox{}, api.Operation{}, err
	}
	if err := m.cfg.DB.PutOperation(ctx, op); err != nil {
		return api.Sandbox{}, api.Operation{}, err
	}
	m.aud.noteCaller(ctx, op.ID, sb.Tenant)
	m.start(op, func(ctx context.Context, p *phases) error { return m.creates.doCreate(ctx, p, sb.ID, false) })
	return sb, op, nil
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

// start runs fn as operation op in the background, holding the sandbox's lock.
func (m *Manager) start(op api.Operation, fn func(ctx context.Context, p *phases) error) {
	m.opChannel(op.ID)
	m.opWG.Add(1)
	go func() {
		defer m.opWG.Done()
		e := m.entry(op.SandboxID)
		e.mu.Lock()
		defer e.mu.Unlock()
		m.runOp(m.opCtx, &op, fn)
	}()
}

// runOp executes fn as op; the caller holds the entry lock.
func (m *Manager) runOp(ctx context.Context, op *api.Operation, fn func(ctx context.Context, p *phases) error) error {
	t0 := time.Now()
	done := m.opChannel(op.ID)
	defer func() {
		m.mu.Lock()
		delete(m.opDone, op.ID)
		m.mu.Unlock()
		close(done)
	}()
	op.State = api.OpRunning
	m.putOp(*op)
	p := &phases{kind: op.Kind, obs: m.obs}
	err := fn(ctx, p)
	fin := time.Now().UTC()
	op.FinishedAt = &fin
	op.Phases = p.list
	if op.Phases == nil {
		op.Phases = []api.Phase{}
	}
	if err != nil {
		op.State = api.OpFailed
		op.Error = &api.ErrorBody{Code: errdefs.Code(err), Message: err.Error()}
		m.log.Warn("operation failed", "op", op.ID, "kind", op.Kind, "sandbox", op.SandboxID, "err", err)
	} else {
		op.State = api.OpSucceeded
	}
	m.putOp(*op)
	if f := m.opEnded.Load(); f != nil {
		(*f)(*op)
	}
	m.obs.OperationDone(op.Kind, op.State, time.Since(t0))
	m.aud.auditOp(ctx, *op, err)
	return err
}

func (m *Manager) putOp(op api.Operation) {
	// Operation records must survive even when the request context is gone.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.cfg.DB.PutOperation(ctx, op); err != nil {
		m.log.Error("persisting operation", "op", op.ID, "err", err)
	}
}

// setState persists a sandbox state change (and optional error note).
func (m *Manager) setState(id, state, errMsg, opID string) (api.Sandbox, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return sb, err
	}
	sb.State = state
	sb.Error = errMsg
	sb.OperationID = opID
	sb.UpdatedAt = time.Now().UTC()
	m.withActivity(&sb)
	return sb, m.cfg.DB.PutSandbox(ctx, sb)
}

// withActivity overlays the in-memory last-activity time, which is kept
// off the hot path and only persisted with state changes.
func (m *Manager) withActivity(sb *api.Sandbox) {
	if e := m.peek(sb.ID); e != nil {
		sb.LastActiveAt = time.Unix(0, e.lastActive.Load()).UTC()
	}
}

func (m *Manager) peek(id string) *entry {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.entries[id]
}

// Get returns a sandbox.
func (m *Manager) Get(ctx context.Context, id string) (api.Sandbox, error) {
	if err := ValidID(id); err != nil {
		return api.Sandbox{}, err
	}
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return sb, err
	}
	if isPoolMember(sb) {
		// An unclaimed pool member is nobody's: as missing as any id.
		return api.Sandbox{}, fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	m.withActivity(&sb)
	return sb, nil
}

// List returns sandboxes matching the filter.
func (m *Manager) List(ctx context.Context, state string, labels map[string]string) ([]api.Sandbox, error) {
	if state != "" {
		switch state {
		case api.StateCreating, api.StateRunning, api.StatePaused, api.StateStopping, api.StateStopped,
			api.StateStarting, api.StateSuspended, api.StateDeleting, api.StateError:
		default:
			return nil, invalid("unknown state %q", truncate(state, 32))
		}
	}
	sbs, err := m.cfg.DB.ListSandboxes(ctx, store.SandboxFilter{State: state, Labels: labels})
	if err != nil {
		return nil, err
	}
	// A caller sees its own tenant's sandboxes (admin: all), and nobody
	// sees unclaimed pool members.
	p, ok := principal.From(ctx)
	mine := sbs[:0]
	for _, sb := range sbs {
		if !isPoolMember(sb) && (!ok || p.Admin() || p.Sees(sb.Tenant)) {
			mine = append(mine, sb)
		}
	}
	return mine, nil
}

// GetOperation returns an operation, waiting up to wait for it to finish.
func (m *Manager) GetOperation(ctx context.Context, id string, wait time.Duration) (api.Operation, error) {
	if err := ValidID(id); err != nil {
		return api.Operation{}, err
	}
	deadline := time.Now().Add(wait)
	for {
		// Take the channel before reading the record so a finish between
		// the two cannot be missed.
		m.mu.Lock()
		done := m.opDone[id]
		m.mu.Unlock()
		op, err := m.cfg.DB.GetOperation(ctx, id)
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

// opChannel registers the completion channel of an operation.
func (m *Manager) opChannel(id string) chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	ch := m.opDone[id]
	if ch == nil {
		ch = make(chan struct{})
		m.opDone[id] = ch
	}
	return ch
}

// runtimeOf returns the runtime a sandbox was created with.
func (m *Manager) runtimeOf(sb api.Sandbox) (runtime.Runtime, error) {
	rt, ok := m.cfg.Runtimes[sb.Runtime]
	if !ok {
		return nil, fmt.Errorf("runtime %s is not registered in this server: %w", sb.Runtime, errdefs.ErrUnprocessable)
	}
	return rt, nil
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
// it again after a crash.
func (part *Creates) doCreate(ctx context.Context, p *phases, id string, redriven bool) error {
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
		return err
	}); err != nil {
		return fail(fmt.Errorf("template %s: %w", sb.Template, err))
	}
	// Until the record below names it, nothing but this create keeps an
	// untagged template from a concurrent gc.
	defer m.cfg.Templates.Hold(tmpl.Digest)()
	sb.TemplateDigest = tmpl.Digest
	// The template's defaults become the sandbox's own, so a later template
	// change (a moved tag) never changes how an existing sandbox runs.
	if err := applyTemplateDefaults(&sb, tmpl.Config); err != nil {
		return fail(fmt.Errorf("template %s: %w", sb.Template, err))
	}
	if sb.Network == nil {
		p := ClonePolicy(m.cfg.DefaultNetwork)
		sb.Network = &p
	}
	// A policy from the template or the server default is held to the
	// tenant's boundary like a requested one.
	if err := m.tenancy.bound(ctx, TenantOf(sb), *sb.Network); err != nil {
		return fail(err)
	}
	if err := m.cfg.DB.PutSandbox(ctx, sb); err != nil {
		return fail(err)
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
