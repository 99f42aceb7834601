// Package server is `space server`: the REST API under /v1, the WebSocket
// attach endpoint, /metrics, and the wiring of store, templates, runtimes
// and the sandbox manager into one process.
package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/e2b"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/runtime"
	_ "github.com/spacehq/space/internal/runtime/gvisor"  // registers "gvisor"
	_ "github.com/spacehq/space/internal/runtime/microvm" // registers "microvm"
	_ "github.com/spacehq/space/internal/runtime/native"  // registers "native"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/templatesvc"
	"github.com/spacehq/space/internal/tenancy"
)

// Config configures a server.
type Config struct {
	DataDir  string // store, templates, runtime state; default /var/lib/space
	Listen   string // "127.0.0.1:7070" or "unix:/path"
	CacheDir string // shared build cache (base rootfs); default /var/cache/space
	Logger   *slog.Logger
	// AgentBinary overrides discovery of space-agent (else $SPACE_AGENT_BIN,
	// else next to the running executable).
	AgentBinary string
	// JailBinary overrides discovery of space-jail, the microvm runtime's
	// QEMU jailer (else $SPACE_JAIL_BIN, else next to the running
	// executable, else the runtime's default: next to space-agent).
	JailBinary string
	// MaxFileBytes bounds one file upload/download; MaxTemplateBytes a template import.
	MaxFileBytes     int64
	MaxTemplateBytes int64
	// AllowPrivateRegistries lets template pulls reach loopback, private
	// and link-local addresses (off: an API client cannot make the server
	// probe its own network).
	AllowPrivateRegistries bool
	// APIKeyOut receives the one-time notice of a newly generated API key.
	APIKeyOut *os.File
	// Network configures the network gateway and the default policy.
	Network NetworkOptions
	// PortDomain is the domain of host-routed port URLs
	// (http://<port>-<id>.<PortDomain>/), e.g. "sandbox.example.com" or
	// "localhost:7070"; empty: derived from the Host each request used
	// (a loopback address becomes localhost).
	PortDomain string
	// Broker overrides the network gateway as the receiver of sandboxes'
	// brokered secrets (tests record what it is sent); nil: the gateway,
	// if it can broker.
	Broker sandbox.Broker
	// Decider decides the actions the platform sees (the network
	// gateway's DNS queries and connections among them); nil allows all.
	// Tests set it; the server's policy engine is used when it is nil.
	Decider actions.Decider
	// ApprovalTimeout is how long an action a policy rule asks about waits
	// for an answer before it is denied (default 5m).
	ApprovalTimeout time.Duration
	// Audit configures the tamper-evident audit log (retention, checkpoints).
	Audit AuditOptions
	// PoolDefault is how many sandboxes of the base template on the auto
	// runtime with the default limits a warm pool keeps ready (0: no such
	// pool; `space server` defaults to 1).
	PoolDefault int
	// PoolMemFloor is the host MemAvailable (bytes) under which warm pools
	// stop filling and shed idle members (0: 1 GiB).
	PoolMemFloor int64
	// Cluster makes the server a node of a cluster (cluster.go); the zero
	// value is the single box.
	Cluster ClusterNodeOptions
}

// Server is a running space server (store, manager, HTTP handler).
type Server struct {
	cfg      Config
	runtimes map[string]runtime.Runtime
	db       *store.DB
	tmpl     *template.Store
	mgr      *sandbox.Manager
	tmplsvc  *templatesvc.Service
	metrics  *metrics
	apiKey   string // the api-key file's key (the first admin key)
	keys     *tenancy.Store
	handler  http.Handler
	netw     sandbox.Network // nil: no gateway, sandboxes have no network
	// portSecret keys the sandboxes' port access tokens (ports.go).
	portSecret []byte
	proxyOnce  sync.Once
	proxyRP    *httputil.ReverseProxy
	// e2b serves the E2B-compatible API under /e2b (internal/e2b).
	e2b *e2b.Handler
	// audit receives the server's audit events (internal/audit);
	// auditLog is the same log, for the routes that read it.
	audit    audit.Sink
	auditLog *audit.Log
	// secrets keeps secrets, grants and sandbox CAs (secrets.go).
	secrets *secrets.Store
	// decider is the server's Decider (Config.Decider, else AllowAll);
	// setDecider swaps it (decisions.go).
	decider *deciderRef
	// policy is the temporal policy engine, the Decider of every action
	// (internal/policy; policy.go).
	policy *policy.Engine
	// checkBoundary is an extra check of a proposal's policy before
	// SetNetwork (which itself refuses a policy outside the tenant's
	// boundary); nil: none.
	checkBoundary func(ctx context.Context, sandboxID string, p api.NetworkPolicy) error
	// self is the in-process connection the /mcp handler's SDK clients
	// use to reach this server's own handler (mcp.go).
	self selfConn
}

