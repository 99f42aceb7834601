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

	mu      sync.Mutex
	entries map[string]*entry

	ctx    context.Context // cancelled on Close: background loops and watchers
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// ops runs operations under their sandbox's entry lock and keeps their
	// records (ops.go); Close lets running ones finish.
	ops *opEngine

	netKick chan struct{} // NetworkRestarted → reconcile the links now

	// Network audit state (netaudit.go): the follower recording each
	// link's network verdicts.
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
	m := &Manager{netKick: make(chan struct{}, 1), cfg: cfg, log: cfg.Logger, obs: cfg.Observer, entries: map[string]*entry{},
		ctx: ctx, cancel: cancel, poolKick: make(chan struct{}, 1)}
	m.pools = newPools(m)
	m.secrets = &Secrets{m}
	m.net = &Networking{m}
	m.cmds = &Commands{m}
	m.warm = &WarmPools{m}
	m.builds = &Builds{m}
	m.tenancy = newTenancy(cfg.DB, cfg.Tenants, m.Get)
	m.aud = newAuditor(cfg.Audit, cfg.DB)
	m.verbs = &Verbs{m}
	m.recon = &Reconciler{m}
	m.files = &Files{m}
	m.creates = &Creates{m}
	lockEntry := func(id string) func() {
		e := m.entry(id)
		e.mu.Lock()
		return e.mu.Unlock
	}
	m.ops = newOpEngine(cfg.DB, cfg.Observer, cfg.Logger, lockEntry, m.aud.auditOp)
	return m
}

// Close stops background work and waits for running operations to notice.
// Sandboxes keep running: a restarted server re-adopts them.
func (m *Manager) Close() {
	m.cancel()
	m.wg.Wait()
	m.net.stopNetAudit()
	m.ops.close(closeGrace)
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

// CreatedFunc hears of a sandbox a caller made (a create, or a fork's
// child) before the call returns; an error deletes the sandbox and fails
// the call. A cluster node records its sandboxes in the cluster this way.
type CreatedFunc func(ctx context.Context, sb api.Sandbox, op api.Operation, req api.CreateSandboxRequest) error

// SetOperationDone sets (nil: clears) a function told of every operation
// that ended (after its record is stored). It must not block: a cluster
// node nudges its reconciler with it, so the cluster's rows catch up at
// once instead of at the next poll.
func (m *Manager) SetOperationDone(f func(api.Operation)) { m.ops.setDone(f) }

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

// GetOperation returns an operation, waiting up to wait for it to finish
// (a ctx that ends stops the wait and returns the record as it stands).
func (m *Manager) GetOperation(ctx context.Context, id string, wait time.Duration) (api.Operation, error) {
	return m.ops.get(ctx, id, wait)
}

// runtimeOf returns the runtime a sandbox was created with.
func (m *Manager) runtimeOf(sb api.Sandbox) (runtime.Runtime, error) {
	rt, ok := m.cfg.Runtimes[sb.Runtime]
	if !ok {
		return nil, fmt.Errorf("runtime %s is not registered in this server: %w", sb.Runtime, errdefs.ErrUnprocessable)
	}
	return rt, nil
}
