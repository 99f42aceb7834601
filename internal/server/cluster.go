package server

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/tenancy"
)

// ClusterNodeOptions make the server a node of a cluster whose shared state
// is in PostgreSQL: it registers and heart-beats there, reports its
// sandboxes, and applies the desired state replicas write. Empty Store:
// the single box, nothing else to run.
type ClusterNodeOptions struct {
	Store     string        // PostgreSQL DSN (postgres://… or key=value)
	NodeID    string        // this node's name in the cluster
	Advertise string        // the address replicas reach this node's API at
	Heartbeat time.Duration // between heartbeats (default 2 s)
	// Listen is the node's cluster listener (host:port): the API over
	// mutual TLS, for the cluster's replicas only, with the caller's
	// identity in a header the replica vouches for. Empty: none (replicas
	// cannot reach this node; the rows are still kept).
	Listen string
	// CAFile, CertFile, KeyFile: the cluster CA's certificate and this
	// node's certificate and key (clustertls; `space cluster cert`).
	CAFile, CertFile, KeyFile string
	// OrphanGrace is how long a sandbox made since the node started may
	// go without a row before it is deleted (default 30 s).
	OrphanGrace time.Duration
	// SecretsKeyFile is the cluster's secrets key: with it the node
	// mirrors the secrets set through replicas into its own store (and
	// drops those the cluster no longer has). Empty: its secrets are its
	// own.
	SecretsKeyFile string
	// SuspendShare is a directory on storage every node mounts at the
	// same path: a suspended sandbox is exported there, so that another
	// node can continue it when this one is lost. Empty: suspended
	// sandboxes stay with their node.
	SuspendShare string
}