func (c *Config) defaults() {
	if c.DataDir == "" {
		c.DataDir = "/var/lib/space"
	}
	if c.Listen == "" {
		c.Listen = "127.0.0.1:7070"
	}
	if c.CacheDir == "" {
		c.CacheDir = "/var/cache/space"
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxFileBytes == 0 {
		c.MaxFileBytes = 1 << 30
	}
	if c.MaxTemplateBytes == 0 {
		c.MaxTemplateBytes = 8 << 30
	}
	if c.APIKeyOut == nil {
		c.APIKeyOut = os.Stderr
	}
}

func findAgent(cfg Config) (string, error) {
	if p := findBinary(cfg.AgentBinary, "SPACE_AGENT_BIN", "space-agent"); p != "" {
		return p, nil
	}
	return "", errors.New("space-agent binary not found: build it next to space (make build) or set SPACE_AGENT_BIN")
}

// findJail finds space-jail; "" leaves it to the microvm runtime, which
// looks next to space-agent and says so in its probe when it is missing.
func findJail(cfg Config) string {
	return findBinary(cfg.JailBinary, "SPACE_JAIL_BIN", "space-jail")
}

// findBinary returns the absolute path of the first regular file of:
// configured, $env, name next to the running executable; "" if none.
func findBinary(configured, env, name string) string {
	cands := []string{configured, os.Getenv(env)}
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), name))
	}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() {
			if abs, err := filepath.Abs(c); err == nil {
				return abs
			}
		}
	}
	return ""
}

