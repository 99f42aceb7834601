// Package e2b serves an E2B-compatible API on the server's one listener, so
// a program written against E2B's SDKs runs unchanged against space, with
// only its environment pointed here:
//
//	E2B_API_URL=http://HOST:PORT/e2b         the control plane (REST, control.go)
//	E2B_SANDBOX_URL=http://HOST:PORT/e2b/envd every in-sandbox call (envd: Connect
//	                                          services process.go, filesystem.go, and /files)
//	E2B_API_KEY=<a space API key>
//	E2B_DOMAIN=HOST:PORT                      getHost(port) → PORT-ID.HOST:PORT, the server's host-routed ingress
//
// It is a mapping onto this project's model, not a parallel one: an E2B
// sandbox is a space sandbox (metadata are its labels, its timeout its
// deadline, pause is suspend), an E2B process is a space command session
// (its pid is the command's pid in the sandbox), and every call goes through
// the same sandbox manager, API keys, metrics and logs as the native API.
// What cannot be mapped is refused in E2B's error shape with a message that
// says so. docs/e2b.md has the table.
package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
)

// EnvdVersion is the envd version this layer reports. The SDK gates
// features on it: ≥ 0.5.7 streams uploads as octet-stream, ≥ 0.5.2 closes
// stdin; below 0.6.2 it refuses file metadata and below 0.6.3 entry info in
// watch events itself — neither is served here.
const EnvdVersion = "0.6.1"

// Prefix is where the layer is mounted; EnvdPrefix is E2B_SANDBOX_URL's path.
const (
	Prefix     = "/e2b"
	EnvdPrefix = Prefix + "/envd"
)

// Config wires the layer to the server.
type Config struct {
	Manager *sandbox.Manager
	// Templates lists and removes templates (snapshots are templates).
	Templates Templates
	// Authenticate returns the principal of an API key of this server.
	Authenticate func(key string) (principal.Principal, error)
	// Secret keys the sandboxes' envd access tokens.
	Secret []byte
	// PortToken is a sandbox's port access token (E2B's traffic token).
	PortToken func(api.Sandbox) string
	// Domain is the E2B domain reported for sandboxes (the server's port
	// domain as the request reached it).
	Domain func(r *http.Request) string
	// Vouched, when set, returns the caller a cluster replica vouched for
	// (ok false: the request did not come from a replica); that caller
	// stands in for an API key, on the control plane and on envd.
	Vouched func(r *http.Request) (p principal.Principal, ok bool, err error)
	// MaxFileBytes bounds one file upload or download (0: 1 GiB).
	MaxFileBytes int64
	Logger       *slog.Logger
}

// Templates is what the layer needs of the template service.
type Templates interface {
	List(ctx context.Context) ([]api.Template, error)
	Get(ctx context.Context, ref string) (api.Template, error)
	Remove(ctx context.Context, ref string, force bool) error
}

// Handler serves /e2b/….
type Handler struct {
	cfg      Config
	mux      *http.ServeMux
	proc     *processes
	watchers *watchers
	watch    dirWatcher
	patterns []string // every route registered (route)
}

// New returns the layer's handler, to be mounted at Prefix.
func New(cfg Config) *Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	h := &Handler{cfg: cfg, mux: http.NewServeMux()}
	h.proc = newProcesses(h)
	h.watchers = newWatchers(h)
	h.watch = managerWatch(cfg.Manager)
	h.controlRoutes()
	h.envdRoutes()
	return h
}

// Close ends background work (the processes' input attachments, the
// server-side watchers).
func (h *Handler) Close() {
	h.proc.close()
	h.watchers.close()
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mux.ServeHTTP(w, r)
}

// apiError is E2B's REST error shape.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// writeAPIError answers a control-plane call with err in E2B's shape and the
// status this project's error table gives it.
func (h *Handler) writeAPIError(w http.ResponseWriter, r *http.Request, err error) {
	status := errdefs.HTTPStatus(err)
	if status >= 500 && !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrTimeout) {
		h.cfg.Logger.Error("internal error", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, apiError{Code: status, Message: strings.TrimSuffix(err.Error(), ": invalid argument")})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// notSupported is the error of an E2B feature this server does not serve.
func notSupported(format string, args ...any) error {
	return fmt.Errorf(format+" (this server implements E2B's sandbox API; see docs/e2b.md): %w", append(args, errdefs.ErrNotSupported)...)
}

// authAPI checks the control plane's API key (X-API-KEY, as E2B's SDKs
// send it, or Authorization: Bearer, as space's do).
func (h *Handler) authAPI(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p, err := h.apiCaller(r)
		if err != nil {
			h.writeAPIError(w, r, err)
			return
		}
		ctx := principal.With(r.Context(), p)
		r = r.WithContext(ctx)
		// Another tenant's sandbox is not found, as one that does not
		// exist; then the key needs the scope of what it asks.
		if id := r.PathValue("id"); id != "" && strings.Contains(r.Pattern, "/sandboxes/{id}") {
			if _, err := h.cfg.Manager.Tenancy().Visible(ctx, id); err != nil {
				h.writeAPIError(w, r, err)
				return
			}
		}
		if scope := controlScope(r); !p.Can(scope) {
			h.writeAPIError(w, r, fmt.Errorf("this API key (%s) lacks the %s scope: %w", p.KeyName, scope, errdefs.ErrPermissionDenied))
			return
		}
		next(w, r)
	}
}

