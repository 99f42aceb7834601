// Package replica is a cluster's API replica (`space server --store
// postgres://…`): it holds no sandbox. It authenticates callers against
// the keys in PostgreSQL, places each create on a node and forwards it
// there, and proxies every call that names a sandbox to the node the
// cluster store says runs it, over mutual TLS from the cluster CA
// (internal/clustertls), vouching for the caller in server.PrincipalHeader.
// Replicas share nothing but PostgreSQL, so any number can run behind one
// address.
//
// Its routes are the server's route table (server.Routes), each served as
// its Disposition says, plus its own (routes.go). It imports the server's
// exported pieces; the server never imports it.
package replica

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/server"
)

// Config configures an API replica.
type Config struct {
	Store   string // the cluster's PostgreSQL DSN
	Listen  string // the API's address, as server.Config.Listen
	DataDir string // where the first admin key is written (api-key)
	// CAFile, CertFile, KeyFile: the cluster CA's certificate and this
	// replica's certificate and key (role replica).
	CAFile, CertFile, KeyFile string
	// SecretsKeyFile is the cluster's secrets key; without it the replica
	// refuses the secrets routes (it could not seal what it stores).
	SecretsKeyFile string
	// NodeTimeout is how late a node's heartbeat may be before it gets no
	// new sandboxes and is marked lost (default 10 s).
	NodeTimeout time.Duration
	// DefaultMemMiB is what placement charges a create that names no
	// memory limit (default 512).
	DefaultMemMiB int64
	Logger        *slog.Logger
	APIKeyOut     *os.File
}

func (c *Config) defaults() {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.APIKeyOut == nil {
		c.APIKeyOut = os.Stderr
	}
	if c.NodeTimeout <= 0 {
		c.NodeTimeout = 10 * time.Second
	}
	if c.DefaultMemMiB <= 0 {
		c.DefaultMemMiB = 512
	}
}

// Replica is a running API replica: the parts below, each serving its
// routes, over one cluster store and one client of the nodes.
type Replica struct {
	cfg   Config
	store *clusterstore.Store
	id    *clustertls.Identity

	nodes     *nodeClient
	keys      *keyring
	sandboxes *sandboxes
	settings  *settings
	templates *templates
	nodeAdmin *nodeAdmin
	approvals *approvals
	pools     *pools
	secrets   *clusterSecrets
	e2b       *e2bAPI

	reg      *prometheus.Registry
	requests *prometheus.CounterVec // by method and status
	// self is the replica's in-process connection to its own handler, for
	// the /mcp handler's tool calls.
	self *server.SelfConn
}

// New connects to the cluster store (migrating it), loads the replica's
// certificate, and stores a first admin key if the cluster has none
// (written to DataDir/api-key, as a single box does).
func New(ctx context.Context, cfg Config) (*Replica, error) {
	cfg.defaults()
	if cfg.CAFile == "" || cfg.CertFile == "" || cfg.KeyFile == "" {
		return nil, fmt.Errorf("a replica needs the cluster CA, its certificate and its key (--cluster-ca, --cluster-cert, --cluster-key): %w", errdefs.ErrInvalidArgument)
	}
	id, err := clustertls.Load(cfg.CAFile, cfg.CertFile, cfg.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	if id.Role != clustertls.RoleReplica {
		return nil, fmt.Errorf("%s is a %s certificate; a replica needs a replica's: %w", cfg.CertFile, id.Role, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, err
	}
	cs, err := clusterstore.Open(ctx, cfg.Store)
	if err != nil {
		return nil, err
	}
	r := assemble(cfg, partsOf(cs), id)
	r.store = cs
	if cfg.SecretsKeyFile != "" {
		if r.secrets.sealer, err = server.LoadClusterSealer(cfg.SecretsKeyFile); err != nil {
			cs.Close()
			return nil, err
		}
	}
	if err := r.keys.firstKey(ctx, cfg.DataDir, cfg.APIKeyOut); err != nil {
		cs.Close()
		return nil, err
	}
	return r, nil
}

// storeParts is what a replica uses of the cluster store, part by part:
// each field is one of clusterstore.Store's parts, seen through the narrow
// interfaces of the replica's pieces that use it, and each piece gets only
// the parts it needs (tests give fakes).
type storeParts struct {
	nodes interface {
		nodeStore
		nodeAdminStore
	}
	sandboxes interface {
		sandboxStore
		sandboxCounter
	}
	keys     keyStore
	settings interface {
		settingsStore
		poolStore
	}
	secrets secretStore
	audit   auditHeadStore
}

// partsOf is the parts of cluster store cs.
func partsOf(cs *clusterstore.Store) storeParts {
	return storeParts{nodes: cs.Nodes(), sandboxes: cs.Sandboxes(), keys: cs.Keys(),
		settings: cs.Settings(), secrets: cs.Secrets(), audit: cs.AuditHeads()}
}

// assemble makes a replica's pieces over the store's parts.
func assemble(cfg Config, st storeParts, id *clustertls.Identity) *Replica {
	cfg.defaults()
	nodes := newNodeClient(st.nodes, st.sandboxes, id, cfg.Logger, cfg.NodeTimeout)
	keys := newKeyring(st.keys)
	quota := sandboxQuota{tenants: st.settings, rows: st.sandboxes}
	r := &Replica{cfg: cfg, id: id, nodes: nodes, keys: keys,
		sandboxes: &sandboxes{store: st.sandboxes, quota: quota, nodes: nodes, keys: keys, defaultMemMiB: cfg.DefaultMemMiB, log: cfg.Logger},
		settings:  &settings{store: st.settings, rows: st.sandboxes, nodes: nodes},
		templates: &templates{nodes: nodes},
		nodeAdmin: &nodeAdmin{store: st.nodes, heads: st.audit, nodes: nodes},
		approvals: &approvals{nodes: nodes},
		pools:     &pools{store: st.settings, nodes: nodes},
		secrets:   &clusterSecrets{store: st.secrets},
		e2b:       &e2bAPI{nodes: nodes, keys: keys, quota: quota, defaultMemMiB: cfg.DefaultMemMiB},
	}
	r.self = server.NewSelfConn(func() *http.Server { return server.NewHTTPServer(r.Handler()) })
	r.reg = prometheus.NewRegistry()
	r.requests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "space_replica_http_requests_total", Help: "API requests a cluster replica answered, by method and status."}, []string{"method", "code"})
	r.reg.MustRegister(r.requests, nodes.placements, nodes.nodeErrors, nodes.forwarded)
	return r
}

// Close closes the store and idle connections to nodes.
func (r *Replica) Close() {
	r.self.Close()
	r.nodes.closeIdle()
	if r.store != nil {
		r.store.Close()
	}
}

// Run serves a replica until ctx ends, marking late nodes lost.
func Run(ctx context.Context, cfg Config) error {
	r, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	defer r.Close()
	l, err := server.Listen(r.cfg.Listen)
	if err != nil {
		return err
	}
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	watched, err := cluster.WatchLost(wctx, r.store.Nodes(), r.cfg.NodeTimeout, func(ids []string) {
		r.cfg.Logger.Warn("cluster nodes lost", "nodes", ids, "timeout", r.cfg.NodeTimeout)
	}, r.cfg.Logger)
	if err != nil {
		return err
	}
	hs := server.NewHTTPServer(r.Handler())
	r.cfg.Logger.Info("space cluster replica listening", "addr", l.Addr().String(), "replica", r.id.Name)
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(l) }()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		hs.Shutdown(sctx)
		err = nil
	case err = <-errc:
	}
	stop()
	<-watched
	return err
}
