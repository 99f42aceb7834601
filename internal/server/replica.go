package server

// A cluster's API replica (`space server --store postgres://…`): it holds
// no sandbox. It authenticates callers against the keys in PostgreSQL,
// places each create on a node and forwards it there, and proxies every
// call that names a sandbox to the node the cluster store says runs it,
// over mutual TLS from the cluster CA (internal/clustertls), vouching for
// the caller in PrincipalHeader. Replicas share nothing but PostgreSQL, so
// any number can run behind one address.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/e2b"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/tenancy"
)

// ReplicaConfig configures an API replica.
type ReplicaConfig struct {
	Store   string // the cluster's PostgreSQL DSN
	Listen  string // the API's address, as Config.Listen
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

// keyCacheTTL bounds how long a replica trusts a key it looked up: a key
// revoked through one replica stops working at every replica within it.
const keyCacheTTL = 2 * time.Second

// Replica is a running API replica.
type Replica struct {
	cfg   ReplicaConfig
	store *clusterstore.Store
	id    *clustertls.Identity

	mu         sync.Mutex
	keys       map[string]cachedKey       // digest → key
	transports map[string]*http.Transport // node id + address → its mutual-TLS transport

	reg        *prometheus.Registry
	requests   *prometheus.CounterVec   // by method and status
	placements *prometheus.CounterVec   // creates placed, by node
	nodeErrors *prometheus.CounterVec   // calls a node did not answer, by node
	forwarded  *prometheus.HistogramVec // time to a node's answer headers, by node

	// self is the replica's in-process connection to its own handler, for
	// the /mcp handler's tool calls.
	self selfConn
	// sealer seals secrets for PostgreSQL (nil: no --cluster-secrets-key).
	sealer *secrets.Sealer
}

type cachedKey struct {
	key     api.APIKey
	expires time.Time
}

// NewReplica connects to the cluster store (migrating it), loads the
// replica's certificate, and stores a first admin key if the cluster has
// none (written to DataDir/api-key, as a single box does).
func NewReplica(ctx context.Context, cfg ReplicaConfig) (*Replica, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.APIKeyOut == nil {
		cfg.APIKeyOut = os.Stderr
	}
	if cfg.NodeTimeout <= 0 {
		cfg.NodeTimeout = 10 * time.Second
	}
	if cfg.DefaultMemMiB <= 0 {
		cfg.DefaultMemMiB = 512
	}
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
	r := &Replica{cfg: cfg, store: cs, id: id, keys: map[string]cachedKey{}, transports: map[string]*http.Transport{}}
	if cfg.SecretsKeyFile != "" {
		if r.sealer, err = loadSealer(cfg.SecretsKeyFile); err != nil {
			cs.Close()
			return nil, err
		}
	}
	r.self.serve = func() *http.Server {
		return &http.Server{Handler: r.Handler(), ReadHeaderTimeout: headerTimeout, IdleTimeout: idleTimeout}
	}
	r.initMetrics()
	if err := r.firstKey(ctx); err != nil {
		cs.Close()
		return nil, err
	}
	return r, nil
}

// firstKey stores DataDir/api-key (made now if missing) as the cluster's
// admin key when the cluster has no key yet; with keys present the file is
// only the operator's local credential, as on a single box.
func (r *Replica) firstKey(ctx context.Context) error {
	keys, err := r.store.Keys(ctx, "")
	if err != nil || len(keys) > 0 {
		return err
	}
	secret, err := loadOrCreateAPIKey(r.cfg.DataDir, r.cfg.APIKeyOut)
	if err != nil {
		return err
	}
	k, dig, err := tenancy.NewKey(api.CreateKeyRequest{Name: "admin", Tenant: principal.DefaultTenant, Scopes: []string{principal.ScopeAdmin}}, secret)
	if err != nil {
		return err
	}
	stored, err := r.store.AddFirstKey(ctx, k, dig)
	if err == nil && !stored {
		// Another replica stored its own first; this file's key is not one.
		os.Remove(filepath.Join(r.cfg.DataDir, "api-key"))
	}
	return err
}

// Close closes the store and idle connections to nodes.
func (r *Replica) Close() {
	r.self.close()
	r.mu.Lock()
	for _, t := range r.transports {
		t.CloseIdleConnections()
	}
	r.mu.Unlock()
	r.store.Close()
}

// RunReplica serves a replica until ctx ends, marking late nodes lost.
func RunReplica(ctx context.Context, cfg ReplicaConfig) error {
	r, err := NewReplica(ctx, cfg)
	if err != nil {
		return err
	}
	defer r.Close()
	l, err := Listen(cfg.Listen)
	if err != nil {
		return err
	}
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	watched, err := cluster.WatchLost(wctx, r.store, r.cfg.NodeTimeout, func(ids []string) {
		r.cfg.Logger.Warn("cluster nodes lost", "nodes", ids, "timeout", r.cfg.NodeTimeout)
	}, r.cfg.Logger)
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: r.Handler(), ReadHeaderTimeout: headerTimeout, IdleTimeout: idleTimeout}
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

// authenticate returns the principal of the request's key, from the
// cluster's keys (cached for keyCacheTTL).
func (r *Replica) authenticate(req *http.Request) (principal.Principal, error) {
	tok, ok := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return principal.Principal{}, fmt.Errorf("missing API key (Authorization: Bearer <key>): %w", errdefs.ErrUnauthorized)
	}
	return r.authenticateKey(req.Context(), tok)
}

// authenticateKey returns the principal of a cluster API key.
func (r *Replica) authenticateKey(ctx context.Context, tok string) (principal.Principal, error) {
	dig := tenancy.Digest(tok)
	r.mu.Lock()
	c, ok := r.keys[dig]
	r.mu.Unlock()
	if !ok || time.Now().After(c.expires) {
		k, err := r.store.LiveKey(ctx, dig)
		if err != nil {
			return principal.Principal{}, err
		}
		c = cachedKey{key: k, expires: time.Now().Add(keyCacheTTL)}
		r.mu.Lock()
		if len(r.keys) > 10000 {
			clear(r.keys)
		}
		r.keys[dig] = c
		r.mu.Unlock()
	}
	return principal.Principal{KeyID: c.key.ID, KeyName: c.key.Name, Tenant: c.key.Tenant, Scopes: slices.Clone(c.key.Scopes)}, nil
}

