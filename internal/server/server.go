// Package server is `space server`: the REST API under /v1, the WebSocket
// attach endpoint, /metrics, and the wiring of store, templates, runtimes
// and the sandbox manager into one process.
package server

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	_ "github.com/spacehq/space/internal/runtime/gvisor"  // registers "gvisor"
	_ "github.com/spacehq/space/internal/runtime/microvm" // registers "microvm"
	_ "github.com/spacehq/space/internal/runtime/native"  // registers "native"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
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
	// MaxFileBytes bounds one file upload/download; MaxTemplateBytes a template import.
	MaxFileBytes     int64
	MaxTemplateBytes int64
	// AllowPrivateRegistries lets template pulls reach loopback, private
	// and link-local addresses (off: an API client cannot make the server
	// probe its own network).
	AllowPrivateRegistries bool
	// APIKeyOut receives the one-time notice of a newly generated API key.
	APIKeyOut *os.File
}

// Server is a running space server (store, manager, HTTP handler).
type Server struct {
	cfg      Config
	runtimes map[string]runtime.Runtime
	db       *store.DB
	tmpl     *template.Store
	mgr      *sandbox.Manager
	metrics  *metrics
	apiKey   string
	handler  http.Handler
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
	cands := []string{cfg.AgentBinary, os.Getenv("SPACE_AGENT_BIN")}
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), "space-agent"))
	}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() {
			return filepath.Abs(c)
		}
	}
	return "", errors.New("space-agent binary not found: build it next to space (make build) or set SPACE_AGENT_BIN")
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
	key, err := loadOrCreateAPIKey(cfg.DataDir, cfg.APIKeyOut)
	if err != nil {
		return nil, err
	}
	dbPath := filepath.Join(cfg.DataDir, "space.db")
	db, err := store.Open(dbPath)
	if err != nil {
		return nil, fmt.Errorf("opening store: %w", err)
	}
	for _, p := range []string{dbPath, dbPath + "-wal", dbPath + "-shm"} {
		os.Chmod(p, 0o600)
	}
	tmpl, err := template.Open(db.SQL(), filepath.Join(cfg.DataDir, "templates"), cfg.CacheDir, cfg.Logger)
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("opening template store: %w", err)
	}
	rts := map[string]runtime.Runtime{}
	for _, name := range runtime.Names() {
		rt, err := runtime.New(name, runtime.Config{
			DataDir: filepath.Join(cfg.DataDir, "runtimes", name), AgentBinary: agentBin, Logger: cfg.Logger.With("runtime", name),
		})
		if err != nil {
			cfg.Logger.Warn("runtime unavailable", "runtime", name, "err", err)
			continue
		}
		rts[name] = rt
	}
	met := newMetrics(db)
	mgr := sandbox.New(sandbox.Config{DB: db, Templates: tmpl, Runtimes: rts, Logger: cfg.Logger, Observer: met})
	if err := mgr.Reconcile(ctx); err != nil {
		mgr.Close()
		db.Close()
		return nil, fmt.Errorf("reconciling: %w", err)
	}
	// Build step sandboxes belong to the build that made them; builds do
	// not survive a restart, so whatever is left of them goes now.
	if n, err := mgr.DeleteBuildSandboxes(ctx); err != nil {
		cfg.Logger.Warn("deleting leftover build sandboxes", "err", err)
	} else if n > 0 {
		cfg.Logger.Info("deleted leftover build sandboxes", "count", n)
	}
	mgr.Run()
	s := &Server{cfg: cfg, runtimes: rts, db: db, tmpl: tmpl, mgr: mgr, metrics: met, apiKey: key}
	s.handler = s.routes()
	return s, nil
}

// Handler is the server's HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// Manager exposes the sandbox manager (tests, benchmarks).
func (s *Server) Manager() *sandbox.Manager { return s.mgr }

// APIKey is the bearer key clients must present.
func (s *Server) APIKey() string { return s.apiKey }