func (o ClusterNodeOptions) check() error {
	if o.Store == "" {
		return nil
	}
	if o.NodeID == "" || o.Advertise == "" {
		return fmt.Errorf("a cluster node needs its node id and the address replicas reach it at: %w", errdefs.ErrInvalidArgument)
	}
	if o.Listen != "" && (o.CAFile == "" || o.CertFile == "" || o.KeyFile == "") {
		return fmt.Errorf("a node's cluster listener needs the cluster CA, its certificate and its key: %w", errdefs.ErrInvalidArgument)
	}
	if o.SuspendShare != "" {
		if fi, err := os.Stat(o.SuspendShare); err != nil || !fi.IsDir() || !filepath.IsAbs(o.SuspendShare) {
			return fmt.Errorf("--suspend-share %q must be an existing directory, given by its absolute path: %w", o.SuspendShare, errdefs.ErrInvalidArgument)
		}
	}
	if o.Heartbeat < 0 || o.OrphanGrace < 0 {
		return fmt.Errorf("heartbeat interval and orphan grace must not be negative: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

// startClusterNode joins the cluster: one synchronous heartbeat (so a bad
// DSN or an unreachable database fails the start), then the heartbeat and
// reconcile loops until ctx ends. The returned function waits for them.
func (s *Server) startClusterNode(ctx context.Context, o ClusterNodeOptions) (wait func(), err error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	if o.Heartbeat == 0 {
		o.Heartbeat = 2 * time.Second
	}
	var sealer *secrets.Sealer
	if o.SecretsKeyFile != "" {
		if sealer, err = loadSealer(o.SecretsKeyFile); err != nil {
			return nil, err
		}
	}
	cs, err := clusterstore.Open(ctx, o.Store)
	if err != nil {
		return nil, fmt.Errorf("joining the cluster: %w", err)
	}
	var tlsLn net.Listener
	if o.Listen != "" {
		if tlsLn, err = listenCluster(o); err != nil {
			cs.Close()
			return nil, err
		}
	}
	rows := &clusterRows{store: cs.Sandboxes(), node: o.NodeID}
	s.mgr.Creates().SetCreated(rows.recordSandbox)
	local := &clusterLocal{mgr: s.mgr}
	status := func(ctx context.Context) (clusterstore.NodeStatus, error) {
		mem, err := sandbox.HostMemAvailable()
		if err != nil {
			return clusterstore.NodeStatus{}, err
		}
		sbs, err := local.List(ctx)
		if err != nil {
			return clusterstore.NodeStatus{}, err
		}
		st := clusterstore.NodeStatus{ID: o.NodeID, Address: o.Advertise, MemFree: mem, CPUs: goruntime.NumCPU(), Sandboxes: len(sbs)}
		tmpls, err := s.tmpl.List(ctx)
		if err != nil {
			return clusterstore.NodeStatus{}, err
		}
		for _, t := range tmpls {
			for _, name := range append([]string{t.Digest}, t.Tags...) {
				if name != "" && !slices.Contains(st.Templates, name) {
					st.Templates = append(st.Templates, name)
				}
			}
		}
		st.Warm = warmNames(s.mgr.WarmPools().Pools(ctx), tmpls)
		return st, nil
	}
	// The cluster listener serves before the first heartbeat advertises it.
	var hs *http.Server
	served := make(chan struct{})
	if tlsLn != nil {
		hs = s.HTTPServer()
		hs.Handler = s.fromReplica(s.clusterRoutes(o))
		hs.ErrorLog = slog.NewLogLogger(s.cfg.Logger.Handler(), slog.LevelWarn)
		go func() {
			defer close(served)
			hs.Serve(tlsLn)
		}()
	} else {
		close(served)
	}
	stopListener := func() {
		if hs != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			hs.Shutdown(sctx)
		}
		<-served
	}
	beat, err := cluster.Beat(ctx, cs.Nodes(), o.Heartbeat, status, s.cfg.Logger)
	if err != nil {
		stopListener()
		s.mgr.Creates().SetCreated(nil)
		cs.Close()
		return nil, fmt.Errorf("joining the cluster: %w", err)
	}
	node := &cluster.Node{ID: o.NodeID, Store: cs.Sandboxes(), Local: local, Log: s.cfg.Logger, OrphanGrace: o.OrphanGrace}
	s.mgr.SetOperationDone(func(api.Operation) { node.Wake() })
	if o.SuspendShare != "" {
		node.Changed = func(ctx context.Context, id string, sb *api.Sandbox) { s.syncShare(ctx, cs.Sandboxes(), o, id, sb) }
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		mirrored, anchored := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(mirrored)
			s.mirrorSettings(ctx, cs, sealer, 2*time.Second)
		}()
		go func() {
			defer close(anchored)
			(auditAPI{s}).anchorAudit(ctx, cs.AuditHeads(), o.NodeID, o.Heartbeat)
		}()
		node.Run(ctx)
		<-mirrored
		<-anchored
	}()
	s.cfg.Logger.Info("joined the cluster", "node", o.NodeID, "advertise", o.Advertise, "cluster_listen", o.Listen, "heartbeat", o.Heartbeat)
	return func() {
		<-beat
		<-done
		stopListener()
		s.mgr.Creates().SetCreated(nil)
		s.mgr.SetOperationDone(nil)
		cs.Close()
	}, nil
}

// listenCluster opens the node's cluster listener: TLS 1.3 where only a
// replica's certificate from the cluster CA gets through.
func listenCluster(o ClusterNodeOptions) (net.Listener, error) {
	id, err := clustertls.Load(o.CAFile, o.CertFile, o.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("cluster listener: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	if id.Name != o.NodeID {
		return nil, fmt.Errorf("cluster certificate %s names %s/%s, not node %s: %w", o.CertFile, id.Role, id.Name, o.NodeID, errdefs.ErrInvalidArgument)
	}
	cfg, err := id.ServerConfig()
	if err != nil {
		return nil, fmt.Errorf("cluster listener: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	l, err := net.Listen("tcp", o.Listen)
	if err != nil {
		return nil, fmt.Errorf("cluster listener: %w", err)
	}
	return tls.NewListener(l, cfg), nil
}

// clusterRows is where a node records the sandboxes it creates.
type clusterRows struct {
	store *clusterstore.SandboxStore
	node  string
}

// PrincipalHeader carries, from a replica to a node over the cluster
// listener, the caller the replica authenticated (JSON of
// principal.Principal). A node reads it only from a connection whose
// client certificate is a replica's of the cluster CA; elsewhere it is
// ignored, and a bearer key is needed as ever.
const PrincipalHeader = "Space-Cluster-Principal"

// ForwardedProtoHeader carries, from a replica to a node, the scheme the
// caller used ("http" or "https"), for the URLs the node answers with.
// Like the principal, a node reads it only from a replica.
const ForwardedProtoHeader = "X-Forwarded-Proto"

// requestScheme is the scheme r's caller used: the replica's word for a
// request a replica forwarded, else this connection's.
func requestScheme(r *http.Request) string {
	if _, ok := r.Context().Value(replicaKey{}).(string); ok {
		if v := r.Header.Get(ForwardedProtoHeader); v == "http" || v == "https" {
			return v
		}
	}
	if r.TLS != nil {
		return "https"
	}
	return "http"
}

type replicaKey struct{}

// fromReplica marks requests of the cluster listener as vouched for by the
// replica whose certificate the TLS handshake verified.
func (s *Server) fromReplica(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil {
			writeError(w, r, fmt.Errorf("the cluster listener serves TLS only: %w", errdefs.ErrUnauthorized))
			return
		}
		role, name, err := clustertls.Peer(*r.TLS)
		if err != nil || role != clustertls.RoleReplica {
			writeError(w, r, fmt.Errorf("not a cluster replica: %w", errdefs.ErrUnauthorized))
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), replicaKey{}, name)))
	})
}