// New opens the store, reconciles the host with it, and builds the handler.
func New(ctx context.Context, cfg Config) (*Server, error) {
	cfg.defaults()
	// 0700: only the server reads its state. Sandboxes get their layers as
	// descriptors from the host, so they never need to traverse this tree.
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, err
	}
	if err := os.Chmod(cfg.DataDir, 0o700); err != nil {
		return nil, err
	}
	agentBin, err := findAgent(cfg)
	if err != nil {
		return nil, err
	}
	jailBin := findJail(cfg)
	portSecret, err := loadOrCreatePortSecret(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("port token key: %w", err)
	}
	dbPath := filepath.Join(cfg.DataDir, "space.db")
	db, err := store.Open(dbPath)
	if err != nil {
		return nil, fmt.Errorf("opening store: %w", err)
	}
	for _, p := range []string{dbPath, dbPath + "-wal", dbPath + "-shm"} {
		os.Chmod(p, 0o600)
	}
	keys, err := tenancy.Open(ctx, db.SQL())
	if err != nil {
		db.Close()
		return nil, err
	}
	key, err := firstKey(ctx, keys, cfg.DataDir, cfg.APIKeyOut)
	if err != nil {
		db.Close()
		return nil, err
	}
	tmpl, err := template.Open(db.SQL(), filepath.Join(cfg.DataDir, "templates"), cfg.CacheDir, cfg.Logger)
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("opening template store: %w", err)
	}
	rts := map[string]runtime.Runtime{}
	for _, name := range runtime.Names() {
		rt, err := runtime.New(name, runtime.Config{
			DataDir: filepath.Join(cfg.DataDir, "runtimes", name), AgentBinary: agentBin, JailBinary: jailBin,
			Logger: cfg.Logger.With("runtime", name),
		})
		if err != nil {
			cfg.Logger.Warn("runtime unavailable", "runtime", name, "err", err)
			continue
		}
		rts[name] = rt
	}
	sec, err := secrets.Open(ctx, db.SQL(), cfg.DataDir)
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("opening the secrets store: %w", err)
	}
	met := newMetrics(db)
	alog, err := openAudit(ctx, cfg)
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("opening the audit log: %w", err)
	}
	// The policy engine exists before the gateway so that the gateway's
	// decisions (DNS, connections) can be asked of it too.
	srv := new(Server)
	eng, err := policy.New(ctx, policy.Config{DB: db.SQL(), ApprovalTimeout: cfg.ApprovalTimeout, Audit: alog, Logger: cfg.Logger})
	if err != nil {
		alog.Close()
		db.Close()
		return nil, fmt.Errorf("opening the policy engine: %w", err)
	}
	nopts := cfg.Network
	nopts.DataDir, nopts.Logger, nopts.AgentBinary = cfg.DataDir, cfg.Logger, agentBin
	if err := nopts.check(); err != nil {
		alog.Close()
		db.Close()
		return nil, err
	}
	dec := newDeciderRef(cfg.Decider)
	if cfg.Decider == nil {
		// The gateway asks the policy engine (about sandboxes it has
		// rules for).
		dec.set(policyDecider{eng: eng, srv: srv})
	}
	netw, err := startNetwork(nopts, dec)
	if err != nil {
		alog.Close()
		db.Close()
		return nil, fmt.Errorf("starting the network gateway: %w", err)
	}
	if netw == nil {
		cfg.Logger.Info("no network gateway: sandboxes get no network link")
	}
	if nc, ok := netw.(networkCounters); ok {
		met.reg.MustRegister(&networkCollector{net: nc})
	}
	broker := cfg.Broker
	if b, ok := netw.(sandbox.Broker); ok && broker == nil {
		broker = b
	}
	tenants := &tenantsOf{keys: keys, allowPrivate: nopts.AllowPrivate}
	// The manager records into the log itself: it resumes its network
	// followers from the log's cursor.
	mgr := sandbox.New(sandbox.Config{DB: db, Templates: tmpl, Runtimes: rts, Logger: cfg.Logger, Observer: met, Secrets: sec, Broker: broker,
		Network: netw, DefaultNetwork: nopts.Default, Tenants: tenants, Decider: eng, Audit: alog, PoolMemFloor: cfg.PoolMemFloor})
	met.reg.MustRegister(&poolCollector{mgr: mgr})
	if r, ok := netw.(interface{ OnRestart(func()) }); ok {
		r.OnRestart(mgr.Networking().NetworkRestarted)
	}
	if gn, ok := netw.(*gatewayNetwork); ok {
		gn.serveDecisions(mgr)
	}
	if err := mgr.Reconciler().Reconcile(ctx); err != nil {
		mgr.Close()
		closeNetwork(netw, cfg.Logger)
		alog.Close()
		db.Close()
		return nil, fmt.Errorf("reconciling: %w", err)
	}
	// Build step sandboxes belong to the build that made them; builds do
	// not survive a restart, so whatever is left of them goes now.
	if n, err := mgr.Builds().DeleteBuildSandboxes(ctx); err != nil {
		cfg.Logger.Warn("deleting leftover build sandboxes", "err", err)
	} else if n > 0 {
		cfg.Logger.Info("deleted leftover build sandboxes", "count", n)
	}
	if err := mgr.WarmPools().EnsureDefaultPool(ctx, cfg.PoolDefault); err != nil {
		cfg.Logger.Warn("the default warm pool could not be set", "err", err)
	}
	mgr.Reconciler().Run()
	tsvc := templatesvc.New(templatesvc.Config{Templates: tmpl, Runtimes: rts, Sandboxes: mgr.TemplateUsers(), Logger: cfg.Logger,
		MaxBytes: cfg.MaxTemplateBytes, AllowPrivateRegistries: cfg.AllowPrivateRegistries, Owners: keys})
	tenants.tsvc = tsvc
	s := srv
	*s = Server{cfg: cfg, runtimes: rts, db: db, tmpl: tmpl, mgr: mgr, tmplsvc: tsvc, metrics: met, apiKey: key, keys: keys, netw: netw, portSecret: portSecret, audit: alog, auditLog: alog,
		policy: eng, decider: dec, secrets: sec}
	s.self.serve = s.HTTPServer
	s.e2b = e2b.New(e2b.Config{
		Manager:      mgr,
		Templates:    tsvc,
		Authenticate: keys.Authenticate,
		Vouched:      replicaPrincipal,
		Secret:       portSecret,
		PortToken:    (portsAPI{s}).portToken,
		Domain:       (portsAPI{s}).portDomain,
		MaxFileBytes: cfg.MaxFileBytes,
		Logger:       cfg.Logger.With("api", "e2b"),
	})
	s.handler = s.routes()
	// A gateway this server adopted may serve links under another
	// server's Decider: say again which sandboxes this one applies to.
	s.decisionScopeChanged()
	return s, nil
}

