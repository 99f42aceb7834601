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
	goruntime "runtime"
	"slices"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
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
	s.clusterRows.Store(&clusterRows{store: cs, node: o.NodeID})
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
		return st, nil
	}
	// The cluster listener serves before the first heartbeat advertises it.
	var hs *http.Server
	served := make(chan struct{})
	if tlsLn != nil {
		hs = s.HTTPServer()
		hs.Handler = s.fromReplica(s.handler)
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
	beat, err := cluster.Beat(ctx, cs, o.Heartbeat, status, s.cfg.Logger)
	if err != nil {
		stopListener()
		s.clusterRows.Store(nil)
		cs.Close()
		return nil, fmt.Errorf("joining the cluster: %w", err)
	}
	node := &cluster.Node{ID: o.NodeID, Store: cs, Local: local, Log: s.cfg.Logger, OrphanGrace: o.OrphanGrace}
	done := make(chan struct{})
	go func() {
		defer close(done)
		node.Run(ctx)
	}()
	s.cfg.Logger.Info("joined the cluster", "node", o.NodeID, "advertise", o.Advertise, "cluster_listen", o.Listen, "heartbeat", o.Heartbeat)
	return func() {
		<-beat
		<-done
		stopListener()
		s.clusterRows.Store(nil)
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
	store *clusterstore.Store
	node  string
}

// PrincipalHeader carries, from a replica to a node over the cluster
// listener, the caller the replica authenticated (JSON of
// principal.Principal). A node reads it only from a connection whose
// client certificate is a replica's of the cluster CA; elsewhere it is
// ignored, and a bearer key is needed as ever.
const PrincipalHeader = "Space-Cluster-Principal"

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

// recordClusterSandbox writes the row of a sandbox this node just created
// (with the caller's idempotency key), before the create is answered: a
// sandbox a replica placed here is in the cluster's state as soon as its
// id exists. When the row cannot be written the sandbox is deleted and
// the create fails; a key the tenant already used is ErrConflict naming
// the sandbox that has it.
func (s *Server) recordClusterSandbox(ctx context.Context, sb api.Sandbox, op api.Operation, idemKey string, req api.CreateSandboxRequest) error {
	cr := s.clusterRows.Load()
	if cr == nil {
		return nil
	}
	err := cr.store.AddSandboxRecord(ctx, clusterstore.NewSandbox{ID: sb.ID, Node: cr.node, Tenant: sb.Tenant,
		IdempotencyKey: idemKey, CreateOperation: op.ID, Request: req})
	if err == nil {
		return nil
	}
	if _, derr := s.mgr.Lifecycle(principal.With(context.WithoutCancel(ctx), principal.System), sb.ID, api.OpDelete, true); derr != nil {
		s.cfg.Logger.Warn("cluster: deleting a sandbox whose row was refused", "sandbox", sb.ID, "err", derr)
	}
	if errors.Is(err, clusterstore.ErrIdempotencyKeyUsed) {
		if other, gerr := cr.store.SandboxByKey(ctx, sb.Tenant, idemKey); gerr == nil {
			return fmt.Errorf("idempotency key %q was used by sandbox %s: %w", idemKey, other.ID, clusterstore.ErrIdempotencyKeyUsed)
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

func (l *clusterLocal) Apply(ctx context.Context, id, verb string) error {
	op, err := l.mgr.Lifecycle(ctx, id, verb, verb == api.OpDelete)
	if err != nil {
		return err
	}
	op, err = l.mgr.Wait(ctx, op.ID)
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