// replicaPrincipal is the caller a replica vouched for, when r came over
// the cluster listener.
func replicaPrincipal(r *http.Request) (principal.Principal, bool, error) {
	replica, ok := r.Context().Value(replicaKey{}).(string)
	if !ok {
		return principal.Principal{}, false, nil
	}
	var p principal.Principal
	h := r.Header.Get(PrincipalHeader)
	if h == "" {
		return p, true, fmt.Errorf("replica %s sent no %s: %w", replica, PrincipalHeader, errdefs.ErrUnauthorized)
	}
	if err := json.Unmarshal([]byte(h), &p); err != nil {
		return p, true, fmt.Errorf("replica %s: %s: %v: %w", replica, PrincipalHeader, err, errdefs.ErrUnauthorized)
	}
	if err := tenancy.ValidTenant(p.Tenant); err != nil {
		return p, true, fmt.Errorf("replica %s: %w", replica, err)
	}
	scopes, err := tenancy.ValidScopes(p.Scopes)
	if err != nil {
		return p, true, fmt.Errorf("replica %s: %w", replica, err)
	}
	p.Scopes = scopes
	return p, true, nil
}

type idemKeyCtx struct{}

// withIdempotencyKey carries a create's Idempotency-Key to recordSandbox.
func withIdempotencyKey(ctx context.Context, key string) context.Context {
	if key == "" {
		return ctx
	}
	return context.WithValue(ctx, idemKeyCtx{}, key)
}

// recordSandbox is the manager's CreatedFunc on a node: it writes the row
// of a sandbox this node just made (a create through any API, or a fork's
// child), with the caller's idempotency key, before the call is answered,
// so a sandbox is in the cluster's state as soon as its id exists. When the
// row cannot be written the manager deletes the sandbox and the call
// fails; a key the tenant already used is ErrConflict naming the sandbox
// that has it.
func (cr *clusterRows) recordSandbox(ctx context.Context, sb api.Sandbox, op api.Operation, req api.CreateSandboxRequest) error {
	key, _ := ctx.Value(idemKeyCtx{}).(string)
	err := cr.store.AddSandboxRecord(ctx, clusterstore.NewSandbox{ID: sb.ID, Node: cr.node, Tenant: sb.Tenant,
		IdempotencyKey: key, CreateOperation: op.ID, Request: req})
	if errors.Is(err, clusterstore.ErrIdempotencyKeyUsed) {
		if other, gerr := cr.store.SandboxByKey(ctx, sb.Tenant, key); gerr == nil {
			return fmt.Errorf("idempotency key %q was used by sandbox %s: %w", key, other.ID, clusterstore.ErrIdempotencyKeyUsed)
		}
	}
	return err
}

// clusterLocal is the node's sandbox manager as the reconciler sees it:
// the server's own work (build steps) is not the cluster's business, and
// the manager already hides warm-pool members.
type clusterLocal struct{ mgr *sandbox.Manager }

var _ cluster.Local = (*clusterLocal)(nil)

func (l *clusterLocal) List(ctx context.Context) ([]api.Sandbox, error) {
	all, err := l.mgr.List(ctx, "", nil)
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, sb := range all {
		if sb.Labels[sandbox.BuildLabel] == "" {
			out = append(out, sb)
		}
	}
	return out, nil
}

