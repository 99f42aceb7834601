package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
)

// The audit log's side of the server: opening it (its own SQLite file
// beside the store, so its writes never queue behind or in front of
// sandbox operations), one API record per request (auditRequest), and the
// routes that read it (GET /v1/audit, /v1/audit/export, /v1/audit/key).

// AuditOptions configure the audit log.
type AuditOptions struct {
	RetainAge          time.Duration // drop records older than this (0: keep)
	RetainRecords      int64         // keep about this many records (0: keep all)
	CheckpointEvery    int           // sign a checkpoint after this many records (default 1000)
	CheckpointInterval time.Duration // or after this long with unsigned records (default 60 s)
}

// auditWriteTimeout bounds the write of one streamed line.
const auditWriteTimeout = 30 * time.Second

// openAudit opens DataDir/audit.db and the signing key
// DataDir/audit-signing.key (created 0600; refused when others can read it).
func openAudit(ctx context.Context, cfg Config) (*audit.Log, error) {
	key, err := audit.LoadOrCreateKey(filepath.Join(cfg.DataDir, audit.KeyFileName))
	if err != nil {
		return nil, err
	}
	db, err := audit.OpenDB(filepath.Join(cfg.DataDir, "audit.db"))
	if err != nil {
		return nil, err
	}
	o := cfg.Audit
	l, err := audit.Open(ctx, audit.Options{DB: db, Key: key, CheckpointEvery: o.CheckpointEvery, CheckpointInterval: o.CheckpointInterval,
		RetainAge: o.RetainAge, RetainRecords: o.RetainRecords, Logger: cfg.Logger.With("component", "audit")})
	if err != nil {
		db.Close()
		return nil, err
	}
	return l, nil
}

// reqAudit is what the route's own handler learns for the request's API
// record: the mux pattern, the path's targets and the principal the
// authentication put in the request's context (which the outer handler
// does not see).
type reqAudit struct {
	pattern string
	target  string
	p       principal.Principal
	authed  bool
}

type reqAuditKey struct{}

// noteRequest wraps a route's handler (inside its authentication) to
// fill the request's reqAudit.
func noteRequest(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a, ok := r.Context().Value(reqAuditKey{}).(*reqAudit); ok {
			a.pattern = r.Pattern
			var t []string
			for _, name := range []string{"id", "ref", "cid", "port"} {
				if v := r.PathValue(name); v != "" {
					t = append(t, v)
				}
			}
			a.target = strings.Join(t, "/")
			a.p, a.authed = principal.From(r.Context())
		}
		h.ServeHTTP(w, r)
	})
}

// withRequestAudit returns r carrying a reqAudit for noteRequest to fill.
func withRequestAudit(r *http.Request) (*http.Request, *reqAudit) {
	a := &reqAudit{}
	return r.WithContext(context.WithValue(r.Context(), reqAuditKey{}, a)), a
}

// auditRequest records one API call: "METHOD pattern" (E2B's API: "METHOD
// e2b" with its path as target), the path's ids, the status, the key and
// tenant, the remote address. Never a body, a query or a header.
func (part auditAPI) auditRequest(r *http.Request, a *reqAudit, status int, kind string) {
	s := part.s
	if s.audit == nil {
		return // a test's server without a log
	}
	if status == 0 {
		status = http.StatusOK
	}
	ev := audit.Event{Kind: audit.KindAPI, Result: strconv.Itoa(status), Tenant: principal.DefaultTenant,
		Detail: map[string]any{"remote": r.RemoteAddr}}
	switch {
	case kind != "":
		ev.Action = r.Method + " " + kind
		ev.Target = truncatePath(r.URL.Path)
	case a.pattern != "":
		ev.Action = a.pattern
		if !strings.HasPrefix(ev.Action, r.Method+" ") {
			ev.Action = r.Method + " " + strings.TrimPrefix(a.pattern, "GET ") // HEAD on a GET route
		}
		ev.Target = a.target
		if strings.Contains(a.pattern, "{id}") && a.target != "" {
			ev.Sandbox, _, _ = strings.Cut(a.target, "/")
		}
	default:
		// No route matched (or the request was refused before its route).
		ev.Action = r.Method + " (no route)"
		ev.Target = truncatePath(r.URL.Path)
	}
	if a.authed {
		ev.KeyID = a.p.KeyID
		if a.p.Tenant != "" {
			ev.Tenant = a.p.Tenant
		}
	}
	s.audit.Record(r.Context(), ev)
}

func truncatePath(p string) string {
	if len(p) > 256 {
		return p[:256] + "…"
	}
	return p
}

// auditTenant is the tenant filter of the caller: "" (all) for an admin or
// an internal call, else its own tenant.
func auditTenant(ctx context.Context) string {
	p, ok := principal.From(ctx)
	if !ok || p.Admin() {
		return ""
	}
	if p.Tenant == "" {
		return principal.DefaultTenant
	}
	return p.Tenant
}

var auditKinds = []string{audit.KindAPI, audit.KindLifecycle, audit.KindCommand, audit.KindFiles, audit.KindNetwork,
	audit.KindSecret, audit.KindPolicy, audit.KindApproval, audit.KindKey, audit.KindCheckpoint, audit.KindAudit}

