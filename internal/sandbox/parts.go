package sandbox

import (
	"context"
	"sync"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/build"
)

// The Manager's parts. Each owns one seam of the sandbox core and reaches
// the shared state (records, entries, locks, operations) through m, the
// Manager it belongs to; callers outside the package reach a part through
// the Manager's accessor of the same name.

// Secrets is credential brokering of sandboxes: grants, placeholders in the
// env, the per-sandbox CA installed in the sandbox, the broker config pushed
// to the gateway (secrets.go).
type Secrets struct{ m *Manager }

// Secrets is the manager's Secrets part.
func (m *Manager) Secrets() *Secrets { return m.secrets }

// Networking is the manager's side of the network gateway: links attached
// and reconciled, policies set, network info and events, the audit follower
// of each link, ports dialled and made public, socket owners (netmgr.go,
// netaudit.go, ports.go, sockowner.go).
type Networking struct{ m *Manager }

// Networking is the manager's Networking part.
func (m *Manager) Networking() *Networking { return m.net }

// Commands is what runs in a sandbox: synchronous execs, command sessions
// (create, start, list, signal, attach tokens, attach) and the template's
// start command with its ready check (exec.go, defaults.go).
type Commands struct{ m *Manager }

// Commands is the manager's Commands part.
func (m *Manager) Commands() *Commands { return m.cmds }

// WarmPools is warm pools: specs set, checked and mirrored, the default
// pool, and the claim of a member inside Create (pool.go, claim.go).
type WarmPools struct{ m *Manager }

// WarmPools is the manager's WarmPools part.
func (m *Manager) WarmPools() *WarmPools { return m.warm }

// Builds runs template build steps in real sandboxes of the step before
// (buildstep.go).
type Builds struct{ m *Manager }

// Builds is the manager's Builds part.
func (m *Manager) Builds() *Builds { return m.builds }

// Tenancy is tenants' usage and quotas: admission of a create, the network
// boundary, visibility (tenants.go).
type Tenancy struct {
	sandboxes sandboxLister
	tenants   Tenants
	get       func(ctx context.Context, id string) (api.Sandbox, error)
	// admitMu makes a tenant's quota check and the insert it admits one
	// step.
	admitMu sync.Mutex
}

// Tenancy is the manager's Tenancy part.
func (m *Manager) Tenancy() *Tenancy { return m.tenancy }

// Auditor writes the manager's audit records: operations with their callers,
// command starts and exits, files changes (audit.go).
type Auditor struct {
	sink    audit.Sink
	records sandboxGetter
	callers sync.Map // operation id → opCaller: who asked for each running operation
}

// Auditor is the manager's Auditor part.
func (m *Manager) Auditor() *Auditor { return m.aud }

// Verbs is the lifecycle verbs on a sandbox: stop, start, pause, resume,
// wake, suspend, restore, fork, delete, expiry, snapshots and moves, and
// keeping a sandbox running for a call (lifecycle.go, suspend.go, fork.go,
// expiry.go, snapshot.go, move.go, release.go).
type Verbs struct{ m *Manager }

// Verbs is the manager's Verbs part.
func (m *Manager) Verbs() *Verbs { return m.verbs }

// Reconciler brings the records and the runtimes' instances back in step
// after a start (adopt, redrive, sweep) and runs the background loop of
// deadlines and idle policies (reconcile.go).
type Reconciler struct{ m *Manager }

// Reconciler is the manager's Reconciler part.
func (m *Manager) Reconciler() *Reconciler { return m.recon }

// Files is a sandbox's files, through the one decided door (FileSession) and
// directory watches (files.go, watch.go).
type Files struct{ m *Manager }

// Files is the manager's Files part.
func (m *Manager) Files() *Files { return m.files }

// Creates is the create path: the request planned, admitted and recorded,
// the instance booted and connected, its exit watched, and the creators told
// (manager.go).
type Creates struct{ m *Manager }

// Creates is the manager's Creates part.
func (m *Manager) Creates() *Creates { return m.creates }

// TemplateUsers is what the template service asks of the sandboxes (see
// templatesvc.Sandboxes): the sandboxes and warm pools whose templates are
// in use, and build steps run in real sandboxes.
type TemplateUsers struct{ m *Manager }

// TemplateUsers is the manager as the template service sees it.
func (m *Manager) TemplateUsers() TemplateUsers { return TemplateUsers{m} }

// List lists sandboxes (Manager.List).
func (t TemplateUsers) List(ctx context.Context, state string, labels map[string]string) ([]api.Sandbox, error) {
	return t.m.List(ctx, state, labels)
}

// PoolTemplates names the templates of the warm pools' members.
func (t TemplateUsers) PoolTemplates(ctx context.Context) (map[string]bool, error) {
	return t.m.warm.PoolTemplates(ctx)
}

// RunStep runs one build step (Builds.RunStep).
func (t TemplateUsers) RunStep(ctx context.Context, s build.Step) (int, error) {
	return t.m.builds.RunStep(ctx, s)
}