// Apply runs a verb a replica asked for: the manager's policy decides it,
// as it does the same verb asked of this node directly.
func (l *clusterLocal) Apply(ctx context.Context, id, verb string) error {
	op, err := l.mgr.Verbs().Lifecycle(ctx, id, verb, verb == api.OpDelete)
	return l.wait(ctx, op, err, verb)
}

// Discard deletes an orphan or a stale copy: the node's own cleanup, which
// no tenant's rule decides.
func (l *clusterLocal) Discard(ctx context.Context, id string) error {
	op, err := l.mgr.Verbs().Discard(ctx, id)
	return l.wait(ctx, op, err, api.OpDelete)
}

func (l *clusterLocal) wait(ctx context.Context, op api.Operation, err error, verb string) error {
	if err != nil {
		return err
	}
	op, err = l.mgr.Verbs().Wait(ctx, op.ID)
	if err != nil {
		return err
	}
	if op.State == api.OpFailed {
		if op.Error != nil {
			return errors.New(op.Error.Message)
		}
		return fmt.Errorf("%s failed", verb)
	}
	return nil
}

// mirrorSettings keeps this node's tenants and policy rule sets — and, with
// the cluster's secrets key (sealer), its secrets — equal to the cluster's
// (PostgreSQL is the truth in a cluster: a rule set attached only here is
// removed), woken by NOTIFY and polling every interval anyway.
func (s *Server) mirrorSettings(ctx context.Context, cs *clusterstore.Store, sealer *secrets.Sealer, every time.Duration) {
	wake := make(chan struct{}, 1)
	go cs.Settings().ListenSettings(ctx, func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	})
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if err := s.applySettings(ctx, cs.Settings()); err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("cluster: mirroring tenants and policies", "err", err)
		}
		if sealer != nil {
			if err := s.applySecrets(ctx, cs.Secrets(), sealer); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Warn("cluster: mirroring secrets", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-t.C:
		}
	}
}

// applySettings makes one pass of mirrorSettings.
func (s *Server) applySettings(ctx context.Context, cs *clusterstore.SettingsStore) error {
	want, err := cs.Settings(ctx)
	if err != nil {
		return err
	}
	var errs []error
	for _, t := range want.Tenants {
		have, err := s.keys.GetTenant(ctx, t.Name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if sameJSON(have.Quotas, t.Quotas) && sameJSON(have.Boundary, t.Boundary) {
			continue
		}
		if _, err := s.keys.PutTenant(ctx, t); err != nil {
			errs = append(errs, fmt.Errorf("tenant %s: %w", t.Name, err))
			continue
		}
		s.cfg.Logger.Info("cluster: tenant settings mirrored", "tenant", t.Name)
	}
	have := map[string]api.PolicyRuleSet{}
	for _, rs := range s.policy.ListRules() {
		have[rs.Scope] = rs
	}
	changed := false
	for _, rs := range want.Rules {
		cur, ok := have[rs.Scope]
		delete(have, rs.Scope)
		if ok && sameJSON(cur.Rules, rs.Rules) {
			continue
		}
		if _, err := s.policy.SetRules(ctx, rs.Scope, api.PolicyRuleSet{Rules: rs.Rules}); err != nil {
			errs = append(errs, fmt.Errorf("policy rules of %s: %w", rs.Scope, err))
			continue
		}
		changed = true
	}
	for scope := range have {
		if err := s.policy.DeleteRules(ctx, scope); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			errs = append(errs, fmt.Errorf("policy rules of %s: %w", scope, err))
			continue
		}
		changed = true
	}
	if changed {
		s.cfg.Logger.Info("cluster: policy rule sets mirrored", "sets", len(want.Rules))
		s.decisionScopeChanged()
	}
	errs = append(errs, s.applyPools(ctx, want.Pools))
	return errors.Join(errs...)
}