// auditFilter parses GET /v1/audit's query.
func auditFilter(r *http.Request) (audit.Filter, bool, error) {
	q := r.URL.Query()
	f := audit.Filter{Sandbox: q.Get("sandbox"), Kind: q.Get("kind"), Tenant: auditTenant(r.Context())}
	if len(f.Sandbox) > 128 {
		return f, false, fmt.Errorf("sandbox must be a sandbox id, got %q: %w", truncateQuery(f.Sandbox), errdefs.ErrInvalidArgument)
	}
	if f.Kind != "" && !contains(auditKinds, f.Kind) {
		return f, false, fmt.Errorf("kind must be one of %s, got %q: %w", strings.Join(auditKinds, ", "), truncateQuery(f.Kind), errdefs.ErrInvalidArgument)
	}
	if a := q.Get("after"); a != "" {
		n, err := strconv.ParseUint(a, 10, 63)
		if err != nil {
			return f, false, fmt.Errorf("after must be a sequence number (an unsigned integer), got %q: %w", truncateQuery(a), errdefs.ErrInvalidArgument)
		}
		f.After = n
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > audit.MaxLimit {
			return f, false, fmt.Errorf("limit must be an integer from 1 to %d, got %q: %w", audit.MaxLimit, truncateQuery(l), errdefs.ErrInvalidArgument)
		}
		f.Limit = n
	}
	follow, err := parseBool(q.Get("follow"), "follow")
	return f, follow, err
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// listAudit is GET /v1/audit: a JSON list, or with follow=true NDJSON
// records as they are committed until the client goes away.
func (part auditAPI) listAudit(w http.ResponseWriter, r *http.Request) {
	s := part.s
	if s.auditLog == nil {
		writeError(w, r, fmt.Errorf("the audit log is not open: %w", errdefs.ErrUnavailable))
		return
	}
	f, follow, err := auditFilter(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if !follow {
		recs, err := s.auditLog.List(r.Context(), f)
		if err != nil {
			writeError(w, r, err)
			return
		}
		if recs == nil {
			recs = []audit.Record{}
		}
		writeJSON(w, http.StatusOK, api.AuditRecordList{Records: recs})
		return
	}
	nd := newNDJSON(w, auditWriteTimeout)
	defer nd.Close()
	_ = s.auditLog.Follow(r.Context(), f, func(rec audit.Record) error { return nd.Send(rec) })
}

// parseSince reads since= as RFC 3339 or as a duration before now.
func parseSince(v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("since must be an RFC 3339 time (2026-01-02T15:04:05Z) or a duration (24h), got %q: %w", truncateQuery(v), errdefs.ErrInvalidArgument)
}

// exportAudit is GET /v1/audit/export: JSON Lines from the checkpoint
// before since through a checkpoint signed now; format=jsonl sends the
// chain's records exactly (space audit verify checks them), format=ocsf
// one OCSF-shaped event per record.
func (part auditAPI) exportAudit(w http.ResponseWriter, r *http.Request) {
	s := part.s
	if s.auditLog == nil {
		writeError(w, r, fmt.Errorf("the audit log is not open: %w", errdefs.ErrUnavailable))
		return
	}
	q := r.URL.Query()
	since, err := parseSince(q.Get("since"), time.Now())
	if err != nil {
		writeError(w, r, err)
		return
	}
	format := q.Get("format")
	switch format {
	case "", "jsonl", "ocsf":
	default:
		writeError(w, r, fmt.Errorf("format must be jsonl or ocsf, got %q: %w", truncateQuery(format), errdefs.ErrInvalidArgument))
		return
	}
	w.Header().Set("Content-Type", "application/jsonl")
	rc := http.NewResponseController(w)
	started := false
	err = s.auditLog.Export(r.Context(), since, auditTenant(r.Context()), func(line []byte) error {
		if !started {
			started = true
			w.WriteHeader(http.StatusOK)
		}
		_ = rc.SetWriteDeadline(time.Now().Add(auditWriteTimeout))
		if format == "ocsf" {
			var rec audit.Record
			if err := json.Unmarshal(line, &rec); err != nil {
				return err
			}
			b, err := json.Marshal(audit.OCSF(rec))
			if err != nil {
				return err
			}
			line = b
		}
		_, err := w.Write(append(line, '\n'))
		return err
	})
	_ = rc.SetWriteDeadline(time.Time{})
	if err != nil && !started {
		writeError(w, r, err)
		return
	}
	if !started {
		w.WriteHeader(http.StatusOK)
	}
}

// auditKey is GET /v1/audit/key: the public key checkpoints verify with.
func (part auditAPI) auditKey(w http.ResponseWriter, r *http.Request) {
	s := part.s
	if s.auditLog == nil {
		writeError(w, r, fmt.Errorf("the audit log is not open: %w", errdefs.ErrUnavailable))
		return
	}
	writeJSON(w, http.StatusOK, api.AuditKeyList{Keys: []api.AuditKey{audit.PublicKey(s.auditLog.PublicKey())}})
}

// publicPath reports the unauthenticated routes, which are not API calls.
func publicPath(p string) bool {
	return p == "/healthz" || p == "/metrics" || p == "/openapi.yaml"
}