// Handler is the server's HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// Decider is the server's policy engine, the actions.Decider of every
// action it sees (the gateway's DNS queries and connections too).
func (s *Server) Decider() *policy.Engine { return s.policy }

// Manager exposes the sandbox manager (tests, benchmarks).
func (s *Server) Manager() *sandbox.Manager { return s.mgr }

// APIKey is the bearer key clients must present.
func (s *Server) APIKey() string { return s.apiKey }

// Close stops background work and closes the store. Sandboxes keep running.
func (s *Server) Close() error {
	s.closeSelf()
	s.e2b.Close()
	s.mgr.Close()
	closeNetwork(s.netw, s.cfg.Logger)
	// After everything that records: Close commits and signs the tail.
	s.auditLog.Close()
	// Runtimes may hold host resources of their own (native: spare disks).
	for name, rt := range s.runtimes {
		if c, ok := rt.(io.Closer); ok {
			if err := c.Close(); err != nil {
				s.cfg.Logger.Warn("closing runtime", "runtime", name, "err", err)
			}
		}
	}
	return s.db.Close()
}

// closeNetwork stops the gateway if it is something to stop.
func closeNetwork(n sandbox.Network, log *slog.Logger) {
	if c, ok := n.(io.Closer); ok {
		if err := c.Close(); err != nil {
			log.Warn("closing the network gateway", "err", err)
		}
	}
}

// Listen opens cfg.Listen ("host:port" or "unix:/path").
func Listen(addr string) (net.Listener, error) {
	if p, ok := strings.CutPrefix(addr, "unix:"); ok {
		os.Remove(p)
		l, err := net.Listen("unix", p)
		if err != nil {
			return nil, err
		}
		os.Chmod(p, 0o600)
		return l, nil
	}
	return net.Listen("tcp", addr)
}

// Run serves until ctx is cancelled.
func Run(ctx context.Context, cfg Config) error {
	cfg.defaults()
	if err := cfg.Cluster.check(); err != nil {
		return err
	}
	s, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	defer s.Close()
	l, err := Listen(cfg.Listen)
	if err != nil {
		return err
	}
	// A node joins the cluster before it answers anyone: until then a
	// create would make a sandbox with no row, and a caller that saw the
	// API up could not yet find the node registered. Callers that connect
	// meanwhile wait in the listener's backlog.
	if cfg.Cluster.Store != "" {
		cctx, stopCluster := context.WithCancel(ctx)
		wait, err := s.startClusterNode(cctx, cfg.Cluster)
		if err != nil {
			stopCluster()
			l.Close()
			return err
		}
		defer wait()
		defer stopCluster()
	}
	hs := s.HTTPServer()
	cfg.Logger.Info("space server listening", "addr", l.Addr().String(), "data", cfg.DataDir)
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(l) }()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		hs.Shutdown(sctx)
		return nil
	case err := <-errc:
		return err
	}
}

func loadOrCreateAPIKey(dir string, notice *os.File) (string, error) {
	p := filepath.Join(dir, "api-key")
	if b, err := os.ReadFile(p); err == nil {
		k := strings.TrimSpace(string(b))
		if len(k) < 16 {
			return "", fmt.Errorf("%s holds a key shorter than 16 characters", p)
		}
		return k, nil
	}
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	k := "sk_" + hex.EncodeToString(b[:])
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", err
	}
	if _, err := f.WriteString(k + "\n"); err != nil {
		f.Close()
		return "", err
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	fmt.Fprintf(notice, "space: generated API key (stored in %s, mode 0600): %s\n", p, k)
	return k, nil
}

type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(c int) {
	if w.code == 0 {
		w.code = c
	}
	w.ResponseWriter.WriteHeader(c)
}
func (w *statusWriter) Write(b []byte) (int, error) {
	if w.code == 0 {
		w.code = 200
	}
	return w.ResponseWriter.Write(b)
}
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// access says what a route asks of its caller.
type access int