// applyPools makes this node's warm pools the cluster's, keeping its own
// --pool-default (the default pool, set on its command line).
func (s *Server) applyPools(ctx context.Context, want map[string]api.PoolSpec) error {
	var errs []error
	for id, spec := range want {
		changed, err := s.mgr.WarmPools().MirrorPool(ctx, id, spec)
		if err != nil {
			errs = append(errs, fmt.Errorf("warm pool %s: %w", id, err))
			continue
		}
		if changed {
			s.cfg.Logger.Info("cluster: warm pool mirrored", "pool", id, "template", spec.Template, "min", spec.Min, "max", spec.Max)
		}
	}
	own := ""
	if s.cfg.PoolDefault > 0 {
		own = s.mgr.WarmPools().DefaultPoolID(ctx)
	}
	for _, p := range s.mgr.WarmPools().Pools(ctx) {
		if _, ok := want[p.ID]; ok || p.ID == own {
			continue
		}
		if err := s.mgr.WarmPools().DeletePool(ctx, p.ID); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			errs = append(errs, fmt.Errorf("warm pool %s: %w", p.ID, err))
			continue
		}
		s.cfg.Logger.Info("cluster: warm pool removed (the cluster has none by its id)", "pool", p.ID)
	}
	return errors.Join(errs...)
}

// warmNames lists, once per ready member of each warm pool, the names of
// the template the member was made from (digest and tags, as a node's
// Templates names them), for placement to prefer this node.
func warmNames(pools []api.Pool, tmpls []api.Template) []string {
	var out []string
	for _, p := range pools {
		if p.Ready == 0 || p.TemplateDigest == "" {
			continue
		}
		names := []string{p.TemplateDigest}
		for _, t := range tmpls {
			if t.Digest == p.TemplateDigest {
				names = append(names, t.Tags...)
			}
		}
		for range p.Ready {
			out = append(out, names...)
		}
	}
	return out
}

func sameJSON(a, b any) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// shareDir is where sandbox id is exported on the suspend share.
func shareDir(o ClusterNodeOptions, id string) string {
	return filepath.Join(o.SuspendShare, id)
}

// syncShare keeps the suspend share in step with this node's sandboxes: a
// sandbox that became suspended is exported; one that left that state (or
// is gone) loses its export — but only while its row is this node's: after
// a move the share belongs to the node that has the row.
func (s *Server) syncShare(ctx context.Context, cs *clusterstore.SandboxStore, o ClusterNodeOptions, id string, sb *api.Sandbox) {
	dir := shareDir(o, id)
	if sb != nil && sb.State == api.StateSuspended {
		if _, err := os.Stat(dir); err == nil {
			return
		}
		t0 := time.Now()
		if err := s.mgr.Verbs().ExportSuspended(principal.With(ctx, principal.System), id, dir); err != nil {
			s.cfg.Logger.Warn("cluster: exporting a suspended sandbox to the share", "sandbox", id, "err", err)
			return
		}
		s.cfg.Logger.Info("cluster: suspended sandbox exported to the share", "sandbox", id, "took", time.Since(t0))
		return
	}
	if row, err := cs.GetSandbox(ctx, id); err == nil && row.Node != o.NodeID {
		return
	}
	if _, err := os.Stat(dir); err == nil {
		if err := os.RemoveAll(dir); err != nil {
			s.cfg.Logger.Warn("cluster: removing a stale export", "sandbox", id, "err", err)
		}
	}
}

// adoptPath is the cluster listener's own route: a replica moving a lost
// node's suspended sandbox here.
const adoptPath = "/v1/cluster/adopt/"

// clusterRoutes is the API the cluster listener serves: the server's own,
// plus adoption of a sandbox from the suspend share.
func (s *Server) clusterRoutes(o ClusterNodeOptions) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, ok := strings.CutPrefix(r.URL.Path, adoptPath)
		if !ok {
			s.handler.ServeHTTP(w, r)
			return
		}
		if r.Method != http.MethodPost {
			writeError(w, r, fmt.Errorf("%s %s: use POST: %w", r.Method, r.URL.Path, errdefs.ErrInvalidArgument))
			return
		}
		if o.SuspendShare == "" {
			writeError(w, r, fmt.Errorf("node %s has no --suspend-share: %w", o.NodeID, errdefs.ErrNotSupported))
			return
		}
		if id == "" || strings.ContainsAny(id, "/.") || len(id) > 64 {
			writeError(w, r, fmt.Errorf("sandbox id %q: %w", id, errdefs.ErrInvalidArgument))
			return
		}
		sb, err := s.mgr.Verbs().ImportSuspended(principal.With(r.Context(), principal.System), shareDir(o, id))
		if err != nil {
			writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, sb)
	})
}