// authed is the replica's access check: a valid key holding scope.
func (r *Replica) authed(scope string, h func(http.ResponseWriter, *http.Request, principal.Principal)) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		p, err := r.authenticate(req)
		if err != nil {
			writeError(w, req, err)
			return
		}
		if scope != "" && !p.Can(scope) {
			writeError(w, req, fmt.Errorf("this API key (%s) lacks the %s scope: %w", p.KeyName, scope, errdefs.ErrPermissionDenied))
			return
		}
		h(w, req.WithContext(principal.With(req.Context(), p)), p)
	}
}

func (r *Replica) initMetrics() {
	r.reg = prometheus.NewRegistry()
	r.requests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "space_replica_http_requests_total", Help: "API requests a cluster replica answered, by method and status."}, []string{"method", "code"})
	r.placements = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "space_replica_placements_total", Help: "Creates a cluster replica placed, by node."}, []string{"node"})
	r.nodeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "space_replica_node_errors_total", Help: "Calls to a node that got no answer, by node."}, []string{"node"})
	r.forwarded = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "space_replica_node_seconds", Help: "Time from a proxied call to the node's answer headers, by node.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"node"})
	r.reg.MustRegister(r.requests, r.placements, r.nodeErrors, r.forwarded)
}

// countingTransport times a node's answers and counts the calls it left
// unanswered.
type countingTransport struct {
	next http.RoundTripper
	node string
	r    *Replica
}

func (t countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t0 := time.Now()
	resp, err := t.next.RoundTrip(req)
	if err != nil {
		if req.Context().Err() == nil {
			t.r.nodeErrors.WithLabelValues(t.node).Inc()
		}
		return nil, err
	}
	t.r.forwarded.WithLabelValues(t.node).Observe(time.Since(t0).Seconds())
	return resp, nil
}

// Handler is the replica's API.
func (r *Replica) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, req *http.Request) { writeJSON(w, 200, map[string]bool{"ok": true}) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST /v1/sandboxes", r.authed(principal.ScopeSandboxWrite, r.create))
	mux.HandleFunc("GET /v1/sandboxes", r.authed(principal.ScopeSandboxRead, r.list))
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", r.authed(principal.ScopeSandboxWrite, r.delete))
	mux.HandleFunc("GET /v1/sandboxes/{id}", r.authed(principal.ScopeSandboxRead, r.get))
	mux.HandleFunc("POST /v1/sandboxes/{id}/wake", r.authed(principal.ScopeSandboxWrite, r.wake))
	// Everything else about a sandbox goes to its node, which checks the
	// scope and the tenant as it always does. Attach and port routes carry
	// their own tokens, which the node checks: they pass without a key.
	mux.HandleFunc("/v1/sandboxes/{id}/{rest...}", r.sandboxCall)
	mux.HandleFunc("GET /v1/operations/{id}", r.authed(principal.ScopeSandboxRead, r.operation))
	mux.HandleFunc("GET /v1/nodes", r.authed(principal.ScopeAdmin, r.nodes))
	mux.HandleFunc("POST /v1/nodes/{node}/drain", r.authed(principal.ScopeAdmin, r.drainNode))
	mux.HandleFunc("POST /v1/nodes/{node}/undrain", r.authed(principal.ScopeAdmin, r.drainNode))
	mux.HandleFunc("GET /v1/info", r.authed("", r.info))
	mux.HandleFunc("POST /v1/keys", r.authed(principal.ScopeAdmin, r.createKey))
	mux.HandleFunc("GET /v1/keys", r.authed(principal.ScopeAdmin, r.listKeys))
	mux.HandleFunc("DELETE /v1/keys/{keyid}", r.authed(principal.ScopeAdmin, r.revokeKey))
	mux.HandleFunc("GET /v1/tenants", r.authed(principal.ScopeAdmin, r.listTenants))
	mux.HandleFunc("GET /v1/tenants/{name}", r.authed("", r.getTenant))
	mux.HandleFunc("PUT /v1/tenants/{name}", r.authed(principal.ScopeAdmin, r.putTenant))
	mux.HandleFunc("GET /v1/policy/rules", r.authed(principal.ScopePolicyRead, r.listRules))
	mux.HandleFunc("GET /v1/policy/rules/{scope}", r.authed(principal.ScopePolicyRead, r.getRules))
	mux.HandleFunc("PUT /v1/policy/rules/{scope}", r.authed(principal.ScopePolicyWrite, r.putRules))
	mux.HandleFunc("DELETE /v1/policy/rules/{scope}", r.authed(principal.ScopePolicyWrite, r.deleteRules))
	mux.HandleFunc("GET /v1/templates", r.authed(principal.ScopeTemplatesRead, r.listTemplates))
	mux.HandleFunc("GET /v1/templates/{ref}", r.authed(principal.ScopeTemplatesRead, r.templateCall))
	mux.HandleFunc("GET /v1/templates/{ref}/export", r.authed(principal.ScopeTemplatesRead, r.templateCall))
	mux.HandleFunc("POST /v1/templates", r.authed(principal.ScopeTemplatesWrite, r.templateWrite))
	mux.HandleFunc("POST /v1/templates/pull", r.authed(principal.ScopeTemplatesWrite, r.templateWrite))
	mux.HandleFunc("POST /v1/templates/build", r.authed(principal.ScopeTemplatesWrite, r.templateWrite))
	mux.HandleFunc("GET /v1/pools", r.authed(principal.ScopeAdmin, r.listPools))
	mux.HandleFunc("PUT /v1/pools", r.authed(principal.ScopeAdmin, r.putPool))
	mux.HandleFunc("GET /v1/pools/{id}", r.authed(principal.ScopeAdmin, r.getPool))
	mux.HandleFunc("DELETE /v1/pools/{id}", r.authed(principal.ScopeAdmin, r.deletePool))
	mux.HandleFunc("GET /v1/approvals", r.authed(principal.ScopePolicyRead, r.listApprovals))
	mux.HandleFunc("POST /v1/approvals/{id}/{verb}", r.authed(principal.ScopePolicyWrite, r.answerApproval))
	mux.HandleFunc("GET /v1/secrets", r.authed(principal.ScopeSecretsRead, r.listSecrets))
	mux.HandleFunc("GET /v1/secrets/{name}", r.authed(principal.ScopeSecretsRead, r.getSecret))
	mux.HandleFunc("PUT /v1/secrets/{name}", r.authed(principal.ScopeSecretsWrite, r.setSecret))
	mux.HandleFunc("DELETE /v1/secrets/{name}", r.authed(principal.ScopeSecretsWrite, r.deleteSecret))
	mux.HandleFunc("GET /v1/audit/heads", r.authed(principal.ScopeAdmin, r.auditHeads))
	mux.HandleFunc("DELETE /v1/audit/heads/{node}", r.authed(principal.ScopeAdmin, r.forgetAuditHead))
	mux.HandleFunc("GET /v1/audit", r.authed(principal.ScopeAuditRead, r.nodeAudit))
	mux.HandleFunc("GET /v1/audit/export", r.authed(principal.ScopeAuditRead, r.nodeAudit))
	mux.HandleFunc("GET /v1/audit/key", r.authed(principal.ScopeAuditRead, r.nodeAudit))
	// MCP: the same tools as a node's, whose calls come back to this
	// replica (and so reach every node).
	mcpH := newMCPHandler(r.self.transport, r.cfg.Logger)
	mux.HandleFunc("POST /mcp", r.authed("", func(w http.ResponseWriter, req *http.Request, _ principal.Principal) { mcpH.ServeHTTP(w, req) }))
	// E2B's API: control plane and envd, each call to its sandbox's node.
	mux.HandleFunc(e2b.Prefix+"/", r.e2bCall)
	mux.HandleFunc(e2b.SignedFilesPath, r.e2bCall)
	mux.HandleFunc("/", func(w http.ResponseWriter, req *http.Request) {
		writeError(w, req, fmt.Errorf("%s %s is not served by a cluster replica (it serves sandboxes, their operations, templates, warm pools, keys, tenants, policy rules, approvals, secrets, nodes and their audit logs); call a node's own API for the rest: %w",
			req.Method, req.URL.Path, errdefs.ErrNotSupported))
	})
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		defer func() { r.requests.WithLabelValues(req.Method, strconv.Itoa(sw.code)).Inc() }()
		// Host-routed port traffic (<port>-<id>.<domain>) goes to the
		// sandbox's node with its Host, as a node's own would be served.
		if id, _, ok := hostRoute(req.Host); ok {
			r.hostCall(sw, req, id)
			return
		}
		mux.ServeHTTP(sw, req)
	})
}