const (
	apiKey      access = iota // Authorization: Bearer <API key>, checked before the handler
	public                    // nothing
	attachToken               // the command session's attach token, checked by the handler
	portToken                 // a sandbox's port access token or the API key (or nothing: a public port), checked by the handler
)

// bodyKind says how long a route's request body may take to arrive.
type bodyKind int

const (
	bodySmall  bodyKind = iota // JSON or nothing: the whole body within bodyTimeout
	bodyStream                 // uploads: each read within bodyIdleTimeout of the last
)

// route is one registration: the one list the mux is built from and the
// tests compare with api/openapi.yaml.
type route struct {
	pattern string // "METHOD /path" as the mux and the OpenAPI file write it
	access  access
	// scope is what an API-key route's key must hold (principal.Scope…);
	// "" = any valid key.
	scope   string
	body    bodyKind
	handler http.Handler
	// fallback routes answer requests no documented route matches with a
	// better error than the generic 404; they are not in the OpenAPI file.
	fallback bool
	// cluster is what a cluster's API replica does with the route
	// (internal/replica builds its mux from it).
	cluster Disposition
}

// lifecycleVerbs are the POST /v1/sandboxes/{id}/{verb} routes.
var lifecycleVerbs = []string{api.OpStop, api.OpStart, api.OpPause, api.OpResume, api.OpWake, api.OpSuspend, api.OpRestore, api.OpFork}