// Close stops background work and closes the store. Sandboxes keep running.
func (s *Server) Close() error {
	s.mgr.Close()
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
	s, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	defer s.Close()
	l, err := Listen(cfg.Listen)
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: s.handler, ReadHeaderTimeout: 10 * time.Second}
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

func (s *Server) authed(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(tok), []byte(s.apiKey)) != 1 {
			writeError(w, r, fmt.Errorf("missing or wrong API key (Authorization: Bearer <key>): %w", errdefs.ErrUnauthorized))
			return
		}
		h(w, r)
	}
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

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	a := s.authed
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, map[string]bool{"ok": true}) })
	mux.HandleFunc("GET /openapi.yaml", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/yaml")
		w.Write(api.OpenAPI)
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /v1/info", a(s.info))
	mux.HandleFunc("POST /v1/sandboxes", a(s.createSandbox))
	mux.HandleFunc("GET /v1/sandboxes", a(s.listSandboxes))
	mux.HandleFunc("GET /v1/sandboxes/{id}", a(s.getSandbox))
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", a(s.deleteSandbox))
	mux.HandleFunc("POST /v1/sandboxes/{id}/{verb}", a(s.lifecycle))
	mux.HandleFunc("GET /v1/operations/{id}", a(s.getOperation))
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec", a(s.exec))
	mux.HandleFunc("POST /v1/sandboxes/{id}/commands", a(s.createCommand))
	mux.HandleFunc("GET /v1/sandboxes/{id}/commands", a(s.listCommands))
	mux.HandleFunc("GET /v1/sandboxes/{id}/commands/{cid}", a(s.getCommand))
	mux.HandleFunc("POST /v1/sandboxes/{id}/commands/{cid}/signal", a(s.signalCommand))
	mux.HandleFunc("POST /v1/sandboxes/{id}/commands/{cid}/token", a(s.refreshToken))
	mux.HandleFunc("GET /v1/sandboxes/{id}/commands/{cid}/attach", s.attach) // attach token, not API key
	mux.HandleFunc("GET /v1/sandboxes/{id}/files", a(s.readFile))
	mux.HandleFunc("PUT /v1/sandboxes/{id}/files", a(s.writeFile))
	mux.HandleFunc("DELETE /v1/sandboxes/{id}/files", a(s.removeFile))
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/stat", a(s.statFile))
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/list", a(s.listFiles))
	mux.HandleFunc("POST /v1/sandboxes/{id}/files/mkdir", a(s.mkdir))
	mux.HandleFunc("POST /v1/sandboxes/{id}/files/rename", a(s.rename))
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/tar", a(s.tarGet))
	mux.HandleFunc("PUT /v1/sandboxes/{id}/files/tar", a(s.tarPut))
	mux.HandleFunc("GET /v1/templates", a(s.listTemplates))
	mux.HandleFunc("POST /v1/templates", a(s.importTemplate))
	mux.HandleFunc("POST /v1/templates/base", a(s.buildBase))
	mux.HandleFunc("POST /v1/templates/pull", a(s.pullTemplate))
	mux.HandleFunc("POST /v1/templates/build", a(s.buildTemplate))
	mux.HandleFunc("POST /v1/templates/gc", a(s.gcTemplates))
	mux.HandleFunc("GET /v1/templates/{ref}", a(s.getTemplate))
	mux.HandleFunc("DELETE /v1/templates/{ref}", a(s.removeTemplate))
	mux.HandleFunc("POST /v1/templates/{ref}/tags", a(s.tagTemplate))
	mux.HandleFunc("GET /v1/templates/{ref}/export", a(s.exportTemplate))
	notFound := func(w http.ResponseWriter, r *http.Request) {
		writeError(w, r, fmt.Errorf("no route for %s %s: %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		defer func() { s.metrics.httpReqs.WithLabelValues(r.Method, strconv.Itoa(sw.code)).Inc() }()
		if _, pattern := mux.Handler(r); pattern == "" {
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
		mux.ServeHTTP(sw, r)
	})
}