// apiCaller is the control plane's caller: the one a cluster replica
// vouched for, else the API key's.
func (h *Handler) apiCaller(r *http.Request) (principal.Principal, error) {
	if h.cfg.Vouched != nil {
		if p, ok, err := h.cfg.Vouched(r); ok {
			return p, err
		}
	}
	key := r.Header.Get("X-API-KEY")
	if key == "" {
		key, _ = strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	}
	if key == "" {
		return principal.Principal{}, fmt.Errorf("missing API key (X-API-KEY header, E2B_API_KEY in the SDK): %w", errdefs.ErrUnauthorized)
	}
	return h.cfg.Authenticate(key)
}

// controlScope is the scope a control-plane call needs.
func controlScope(r *http.Request) string {
	switch {
	case strings.HasSuffix(r.Pattern, "/network"):
		return principal.ScopeNetworkWrite
	case strings.Contains(r.Pattern, "snapshots") || strings.Contains(r.Pattern, "/templates/"):
		if r.Method == http.MethodGet {
			return principal.ScopeTemplatesRead
		}
		return principal.ScopeTemplatesWrite
	case r.Method == http.MethodGet:
		return principal.ScopeSandboxRead
	}
	return principal.ScopeSandboxWrite
}

// envdToken is sandbox sb's envd access token: an HMAC of its id and
// creation time under the server's secret, so nothing is stored and a
// deleted sandbox's token opens nothing.
func (h *Handler) envdToken(sb api.Sandbox) string {
	m := hmac.New(sha256.New, h.cfg.Secret)
	fmt.Fprintf(m, "space e2b envd token v1\x00%s\x00%d", sb.ID, sb.CreatedAt.UnixNano())
	return "ea_" + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// envdCaller is what an authenticated envd call knows about its caller.
type envdCaller struct {
	sb   api.Sandbox
	user string // from Authorization: Basic user: — "" for the default
}

type callerKey struct{}

func caller(ctx context.Context) envdCaller {
	c, _ := ctx.Value(callerKey{}).(envdCaller)
	return c
}

// authEnvd checks an envd call: the sandbox named by E2b-Sandbox-Id (or the
// path of a signed URL) and its access token (X-Access-Token), or, for
// file URLs, a signature (files.go checks those). The API key is accepted
// too, so space's own tools can use these routes.
func (h *Handler) authEnvd(signedOK bool, next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("E2b-Sandbox-Id")
		if id == "" {
			id = r.URL.Query().Get("sandbox_id")
		}
		fail := func(err error) {
			if strings.Contains(r.URL.Path, ".") { // a Connect procedure
				writeUnaryError(w, r.Context(), err)
				return
			}
			h.writeAPIError(w, r, err)
		}
		if id == "" {
			fail(fmt.Errorf("missing E2b-Sandbox-Id header: envd calls name their sandbox: %w", errdefs.ErrInvalidArgument))
			return
		}
		if err := sandbox.ValidID(id); err != nil {
			fail(fmt.Errorf("sandbox %q not found: %w", truncate(id, 64), errdefs.ErrNotFound))
			return
		}
		sb, err := h.cfg.Manager.Get(r.Context(), id)
		if err != nil {
			fail(err)
			return
		}
		ok, signed := false, false
		if tok := r.Header.Get("X-Access-Token"); tok != "" {
			ok = subtle.ConstantTimeCompare([]byte(tok), []byte(h.envdToken(sb))) == 1
		}
		if !ok && h.cfg.Vouched != nil {
			// Through a cluster replica: the key it checked, as below.
			if p, from, err := h.cfg.Vouched(r); from && err == nil && p.Sees(sb.Tenant) && p.Can(principal.ScopeExecWrite) && p.Can(principal.ScopeFilesWrite) {
				ok = true
				r = r.WithContext(principal.With(r.Context(), p))
			}
		}
		if !ok {
			// An API key opens envd for its own tenant's sandboxes, with
			// the scopes of what envd does (commands, files).
			if key := r.Header.Get("X-API-KEY"); key != "" {
				if p, err := h.cfg.Authenticate(key); err == nil && p.Sees(sb.Tenant) && p.Can(principal.ScopeExecWrite) && p.Can(principal.ScopeFilesWrite) {
					ok = true
					r = r.WithContext(principal.With(r.Context(), p))
				}
			}
		}
		if !ok && signedOK && r.URL.Query().Get("signature") != "" {
			if err := (filesystemAPI{h}).checkSignature(r, sb); err != nil {
				fail(err)
				return
			}
			ok, signed = true, true
		}
		if !ok {
			fail(fmt.Errorf("missing or wrong envd access token (X-Access-Token) for sandbox %s: %w", id, errdefs.ErrUnauthorized))
			return
		}
		user, err := basicUser(r)
		if err != nil {
			fail(err)
			return
		}
		if user == "" || signed {
			// A signed URL is for the user it was signed for, whatever
			// else its bearer sends.
			user = r.URL.Query().Get("username")
		}
		next(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, envdCaller{sb: sb, user: user})))
	}
}

// basicUser reads the E2B user from Authorization: Basic base64(user:).
func basicUser(r *http.Request) (string, error) {
	v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Basic ")
	if !ok {
		return "", nil
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v))
	if err != nil {
		return "", fmt.Errorf("the Authorization header's Basic credentials are not base64: %w", errdefs.ErrInvalidArgument)
	}
	user, _, _ := strings.Cut(string(b), ":")
	return user, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