// proxyMethods are the methods path-routed port requests are proxied for
// (GET patterns also match HEAD).
var proxyMethods = []string{"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}

// routeTable is every route the server serves.
func (s *Server) routeTable() []route {
	h := func(f http.HandlerFunc) http.Handler { return f }
	rs := []route{
		{pattern: "GET /healthz", cluster: ServeHere, access: public, handler: h(func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, map[string]bool{"ok": true}) })},
		{pattern: "GET /openapi.yaml", cluster: Refuse, access: public, handler: h(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/yaml")
			w.Write(api.OpenAPI)
		})},
		{pattern: "GET /metrics", cluster: ServeHere, access: public, handler: promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{})},
		{pattern: "POST /mcp", cluster: ServeHere, body: bodyStream, handler: s.mcpHandler()},
		{pattern: "GET /v1/info", cluster: ServeHere, handler: h(s.info)},
		{pattern: "POST /v1/sandboxes", cluster: ServeHere, scope: "sandbox:write", handler: h(s.createSandbox)},
		{pattern: "GET /v1/sandboxes", cluster: ServeHere, scope: "sandbox:read", handler: h(s.listSandboxes)},
		{pattern: "GET /v1/sandboxes/{id}", cluster: ForwardToNode, scope: "sandbox:read", handler: h(s.getSandbox)},
		{pattern: "DELETE /v1/sandboxes/{id}", cluster: ForwardToNode, scope: "sandbox:write", handler: h(s.deleteSandbox)},
		{pattern: "POST /v1/sandboxes/{id}/{verb}", cluster: ForwardToNode, scope: "sandbox:write", handler: h(s.unknownVerb), fallback: true},
		{pattern: "GET /v1/operations/{id}", cluster: FanOut, scope: "sandbox:read", handler: h(s.getOperation)},
		{pattern: "POST /v1/sandboxes/{id}/exec", cluster: ForwardToNode, scope: "exec:write", handler: h(s.exec)},
		{pattern: "POST /v1/sandboxes/{id}/exec/stream", cluster: ForwardToNode, scope: "exec:write", handler: h(s.execStream)},
		{pattern: "POST /v1/sandboxes/{id}/commands", cluster: ForwardToNode, scope: "exec:write", handler: h(s.createCommand)},
		{pattern: "GET /v1/sandboxes/{id}/commands", cluster: ForwardToNode, scope: "exec:read", handler: h(s.listCommands)},
		{pattern: "GET /v1/sandboxes/{id}/commands/{cid}", cluster: ForwardToNode, scope: "exec:read", handler: h(s.getCommand)},
		{pattern: "POST /v1/sandboxes/{id}/commands/{cid}/signal", cluster: ForwardToNode, scope: "exec:write", handler: h(s.signalCommand)},
		{pattern: "POST /v1/sandboxes/{id}/commands/{cid}/token", cluster: ForwardToNode, scope: "exec:write", handler: h(s.refreshToken)},
		{pattern: "GET /v1/sandboxes/{id}/commands/{cid}/attach", cluster: ForwardToNode, access: attachToken, handler: h(s.attach)},
		{pattern: "GET /v1/sandboxes/{id}/files", cluster: ForwardToNode, scope: "files:read", handler: h(filesAPI{s}.readFile)},
		{pattern: "PUT /v1/sandboxes/{id}/files", cluster: ForwardToNode, scope: "files:write", body: bodyStream, handler: h(filesAPI{s}.writeFile)},
		{pattern: "DELETE /v1/sandboxes/{id}/files", cluster: ForwardToNode, scope: "files:write", handler: h(filesAPI{s}.removeFile)},
		{pattern: "GET /v1/sandboxes/{id}/files/stat", cluster: ForwardToNode, scope: "files:read", handler: h(filesAPI{s}.statFile)},
		{pattern: "GET /v1/sandboxes/{id}/files/list", cluster: ForwardToNode, scope: "files:read", handler: h(filesAPI{s}.listFiles)},
		{pattern: "POST /v1/sandboxes/{id}/files/mkdir", cluster: ForwardToNode, scope: "files:write", handler: h(filesAPI{s}.mkdir)},
		{pattern: "POST /v1/sandboxes/{id}/files/rename", cluster: ForwardToNode, scope: "files:write", handler: h(filesAPI{s}.rename)},
		{pattern: "GET /v1/sandboxes/{id}/files/tar", cluster: ForwardToNode, scope: "files:read", handler: h(filesAPI{s}.tarGet)},
		{pattern: "PUT /v1/sandboxes/{id}/files/tar", cluster: ForwardToNode, scope: "files:write", body: bodyStream, handler: h(filesAPI{s}.tarPut)},
		{pattern: "GET /v1/sandboxes/{id}/files/watch", cluster: ForwardToNode, scope: "files:read", handler: h(filesAPI{s}.watchDir)},
		{pattern: "GET /v1/sandboxes/{id}/stats", cluster: ForwardToNode, scope: "sandbox:read", handler: h(networkAPI{s}.sandboxStats)},
		{pattern: "GET /v1/sandboxes/{id}/network", cluster: ForwardToNode, scope: "network:read", handler: h(networkAPI{s}.getNetwork)},
		{pattern: "PUT /v1/sandboxes/{id}/network", cluster: ForwardToNode, scope: "network:write", handler: h(networkAPI{s}.putNetwork)},
		{pattern: "GET /v1/sandboxes/{id}/network/events", cluster: ForwardToNode, scope: "network:read", handler: h(networkAPI{s}.networkEvents)},
		{pattern: "GET /v1/sandboxes/{id}/ports/{port}", cluster: ForwardToNode, scope: "network:read", handler: h(portsAPI{s}.getPort)},
		{pattern: "PUT /v1/sandboxes/{id}/ports/{port}", cluster: ForwardToNode, scope: "network:write", handler: h(portsAPI{s}.putPort)},
		{pattern: "GET /v1/sandboxes/{id}/ports/{port}/tcp", cluster: ForwardToNode, access: portToken, body: bodyStream, handler: h(portsAPI{s}.portTCP)},
		{pattern: "GET /v1/sandboxes/{id}/secrets", cluster: ForwardToNode, scope: "secrets:read", handler: h(secretsAPI{s}.listSandboxSecrets)},
		{pattern: "PUT /v1/sandboxes/{id}/secrets/{name}", cluster: ForwardToNode, scope: "secrets:write", handler: h(secretsAPI{s}.grantSecret)},
		{pattern: "DELETE /v1/sandboxes/{id}/secrets/{name}", cluster: ForwardToNode, scope: "secrets:write", handler: h(secretsAPI{s}.revokeSecret)},
		{pattern: "GET /v1/secrets", cluster: ServeHere, scope: "secrets:read", handler: h(secretsAPI{s}.listSecrets)},
		{pattern: "PUT /v1/secrets/{name}", cluster: ServeHere, scope: "secrets:write", handler: h(secretsAPI{s}.setSecret)},
		{pattern: "GET /v1/secrets/{name}", cluster: ServeHere, scope: "secrets:read", handler: h(secretsAPI{s}.getSecret)},
		{pattern: "DELETE /v1/secrets/{name}", cluster: ServeHere, scope: "secrets:write", handler: h(secretsAPI{s}.deleteSecret)},
		{pattern: "GET /v1/policy/rules", cluster: ServeHere, scope: "policy:read", handler: h(policyAPI{s}.listPolicyRules)},
		{pattern: "GET /v1/policy/rules/{scope}", cluster: ServeHere, scope: "policy:read", handler: h(policyAPI{s}.getPolicyRules)},
		{pattern: "PUT /v1/policy/rules/{scope}", cluster: ServeHere, scope: "policy:write", handler: h(policyAPI{s}.putPolicyRules)},
		{pattern: "DELETE /v1/policy/rules/{scope}", cluster: ServeHere, scope: "policy:write", handler: h(policyAPI{s}.deletePolicyRules)},
		{pattern: "GET /v1/approvals", cluster: FanOut, scope: "policy:read", handler: h(policyAPI{s}.listApprovals)},
		{pattern: "POST /v1/approvals/{id}/approve", cluster: FanOut, scope: "policy:write", handler: h(policyAPI{s}.approveApproval)},
		{pattern: "POST /v1/approvals/{id}/deny", cluster: FanOut, scope: "policy:write", handler: h(policyAPI{s}.denyApproval)},
		{pattern: "GET /v1/templates", cluster: FanOut, scope: "templates:read", handler: h(templatesAPI{s}.listTemplates)},
		{pattern: "POST /v1/templates", cluster: ServeHere, scope: "templates:write", body: bodyStream, handler: h(templatesAPI{s}.importTemplate)},
		{pattern: "POST /v1/templates/base", cluster: Refuse, scope: "templates:write", handler: h(templatesAPI{s}.buildBase)},
		{pattern: "POST /v1/templates/pull", cluster: ServeHere, scope: "templates:write", handler: h(templatesAPI{s}.pullTemplate)},
		{pattern: "POST /v1/templates/build", cluster: ServeHere, scope: "templates:write", body: bodyStream, handler: h(templatesAPI{s}.buildTemplate)},
		{pattern: "POST /v1/templates/gc", cluster: Refuse, scope: "admin", handler: h(templatesAPI{s}.gcTemplates)},
		{pattern: "GET /v1/templates/{ref}", cluster: ServeHere, scope: "templates:read", handler: h(templatesAPI{s}.getTemplate)},
		{pattern: "DELETE /v1/templates/{ref}", cluster: Refuse, scope: "templates:write", handler: h(templatesAPI{s}.removeTemplate)},
		{pattern: "POST /v1/templates/{ref}/tags", cluster: Refuse, scope: "templates:write", handler: h(templatesAPI{s}.tagTemplate)},
		{pattern: "GET /v1/templates/{ref}/export", cluster: ServeHere, scope: "templates:read", handler: h(templatesAPI{s}.exportTemplate)},
		{pattern: "POST /v1/keys", cluster: ServeHere, scope: "admin", handler: h(keysAPI{s}.createKey)},
		{pattern: "GET /v1/keys", cluster: ServeHere, scope: "admin", handler: h(keysAPI{s}.listKeys)},
		{pattern: "DELETE /v1/keys/{keyid}", cluster: ServeHere, scope: "admin", handler: h(keysAPI{s}.revokeKey)},
		{pattern: "GET /v1/tenants", cluster: ServeHere, scope: "admin", handler: h(keysAPI{s}.listTenants)},
		{pattern: "GET /v1/pools", cluster: FanOut, scope: "admin", handler: h(templatesAPI{s}.listPools)},
		{pattern: "PUT /v1/pools", cluster: ServeHere, scope: "admin", handler: h(templatesAPI{s}.putPool)},
		{pattern: "GET /v1/pools/{id}", cluster: FanOut, scope: "admin", handler: h(templatesAPI{s}.getPool)},
		{pattern: "DELETE /v1/pools/{id}", cluster: ServeHere, scope: "admin", handler: h(templatesAPI{s}.deletePool)},
		{pattern: "GET /v1/tenants/{name}", cluster: ServeHere, handler: h(keysAPI{s}.getTenant)},
		{pattern: "PUT /v1/tenants/{name}", cluster: ServeHere, scope: "admin", handler: h(keysAPI{s}.putTenant)},
		{pattern: "GET /v1/audit", cluster: ServeHere, scope: "audit:read", handler: h(auditAPI{s}.listAudit)},
		{pattern: "GET /v1/audit/export", cluster: ServeHere, scope: "audit:read", handler: h(auditAPI{s}.exportAudit)},
		{pattern: "GET /v1/audit/key", cluster: ServeHere, scope: "audit:read", handler: h(auditAPI{s}.auditKey)},
	}
	for _, m := range proxyMethods {
		rs = append(rs, route{pattern: m + " /v1/sandboxes/{id}/ports/{port}/{path...}", cluster: ForwardToNode, access: portToken, body: bodyStream, handler: h(portsAPI{s}.proxyPath)})
	}
	for _, verb := range lifecycleVerbs {
		hv := s.lifecycle(verb)
		if verb == api.OpFork {
			hv = s.fork
		}
		rs = append(rs, route{pattern: "POST /v1/sandboxes/{id}/" + verb, cluster: ForwardToNode, scope: "sandbox:write", handler: hv})
	}
	return rs
}