// nodeOf is the node row of a sandbox the caller may see (404 otherwise,
// exactly as for a sandbox that does not exist).
func (r *Replica) sandboxRow(ctx context.Context, id string, p *principal.Principal) (clusterstore.Sandbox, error) {
	row, err := r.store.GetSandbox(ctx, id)
	if err != nil {
		return row, err
	}
	if p != nil && !p.Sees(row.Tenant) {
		return clusterstore.Sandbox{}, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return row, nil
}

// node returns the row of node id.
func (r *Replica) node(ctx context.Context, id string) (clusterstore.Node, error) {
	nodes, err := r.store.Nodes(ctx)
	if err != nil {
		return clusterstore.Node{}, err
	}
	for _, n := range nodes {
		if n.ID == id {
			return n, nil
		}
	}
	return clusterstore.Node{}, fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
}

// transport is the mutual-TLS transport to node n (HTTP/1.1: attach and
// port streams upgrade the connection).
func (r *Replica) transport(n clusterstore.Node) (http.RoundTripper, error) {
	key := n.ID + "\x00" + n.Address
	r.mu.Lock()
	defer r.mu.Unlock()
	if t, ok := r.transports[key]; ok {
		return countingTransport{next: t, node: n.ID, r: r}, nil
	}
	cfg, err := r.id.ClientConfig(n.ID)
	if err != nil {
		return nil, err
	}
	t := &http.Transport{
		TLSClientConfig:     cfg,
		DialContext:         (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	r.transports[key] = t
	return countingTransport{next: t, node: n.ID, r: r}, nil
}

// nodeURL is the base URL of a node's cluster listener.
func nodeURL(n clusterstore.Node) (*url.URL, error) {
	u, err := url.Parse(n.Address)
	if err != nil || u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("node %s advertises %q, not an https:// cluster listener: %w", n.ID, n.Address, errdefs.ErrUnavailable)
	}
	return u, nil
}

// errNodeDown is a node the replica could not reach (or that is lost).
func errNodeDown(n clusterstore.Node, err error) error {
	if n.State == clusterstore.NodeLost {
		return fmt.Errorf("node %s is lost (%s): %w", n.ID, n.StateReason, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("node %s did not answer: %v: %w", n.ID, err, errdefs.ErrUnavailable)
}

// proxy forwards req to node n as caller p (nil: as nobody, for routes a
// token authorises), streaming both ways.
func (r *Replica) proxy(w http.ResponseWriter, req *http.Request, n clusterstore.Node, p *principal.Principal) {
	if n.State == clusterstore.NodeLost {
		writeError(w, req, errNodeDown(n, nil))
		return
	}
	target, err := nodeURL(n)
	if err != nil {
		writeError(w, req, err)
		return
	}
	t, err := r.transport(n)
	if err != nil {
		writeError(w, req, err)
		return
	}
	var who []byte
	if p != nil {
		who, _ = json.Marshal(p)
	}
	rp := &httputil.ReverseProxy{
		Transport:     t,
		FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			// The Host and scheme the caller used: the node makes the
			// URLs it answers with (ports, MCP) from them, and routes
			// <port>-<id>.<domain> by the Host. The connection still
			// goes to, and verifies, the node.
			pr.Out.Host = req.Host
			pr.Out.Header.Set(ForwardedProtoHeader, requestScheme(req))
			// The caller's API key stays here: the node trusts the
			// replica's certificate and the principal it vouches for. A
			// token route's Authorization is the node's own token.
			pr.Out.Header.Del(PrincipalHeader)
			if who != nil {
				pr.Out.Header.Del("Authorization")
				pr.Out.Header.Set(PrincipalHeader, string(who))
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			resp.Header.Set("Space-Node", n.ID)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, req *http.Request, err error) {
			if req.Context().Err() != nil {
				return // the caller went away
			}
			writeError(w, req, errNodeDown(n, err))
		},
		ErrorLog: slog.NewLogLogger(r.cfg.Logger.Handler(), slog.LevelDebug),
	}
	// A node may answer before it has read the whole request (a Connect
	// stream flushes its headers after the first message): the caller's
	// body must stay readable after the replica starts answering, or the
	// copy to the node fails and cuts the answer. (Over HTTP/1.1 a server
	// otherwise stops reading a request once its response has begun.)
	_ = http.NewResponseController(w).EnableFullDuplex()
	rp.ServeHTTP(w, req)
}

// sandboxCall proxies a call naming a sandbox to its node.
func (r *Replica) sandboxCall(w http.ResponseWriter, req *http.Request) {
	var p *principal.Principal
	if !tokenRoute(req.Method, req.PathValue("rest")) {
		pp, err := r.authenticate(req)
		if err != nil {
			writeError(w, req, err)
			return
		}
		p = &pp
	}
	n, err := r.sandboxNode(req.Context(), req.PathValue("id"), p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	r.proxy(w, req, n, p)
}

// hostCall proxies host-routed port traffic to the sandbox's node. A
// bearer that is a cluster key is vouched for (and not passed on); any
// other credential (a port token, the service's own Authorization) is the
// node's to check.
func (r *Replica) hostCall(w http.ResponseWriter, req *http.Request, id string) {
	var p *principal.Principal
	if strings.HasPrefix(req.Header.Get("Authorization"), "Bearer ") {
		if pp, err := r.authenticate(req); err == nil {
			p = &pp
		}
	}
	n, err := r.sandboxNode(req.Context(), id, nil)
	if err != nil {
		writeError(w, req, err)
		return
	}
	r.proxy(w, req, n, p)
}

// sandboxNode is the node of sandbox id, for caller p (nil: any caller,
// when the node checks the call's own token).
func (r *Replica) sandboxNode(ctx context.Context, id string, p *principal.Principal) (clusterstore.Node, error) {
	row, err := r.sandboxRow(ctx, id, p)
	if err != nil {
		return clusterstore.Node{}, err
	}
	return r.node(ctx, row.Node)
}

// tokenRoute reports whether a sandbox sub-route is authorised by a token
// the node checks (attach, ports) rather than by an API key.
func tokenRoute(method, rest string) bool {
	parts := strings.Split(rest, "/")
	switch {
	case len(parts) == 3 && parts[0] == "commands" && parts[2] == "attach" && method == http.MethodGet:
		return true
	case len(parts) >= 3 && parts[0] == "ports":
		return true
	}
	return false
}

// get answers from the node, or from the row when the node is lost or
// down (its last report, with the state the cluster knows).
func (r *Replica) get(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	row, err := r.sandboxRow(req.Context(), req.PathValue("id"), &p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	n, err := r.node(req.Context(), row.Node)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if n.State == clusterstore.NodeLost || row.State == clusterstore.StateLost {
		w.Header().Set("Space-Node", n.ID)
		writeJSON(w, http.StatusOK, rowSandbox(row))
		return
	}
	r.proxy(w, req, n, &p)
}

// rowSandbox is a sandbox as its row has it: the node's last report with
// the cluster's state (lost) and reason.
func rowSandbox(row clusterstore.Sandbox) api.Sandbox {
	sb := api.Sandbox{ID: row.ID, Tenant: row.Tenant, Template: row.Request.Template, CreatedAt: row.Created}
	if row.Status != nil {
		sb = *row.Status
	}
	sb.State = row.State
	if row.StateReason != "" {
		sb.Error = row.StateReason
	}
	if sb.Tenant == principal.DefaultTenant {
		sb.Tenant = ""
	}
	return sb
}

// list answers from the rows: one query, whatever the nodes are doing.
func (r *Replica) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	tenant := p.Tenant
	if p.Admin() {
		tenant = ""
	}
	rows, err := r.store.Sandboxes(req.Context(), tenant)
	if err != nil {
		writeError(w, req, err)
		return
	}
	labels, err := labelFilter(req.URL.Query())
	if err != nil {
		writeError(w, req, err)
		return
	}
	state := req.URL.Query().Get("state")
	out := []api.Sandbox{}
	for _, row := range rows {
		sb := rowSandbox(row)
		if (state == "" || sb.State == state) && hasLabels(sb.Labels, labels) {
			out = append(out, sb)
		}
	}
	writeJSON(w, http.StatusOK, api.SandboxList{Sandboxes: out})
}

// delete records the desire first (so a node that is down deletes the
// sandbox when it is back), then asks the node now.
func (r *Replica) delete(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	row, err := r.sandboxRow(req.Context(), req.PathValue("id"), &p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if err := r.store.SetDesired(req.Context(), row.ID, clusterstore.DesiredDeleted); err != nil {
		writeError(w, req, err)
		return
	}
	n, err := r.node(req.Context(), row.Node)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if n.State == clusterstore.NodeLost {
		writeJSON(w, http.StatusAccepted, map[string]string{"id": row.ID, "state": clusterstore.DesiredDeleted,
			"message": fmt.Sprintf("node %s is lost; the deletion is recorded and applied if it comes back", n.ID)})
		return
	}
	r.proxy(w, req, n, &p)
}

// maxIdempotencyKey bounds an Idempotency-Key header.
const maxIdempotencyKey = 128

func checkIdempotencyKey(k string) error {
	if len(k) > maxIdempotencyKey {
		return fmt.Errorf("%s is %d bytes; at most %d: %w", api.IdempotencyKeyHeader, len(k), maxIdempotencyKey, errdefs.ErrInvalidArgument)
	}
	for _, c := range []byte(k) {
		if c < 0x21 || c > 0x7e {
			return fmt.Errorf("%s must be printable ASCII without spaces: %w", api.IdempotencyKeyHeader, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// create places the sandbox, makes sure its node has the template, and
// forwards the create; the node writes the row before it answers. With an
// Idempotency-Key, a create the tenant already made answers with that
// sandbox.
func (r *Replica) create(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	var body api.CreateSandboxRequest
	if err := decodeJSON(w, req, &body); err != nil {
		writeError(w, req, err)
		return
	}
	if _, err := waitParam(req); err != nil {
		writeError(w, req, err)
		return
	}
	idem := req.Header.Get(api.IdempotencyKeyHeader)
	if err := checkIdempotencyKey(idem); err != nil {
		writeError(w, req, err)
		return
	}
	if idem != "" && r.answerExisting(w, req, p, idem) {
		return
	}
	if err := r.checkSandboxQuota(req.Context(), p); err != nil {
		writeError(w, req, err)
		return
	}
	raw, _ := json.Marshal(body)
	tmpl := body.Template
	if tmpl == "" {
		tmpl = "base:latest"
	}
	mem := body.Limits.MemoryMiB
	if mem <= 0 {
		mem = r.cfg.DefaultMemMiB
	}
	var tried []string
	for attempt := 0; attempt < 2; attempt++ {
		n, err := r.store.PlaceExcept(req.Context(), tmpl, mem<<20, r.cfg.NodeTimeout, tried)
		if err != nil {
			writeError(w, req, err)
			return
		}
		tried = append(tried, n.ID)
		r.placements.WithLabelValues(n.ID).Inc()
		if err := r.ensureTemplate(req.Context(), n, tmpl, p); err != nil {
			r.cfg.Logger.Warn("cluster: copying a template to its node", "node", n.ID, "template", tmpl, "err", err)
		}
		resp, err := r.forwardFor(req.Context(), req, n, http.MethodPost, "/v1/sandboxes?"+req.URL.RawQuery, raw, &p, idem)
		if err != nil {
			// Not answered: try once more elsewhere. A create the node
			// did make without answering has its row, and the key (if
			// any) finds it.
			r.cfg.Logger.Warn("cluster: create not answered", "node", n.ID, "err", err)
			if idem != "" && r.answerExisting(w, req, p, idem) {
				return
			}
			continue
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusConflict && idem != "" && r.answerExisting(w, req, p, idem) {
			return
		}
		copyResponse(w, resp, n.ID)
		return
	}
	writeError(w, req, fmt.Errorf("no node answered the create (tried %s): %w", strings.Join(tried, ", "), errdefs.ErrUnavailable))
}

// answerExisting answers with the tenant's sandbox made under idem, if
// there is one: as its node has it now (or as its row does), with its
// create operation, still running or done.
// checkSandboxQuota refuses a create over the tenant's sandbox quota,
// which holds across the cluster; its other quotas each node enforces on
// its own sandboxes.
func (r *Replica) checkSandboxQuota(ctx context.Context, p principal.Principal) error {
	t, err := r.store.Tenant(ctx, tenantName(p.Tenant))
	if err != nil || t.Quotas.Sandboxes <= 0 {
		return err
	}
	n, err := r.store.CountSandboxes(ctx, tenantName(p.Tenant))
	if err != nil {
		return err
	}
	if n >= t.Quotas.Sandboxes {
		return fmt.Errorf("tenant %s has %d sandboxes in the cluster, its quota is %d: %w", tenantName(p.Tenant), n, t.Quotas.Sandboxes, errdefs.ErrQuotaExceeded)
	}
	return nil
}

func (r *Replica) answerExisting(w http.ResponseWriter, req *http.Request, p principal.Principal, idem string) bool {
	row, err := r.store.SandboxByKey(req.Context(), p.Tenant, idem)
	if err != nil {
		return false
	}
	sb := rowSandbox(row)
	if n, err := r.node(req.Context(), row.Node); err == nil && n.State != clusterstore.NodeLost {
		if resp, err := r.forward(req.Context(), n, http.MethodGet, "/v1/sandboxes/"+url.PathEscape(row.ID), nil, &p, ""); err == nil {
			var now api.Sandbox
			if resp.StatusCode == http.StatusOK && json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&now) == nil {
				sb = now
			}
			resp.Body.Close()
		}
	}
	op := api.Operation{ID: row.CreateOperation, Kind: "create", SandboxID: sb.ID, State: api.OpSucceeded, CreatedAt: sb.CreatedAt}
	switch sb.State {
	case api.StateCreating, "":
		op.State = api.OpRunning
	case api.StateError, clusterstore.StateLost:
		op.State = api.OpFailed
		op.Error = &api.ErrorBody{Code: api.CodeUnavailable, Message: sb.Error}
	}
	w.Header().Set("Space-Node", row.Node)
	writeJSON(w, http.StatusOK, api.CreateSandboxResponse{Sandbox: sb, Operation: op})
	return true
}

// forward makes one call to node n as p.
func (r *Replica) forward(ctx context.Context, n clusterstore.Node, method, path string, body []byte, p *principal.Principal, idem string) (*http.Response, error) {
	return r.forwardFor(ctx, nil, n, method, path, body, p, idem)
}

// forwardFor is forward on behalf of the caller's request in (nil: the
// replica's own call): the node sees in's Host and scheme, as proxy gives
// them, so the URLs it answers with are the replica's.
func (r *Replica) forwardFor(ctx context.Context, in *http.Request, n clusterstore.Node, method, path string, body []byte, p *principal.Principal, idem string) (*http.Response, error) {
	u, err := nodeURL(n)
	if err != nil {
		return nil, err
	}
	t, err := r.transport(n)
	if err != nil {
		return nil, err
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(u.String(), "/")+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if p != nil {
		who, _ := json.Marshal(p)
		req.Header.Set(PrincipalHeader, string(who))
	}
	if idem != "" {
		req.Header.Set(api.IdempotencyKeyHeader, idem)
	}
	if in != nil {
		req.Host = in.Host
		req.Header.Set(ForwardedProtoHeader, requestScheme(in))
	}
	return t.RoundTrip(req)
}

func copyResponse(w http.ResponseWriter, resp *http.Response, node string) {
	for k, vs := range resp.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	w.Header().Set("Space-Node", node)
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

// ensureTemplate copies template ref to node n from a node that has it,
// by export and import (the import verifies every digest), when n has not
// got it and another node has. The base template is built by each node
// itself.
func (r *Replica) ensureTemplate(ctx context.Context, n clusterstore.Node, ref string, p principal.Principal) error {
	if slices.Contains(n.Templates, ref) || ref == "base:latest" {
		return nil
	}
	nodes, err := r.store.Nodes(ctx)
	if err != nil {
		return err
	}
	var src *clusterstore.Node
	for i := range nodes {
		// A draining node still serves its templates.
		if nodes[i].ID != n.ID && nodes[i].State != clusterstore.NodeLost && slices.Contains(nodes[i].Templates, ref) {
			src = &nodes[i]
			break
		}
	}
	if src == nil {
		return nil // nowhere to copy from: the node's own create says what is missing
	}
	// The copy is made for the caller's tenant: what it may use on one
	// node it may use on another.
	cp := principal.Principal{KeyID: p.KeyID, KeyName: p.KeyName, Tenant: p.Tenant, Scopes: []string{principal.ScopeTemplatesRead, principal.ScopeTemplatesWrite}}
	exp, err := r.forward(ctx, *src, http.MethodGet, "/v1/templates/"+url.PathEscape(ref)+"/export", nil, &cp, "")
	if err != nil {
		return err
	}
	defer exp.Body.Close()
	if exp.StatusCode != http.StatusOK {
		return fmt.Errorf("export from %s: %s", src.ID, exp.Status)
	}
	u, err := nodeURL(n)
	if err != nil {
		return err
	}
	t, err := r.transport(n)
	if err != nil {
		return err
	}
	q := url.Values{"format": {"archive"}}
	if !strings.HasPrefix(ref, "sha256:") {
		q.Set("tag", ref)
	}
	imp, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(u.String(), "/")+"/v1/templates?"+q.Encode(), exp.Body)
	if err != nil {
		return err
	}
	who, _ := json.Marshal(cp)
	imp.Header.Set(PrincipalHeader, string(who))
	imp.Header.Set("Content-Type", "application/x-tar")
	resp, err := t.RoundTrip(imp)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("import on %s: %s: %s", n.ID, resp.Status, b)
	}
	r.cfg.Logger.Info("cluster: template copied", "template", ref, "from", src.ID, "to", n.ID)
	return nil
}

// operation finds an operation on whichever node has it (operation ids do
// not say where they run).
func (r *Replica) operation(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := r.store.Nodes(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	path := "/v1/operations/" + url.PathEscape(req.PathValue("id"))
	if req.URL.RawQuery != "" {
		path += "?" + req.URL.RawQuery
	}
	type answer struct {
		resp *http.Response
		node string
	}
	ctx, cancel := context.WithCancel(req.Context())
	defer cancel()
	found := make(chan answer, len(nodes))
	var wg sync.WaitGroup
	for _, n := range nodes {
		if n.State == clusterstore.NodeLost {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := r.forward(ctx, n, http.MethodGet, path, nil, &p, "")
			if err != nil {
				return
			}
			if resp.StatusCode == http.StatusNotFound {
				resp.Body.Close()
				return
			}
			found <- answer{resp, n.ID}
		}()
	}
	go func() { wg.Wait(); close(found) }()
	a, ok := <-found
	if !ok {
		writeError(w, req, fmt.Errorf("operation %q: %w", req.PathValue("id"), errdefs.ErrNotFound))
		return
	}
	defer a.resp.Body.Close()
	copyResponse(w, a.resp, a.node)
	go func() {
		for other := range found {
			other.resp.Body.Close()
		}
	}()
}

// info is a ready node's answer (the version and runtimes a create gets,
// for clusters of like nodes).
func (r *Replica) info(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := r.store.Nodes(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	for _, n := range nodes {
		if n.State == clusterstore.NodeReady {
			r.proxy(w, req, n, &p)
			return
		}
	}
	writeError(w, req, fmt.Errorf("the cluster has no ready node: %w", errdefs.ErrUnavailable))
}

func apiNode(n clusterstore.Node) api.ClusterNode {
	return api.ClusterNode{ID: n.ID, Address: n.Address, State: n.State, StateReason: n.StateReason,
		MemFree: n.MemFree, CPUs: n.CPUs, Sandboxes: n.Sandboxes, Templates: n.Templates, HeartbeatAt: n.Heartbeat}
}

func (r *Replica) nodes(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	nodes, err := r.store.Nodes(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	out := make([]api.ClusterNode, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, apiNode(n))
	}
	writeJSON(w, http.StatusOK, out)
}

// drainNode is POST /v1/nodes/{node}/drain (no new sandboxes are placed
// there; its own keep running and answering) and …/undrain.
func (r *Replica) drainNode(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	id := req.PathValue("node")
	var err error
	if strings.HasSuffix(req.URL.Path, "/undrain") {
		err = r.store.Undrain(req.Context(), id)
	} else {
		var body api.DrainRequest
		if req.ContentLength != 0 {
			if err := decodeJSON(w, req, &body); err != nil {
				writeError(w, req, err)
				return
			}
		}
		if len(body.Reason) > 256 {
			writeError(w, req, fmt.Errorf("a drain's reason is at most 256 bytes: %w", errdefs.ErrInvalidArgument))
			return
		}
		if body.Reason == "" {
			body.Reason = "drained by an admin"
		}
		err = r.store.Drain(req.Context(), id, body.Reason)
	}
	if err != nil {
		writeError(w, req, err)
		return
	}
	n, err := r.node(req.Context(), id)
	if err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusOK, apiNode(n))
}

func (r *Replica) createKey(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	var body api.CreateKeyRequest
	if err := decodeJSON(w, req, &body); err != nil {
		writeError(w, req, err)
		return
	}
	secret := tenancy.NewKeySecret()
	k, dig, err := tenancy.NewKey(body, secret)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if err := r.store.AddKey(req.Context(), k, dig); err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusCreated, api.CreatedKey{APIKey: k, Key: secret})
}

func (r *Replica) listKeys(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	keys, err := r.store.Keys(req.Context(), req.URL.Query().Get("tenant"))
	if err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusOK, api.KeyList{Keys: keys})
}

func (r *Replica) revokeKey(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	k, err := r.store.RevokeKey(req.Context(), req.PathValue("keyid"))
	if err != nil {
		writeError(w, req, err)
		return
	}
	// This replica stops honouring it at once; the others within keyCacheTTL.
	r.mu.Lock()
	clear(r.keys)
	r.mu.Unlock()
	writeJSON(w, http.StatusOK, k)
}

// listTemplates merges the templates of every node that answers (one
// entry per digest).
func (r *Replica) listTemplates(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := r.store.Nodes(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	seen := map[string]bool{}
	out := []api.Template{}
	for _, n := range nodes {
		if n.State != clusterstore.NodeReady {
			continue
		}
		resp, err := r.forward(req.Context(), n, http.MethodGet, "/v1/templates", nil, &p, "")
		if err != nil {
			continue
		}
		var ts api.TemplateList
		if resp.StatusCode == http.StatusOK {
			json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&ts)
		}
		resp.Body.Close()
		for _, t := range ts.Templates {
			if !seen[t.Digest] {
				seen[t.Digest] = true
				out = append(out, t)
			}
		}
	}
	writeJSON(w, http.StatusOK, api.TemplateList{Templates: out})
}

// templateCall proxies a read of one template to a node that has it.
func (r *Replica) templateCall(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := r.store.Nodes(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	ref := req.PathValue("ref")
	if n, ok := readyHolder(nodes, ref); ok {
		r.proxy(w, req, n, &p)
		return
	}
	writeError(w, req, fmt.Errorf("template %q is on no ready node: %w", ref, errdefs.ErrNotFound))
}

// readyHolder is the first ready node holding template ref.
func readyHolder(nodes []clusterstore.Node, ref string) (clusterstore.Node, bool) {
	for _, n := range nodes {
		if n.State == clusterstore.NodeReady && slices.Contains(n.Templates, ref) {
			return n, true
		}
	}
	return clusterstore.Node{}, false
}

// templateWrite sends an import, pull or build to the node placement
// picks; the template reaches other nodes when a create needs it there.
func (r *Replica) templateWrite(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	n, err := r.store.PlaceExcept(req.Context(), "", 0, r.cfg.NodeTimeout, nil)
	if err != nil {
		writeError(w, req, err)
		return
	}
	r.proxy(w, req, n, &p)
}

func tenantName(t string) string {
	if t == "" {
		return principal.DefaultTenant
	}
	return t
}

func (r *Replica) listTenants(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	st, err := r.store.Settings(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusOK, api.TenantList{Tenants: st.Tenants})
}

func (r *Replica) getTenant(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	name := req.PathValue("name")
	if err := tenancy.ValidTenant(name); err != nil {
		writeError(w, req, err)
		return
	}
	if !p.Sees(name) {
		writeError(w, req, fmt.Errorf("tenant %s not found: %w", name, errdefs.ErrNotFound))
		return
	}
	t, err := r.store.Tenant(req.Context(), name)
	if err != nil {
		writeError(w, req, err)
		return
	}
	n, err := r.store.CountSandboxes(req.Context(), name)
	if err != nil {
		writeError(w, req, err)
		return
	}
	t.Usage = &api.Usage{Sandboxes: n}
	writeJSON(w, http.StatusOK, t)
}

// putTenant stores a tenant's quotas and boundary in the cluster; every
// node mirrors them within its poll (NOTIFY makes it sooner). Unlike a
// single box, a boundary is not checked against the tenant's running
// sandboxes (they are on the nodes): it binds their next policy change.
func (r *Replica) putTenant(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	var t api.Tenant
	if err := decodeJSON(w, req, &t); err != nil {
		writeError(w, req, err)
		return
	}
	name := req.PathValue("name")
	if t.Name != "" && t.Name != name {
		writeError(w, req, fmt.Errorf("body names tenant %q but the path %q: %w", t.Name, name, errdefs.ErrInvalidArgument))
		return
	}
	t.Name = name
	if err := tenancy.ValidTenant(name); err != nil {
		writeError(w, req, err)
		return
	}
	q := t.Quotas
	if q.Sandboxes < 0 || q.CPUs < 0 || q.MemoryMiB < 0 || q.DiskMiB < 0 {
		writeError(w, req, fmt.Errorf("quotas must not be negative (0 = unlimited): %w", errdefs.ErrInvalidArgument))
		return
	}
	if t.Boundary != nil {
		if err := sandbox.ValidatePolicy(*t.Boundary); err != nil {
			writeError(w, req, fmt.Errorf("boundary: %w", err))
			return
		}
	}
	if err := r.store.PutTenant(req.Context(), t); err != nil {
		writeError(w, req, err)
		return
	}
	t.Usage = nil
	writeJSON(w, http.StatusOK, t)
}

// canScope is the single box's rule for who may see a policy scope, with
// a sandbox's tenant read from its row.
func (r *Replica) canScope(ctx context.Context, p principal.Principal, scope string) error {
	kind, name, _ := strings.Cut(scope, ":")
	switch kind {
	case "server", "template":
		if !p.Admin() {
			return fmt.Errorf("rule sets of %s scope are administered with the admin scope: %w", kind, errdefs.ErrPermissionDenied)
		}
	case "tenant":
		if !p.Sees(name) {
			return fmt.Errorf("tenant %q: %w", name, errdefs.ErrNotFound)
		}
	case "sandbox":
		if _, err := r.sandboxRow(ctx, name, &p); err != nil {
			return err
		}
	}
	return nil
}

func (r *Replica) policyScope(req *http.Request, p principal.Principal) (string, error) {
	scope := req.PathValue("scope")
	if err := policy.ValidScope(scope); err != nil {
		return "", err
	}
	return scope, r.canScope(req.Context(), p, scope)
}

func (r *Replica) listRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	st, err := r.store.Settings(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	out := api.PolicyRuleSetList{RuleSets: []api.PolicyRuleSet{}}
	for _, rs := range st.Rules {
		if r.canScope(req.Context(), p, rs.Scope) == nil {
			out.RuleSets = append(out.RuleSets, rs)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (r *Replica) getRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	scope, err := r.policyScope(req, p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	st, err := r.store.Settings(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	for _, rs := range st.Rules {
		if rs.Scope == scope {
			writeJSON(w, http.StatusOK, rs)
			return
		}
	}
	writeError(w, req, fmt.Errorf("no rule set is attached to %s: %w", scope, errdefs.ErrNotFound))
}

// putRules compiles the rule set here (a set no node could load is
// refused before any node sees it) and stores it for the nodes to mirror.
func (r *Replica) putRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	var rs api.PolicyRuleSet
	if err := decodeJSON(w, req, &rs); err != nil {
		writeError(w, req, err)
		return
	}
	scope, err := r.policyScope(req, p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if rs.Scope != "" && rs.Scope != scope {
		writeError(w, req, fmt.Errorf("body's scope %q differs from the path's %q: %w", rs.Scope, scope, errdefs.ErrInvalidArgument))
		return
	}
	if rs.Rules == nil {
		rs.Rules = []api.PolicyRule{}
	}
	now := time.Now().UTC()
	rs.Scope, rs.UpdatedAt = scope, &now
	if _, err := policy.Compile(rs); err != nil {
		writeError(w, req, err)
		return
	}
	if err := r.store.PutRules(req.Context(), rs); err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusOK, rs)
}

func (r *Replica) deleteRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	scope, err := r.policyScope(req, p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if err := r.store.DeleteRules(req.Context(), scope); err != nil {
		writeError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// wake proxies a wake to the sandbox's node — and when that node is lost
// and the sandbox was suspended there, first moves it to another node
// through the suspend share (the node exported it when it suspended).
func (r *Replica) wake(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	row, err := r.sandboxRow(req.Context(), req.PathValue("id"), &p)
	if err != nil {
		writeError(w, req, err)
		return
	}
	if row.State == clusterstore.StateLost && row.Status != nil && row.Status.State == api.StateSuspended {
		n, err := r.move(req.Context(), row, p)
		if err != nil {
			writeError(w, req, err)
			return
		}
		r.proxy(w, req, n, &p)
		return
	}
	n, err := r.node(req.Context(), row.Node)
	if err != nil {
		writeError(w, req, err)
		return
	}
	r.proxy(w, req, n, &p)
}

// move continues a lost node's suspended sandbox on another node: claim
// the row (one replica wins), make sure the template is there (by
// digest), have the node import the export from the suspend share, settle
// the row. It returns the node the sandbox is on afterwards.
func (r *Replica) move(ctx context.Context, row clusterstore.Sandbox, p principal.Principal) (clusterstore.Node, error) {
	mem := row.Request.Limits.MemoryMiB
	if mem <= 0 {
		mem = r.cfg.DefaultMemMiB
	}
	digest := row.Status.TemplateDigest
	target, err := r.store.PlaceExcept(ctx, digest, mem<<20, r.cfg.NodeTimeout, []string{row.Node})
	if err != nil {
		return clusterstore.Node{}, fmt.Errorf("sandbox %s was suspended on lost node %s and no other node can take it: %w", row.ID, row.Node, err)
	}
	if err := r.store.ClaimMove(ctx, row.ID, row.Node, target.ID); err != nil {
		// Another replica moved it (or the node came back): follow the row.
		now, gerr := r.store.GetSandbox(ctx, row.ID)
		if gerr != nil {
			return clusterstore.Node{}, gerr
		}
		return r.node(ctx, now.Node)
	}
	r.cfg.Logger.Info("cluster: moving a lost node's suspended sandbox", "sandbox", row.ID, "from", row.Node, "to", target.ID)
	if err := r.ensureTemplate(ctx, target, digest, p); err != nil {
		r.cfg.Logger.Warn("cluster: copying a template for a move", "node", target.ID, "template", digest, "err", err)
	}
	resp, err := r.forward(ctx, target, http.MethodPost, "/v1/cluster/adopt/"+url.PathEscape(row.ID), nil, &p, "")
	if err == nil {
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			var e api.Error
			json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&e)
			err = fmt.Errorf("node %s refused to take it: %s: %w", target.ID, e.Error.Message, errdefs.FromCode(e.Error.Code))
		}
	}
	if serr := r.store.EndMove(context.WithoutCancel(ctx), row.ID, row.Node, target.ID, err); serr != nil {
		return clusterstore.Node{}, errors.Join(err, serr)
	}
	if err != nil {
		return clusterstore.Node{}, fmt.Errorf("moving sandbox %s off lost node %s: %w", row.ID, row.Node, err)
	}
	return target, nil
}

// auditHeads lists every node's audit chain head as anchored in the
// cluster.
func (r *Replica) auditHeads(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	heads, err := r.store.AuditHeads(req.Context())
	if err != nil {
		writeError(w, req, err)
		return
	}
	out := api.AuditHeadList{Heads: make([]api.AuditHead, 0, len(heads))}
	for _, h := range heads {
		var cp api.AuditRecord
		if err := json.Unmarshal([]byte(h.Checkpoint), &cp); err != nil {
			writeError(w, req, fmt.Errorf("audit head of %s does not parse: %w", h.Node, err))
			return
		}
		out.Heads = append(out.Heads, api.AuditHead{Node: h.Node, Seq: h.Seq, Hash: h.Hash, KeyID: h.KeyID, PublicKey: h.PublicKey,
			SignedAt: h.SignedAt, AnchoredAt: h.AnchoredAt, Checkpoint: cp, Problem: h.Problem, ProblemAt: h.ProblemAt})
	}
	writeJSON(w, http.StatusOK, out)
}

// forgetAuditHead drops a node's head and its problem: the node anchors
// afresh from its newest checkpoint.
func (r *Replica) forgetAuditHead(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	if err := r.store.ForgetAuditHead(req.Context(), req.PathValue("node")); err != nil {
		writeError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// nodeAudit proxies a read of one node's audit log (?node=NAME): each node
// keeps its own chain, signed with its own key.
func (r *Replica) nodeAudit(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	name := req.URL.Query().Get("node")
	if name == "" {
		writeError(w, req, fmt.Errorf("each node keeps its own audit log: name it with ?node=NAME (GET /v1/nodes lists them): %w", errdefs.ErrInvalidArgument))
		return
	}
	n, err := r.node(req.Context(), name)
	if err != nil {
		writeError(w, req, err)
		return
	}
	r.proxy(w, req, n, &p)
}

// hasLabels reports whether have carries every one of want.
func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if got, ok := have[k]; !ok || got != v {
			return false
		}
	}
	return true
}