// mux registers every route of the table with its access check, and
// returns each pattern's body kind.
func (s *Server) mux() (*http.ServeMux, map[string]bodyKind) {
	mux := http.NewServeMux()
	bodies := map[string]bodyKind{}
	for _, rt := range s.routeTable() {
		h := noteRequest(rt.handler)
		if rt.access == apiKey {
			h = (keysAPI{s}).authed(rt.scope, h)
		}
		mux.Handle(rt.pattern, h)
		bodies[rt.pattern] = rt.body
	}
	return mux, bodies
}

func (s *Server) routes() http.Handler {
	mux, bodies := s.mux()
	notFound := func(w http.ResponseWriter, r *http.Request) {
		writeError(w, r, fmt.Errorf("no route for %s %s: %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		defer func() { s.metrics.httpReqs.WithLabelValues(r.Method, strconv.Itoa(sw.code)).Inc() }()
		// Host-routed port requests (<port>-<id>.<domain>) never reach
		// the API.
		if id, port, ok := hostRoute(r.Host); ok {
			guardBody(sw, r, bodyStream)
			(portsAPI{s}).proxyHost(sw, r, id, port)
			return
		}
		// Every API call is one audit record, when it ends (public
		// routes, /healthz, /metrics, /openapi.yaml, are not API calls).
		r, ra := withRequestAudit(r)
		auditKind := ""
		defer func() {
			if !publicPath(r.URL.Path) {
				(auditAPI{s}).auditRequest(r, ra, sw.code, auditKind)
			}
		}()
		// The E2B-compatible API authenticates and answers in its own
		// shapes; its bodies are bounded by each of its handlers.
		// (E2B's SDK puts its signed file URLs at the root /files.)
		if strings.HasPrefix(r.URL.Path, e2b.Prefix+"/") || r.URL.Path == e2b.SignedFilesPath {
			auditKind = "e2b"
			guardBody(sw, r, bodyStream)
			s.e2b.ServeHTTP(sw, r)
			return
		}
		_, pattern := mux.Handler(r)
		if pattern == "" {
			// Distinguish a wrong method from an unknown path, both as JSON.
			for _, m := range []string{"GET", "POST", "PUT", "DELETE"} {
				r2 := r.Clone(r.Context())
				r2.Method = m
				if _, p := mux.Handler(r2); p != "" {
					writeJSON(sw, http.StatusMethodNotAllowed, api.Error{Error: api.ErrorBody{Code: api.CodeMethodNotAllowed, Message: r.Method + " is not allowed on " + r.URL.Path}})
					return
				}
			}
			notFound(sw, r)
			return
		}
		kind := bodies[pattern]
		// A small body announced larger than its limit is refused from
		// the header, before anything waits for it to arrive.
		if kind == bodySmall && r.ContentLength > maxJSONBody {
			writeError(sw, r, errBodyTooLarge(r.ContentLength))
			return
		}
		guardBody(sw, r, kind)
		mux.ServeHTTP(sw, r)
	})
}
