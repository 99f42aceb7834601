package server

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/templatesvc"
	"github.com/spacehq/space/internal/tenancy"
)

// firstKey makes sure the server has an admin key. A fresh server
// generates one, stores it in DataDir/api-key (0600, for the local CLI)
// and prints it once; a server from before keys were stored imports the
// key its api-key file already holds. Returns the api-key file's key.
func firstKey(ctx context.Context, keys *tenancy.Store, dir string, notice *os.File) (string, error) {
	n, err := keys.CountKeys(ctx)
	if err != nil {
		return "", err
	}
	p := filepath.Join(dir, "api-key")
	b, ferr := os.ReadFile(p)
	if n > 0 {
		// Keys exist; the file (if any) is the operator's local
		// credential, valid or revoked as the store says.
		return strings.TrimSpace(string(b)), nil
	}
	key := strings.TrimSpace(string(b))
	if ferr != nil {
		if key, err = loadOrCreateAPIKey(dir, notice); err != nil {
			return "", err
		}
	} else if len(key) < 16 {
		return "", fmt.Errorf("%s holds a key shorter than 16 characters", p)
	}
	if _, err := keys.ImportKey(ctx, api.CreateKeyRequest{Name: "admin", Tenant: principal.DefaultTenant, Scopes: []string{principal.ScopeAdmin}}, key); err != nil {
		return "", fmt.Errorf("storing the first API key: %w", err)
	}
	return key, nil
}

// authenticate returns the principal of the request's API key
// (Authorization: Bearer).
func (part keysAPI) authenticate(r *http.Request) (principal.Principal, error) {
	s := part.s
	if p, ok, err := replicaPrincipal(r); ok {
		return p, err
	}
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return principal.Principal{}, fmt.Errorf("missing API key (Authorization: Bearer <key>): %w", errdefs.ErrUnauthorized)
	}
	return s.keys.Authenticate(tok)
}

// authed checks the caller's key and scope, puts its principal in the
// request's context, and hides other tenants' sandboxes: a route naming a
// sandbox {id} the caller's tenant does not own answers 404, exactly as
// for an id that does not exist.
func (part keysAPI) authed(scope string, h http.Handler) http.Handler {
	s := part.s
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := (keysAPI{s}).authenticate(r)
		if err != nil {
			writeError(w, r, err)
			return
		}
		ctx := principal.With(r.Context(), p)
		r = r.WithContext(ctx)
		if id := r.PathValue("id"); id != "" && strings.HasPrefix(r.Pattern, "") && sandboxRoute(r.Pattern) {
			if _, err := s.mgr.Tenancy().Visible(ctx, id); err != nil {
				writeError(w, r, err)
				return
			}
		}
		if scope != "" && !p.Can(scope) {
			writeError(w, r, fmt.Errorf("this API key (%s) lacks the %s scope: %w", p.KeyName, scope, errdefs.ErrPermissionDenied))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// sandboxRoute reports whether pattern's {id} is a sandbox id.
func sandboxRoute(pattern string) bool {
	_, path, _ := strings.Cut(pattern, " ")
	return strings.HasPrefix(path, "/v1/sandboxes/{id}")
}

// tenantsOf adapts the key store and the template service to what the
// manager asks of tenants. tsvc is set once the service exists (it needs
// the manager); until then (and in tests without one) templates are not
// checked.
type tenantsOf struct {
	keys *tenancy.Store
	tsvc *templatesvc.Service
	// allowPrivate are the server's --egress-allow-private ranges: what a
	// boundary's private CIDRs can open at all.
	allowPrivate []netip.Prefix
}

func (t *tenantsOf) UseTemplate(ctx context.Context, ref string, tmpl api.Template) error {
	if t.tsvc == nil {
		return nil
	}
	return t.tsvc.Usable(ctx, ref, tmpl)
}

func (t *tenantsOf) ClaimTag(ctx context.Context, tag string) error {
	if t.tsvc == nil {
		return nil
	}
	return t.tsvc.ClaimTag(ctx, tag)
}

func (t *tenantsOf) OwnTag(ctx context.Context, tag string) error {
	if t.tsvc == nil {
		return nil
	}
	return t.tsvc.OwnTag(ctx, tag)
}

func (t *tenantsOf) Quotas(ctx context.Context, tenant string) (api.Quotas, error) {
	tn, err := t.keys.GetTenant(ctx, tenant)
	return tn.Quotas, err
}

func (t *tenantsOf) Bound(ctx context.Context, tenant string, p api.NetworkPolicy) error {
	tn, err := t.keys.GetTenant(ctx, tenant)
	if err != nil || tn.Boundary == nil {
		return err
	}
	return boundaryCheck(p, *tn.Boundary, t.allowPrivate)
}

var _ sandbox.Tenants = (*tenantsOf)(nil)

func (part keysAPI) createKey(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var req api.CreateKeyRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	k, err := s.keys.CreateKey(r.Context(), req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindKey, Action: "create", Target: k.ID,
		Result: "ok", Detail: map[string]any{"name": k.Name, "tenant": k.Tenant, "scopes": k.Scopes}})
	writeJSON(w, http.StatusCreated, k)
}

func (part keysAPI) listKeys(w http.ResponseWriter, r *http.Request) {
	s := part.s
	keys, err := s.keys.ListKeys(r.Context(), r.URL.Query().Get("tenant"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	if keys == nil {
		keys = []api.APIKey{}
	}
	writeJSON(w, 200, api.KeyList{Keys: keys})
}

func (part keysAPI) revokeKey(w http.ResponseWriter, r *http.Request) {
	s := part.s
	id := r.PathValue("keyid")
	k, err := s.keys.GetKey(r.Context(), id)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if k.RevokedAt == nil && slices.Contains(k.Scopes, principal.ScopeAdmin) && s.keys.LiveAdmins() <= 1 {
		writeError(w, r, fmt.Errorf("key %s is the last admin key: create another admin key first: %w", id, errdefs.ErrConflict))
		return
	}
	if k, err = s.keys.RevokeKey(r.Context(), id); err != nil {
		writeError(w, r, err)
		return
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindKey, Action: "revoke", Target: id, Result: "ok"})
	writeJSON(w, 200, k)
}

// tenantWithUsage is t with what its sandboxes hold now.
func (part keysAPI) tenantWithUsage(ctx context.Context, name string) (api.Tenant, error) {
	s := part.s
	t, err := s.keys.GetTenant(ctx, name)
	if err != nil {
		return api.Tenant{}, err
	}
	u, err := s.mgr.Tenancy().Usage(ctx, name)
	if err != nil {
		return api.Tenant{}, err
	}
	t.Usage = &u
	return t, nil
}

func (part keysAPI) listTenants(w http.ResponseWriter, r *http.Request) {
	s := part.s
	ts, err := s.keys.ListTenants(r.Context())
	if err != nil {
		writeError(w, r, err)
		return
	}
	out := []api.Tenant{}
	for _, t := range ts {
		t, err := (keysAPI{s}).tenantWithUsage(r.Context(), t.Name)
		if err != nil {
			writeError(w, r, err)
			return
		}
		out = append(out, t)
	}
	writeJSON(w, 200, api.TenantList{Tenants: out})
}

// getTenant shows a tenant's quotas, boundary and usage: any key its own
// tenant's, admin any.
func (part keysAPI) getTenant(w http.ResponseWriter, r *http.Request) {
	s := part.s
	name := r.PathValue("name")
	p, _ := principal.From(r.Context())
	if err := tenancy.ValidTenant(name); err != nil {
		writeError(w, r, err)
		return
	}
	if !p.Sees(name) {
		writeError(w, r, fmt.Errorf("tenant %s not found: %w", name, errdefs.ErrNotFound))
		return
	}
	t, err := (keysAPI{s}).tenantWithUsage(r.Context(), name)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, t)
}

// putTenant sets a tenant's quotas and boundary. A boundary that a live
// sandbox of the tenant is already outside of is refused, naming the
// sandboxes: "the widest access any sandbox may ever get" must hold for
// the sandboxes that exist too.
func (part keysAPI) putTenant(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var t api.Tenant
	if err := decodeJSON(w, r, &t); err != nil {
		writeError(w, r, err)
		return
	}
	name := r.PathValue("name")
	if t.Name != "" && t.Name != name {
		writeError(w, r, fmt.Errorf("body names tenant %q but the path %q: %w", t.Name, name, errdefs.ErrInvalidArgument))
		return
	}
	t.Name = name
	if err := tenancy.ValidTenant(name); err != nil {
		writeError(w, r, err)
		return
	}
	if t.Boundary != nil {
		if err := sandbox.ValidatePolicy(*t.Boundary); err != nil {
			writeError(w, r, fmt.Errorf("boundary: %w", err))
			return
		}
		sbs, err := s.mgr.List(principal.With(r.Context(), principal.System), "", nil)
		if err != nil {
			writeError(w, r, err)
			return
		}
		var outside []string
		for _, sb := range sbs {
			if sandbox.TenantOf(sb) == name {
				if sb.Network != nil {
					if err := boundaryCheck(*sb.Network, *t.Boundary, s.cfg.Network.AllowPrivate); err != nil {
						outside = append(outside, sb.ID+" ("+err.Error()+")")
					}
				}
			}
		}
		if len(outside) > 0 {
			writeError(w, r, fmt.Errorf("sandboxes of tenant %s have policies outside that boundary; narrow or delete them first: %s: %w",
				name, strings.Join(outside, "; "), errdefs.ErrConflict))
			return
		}
	}
	t, err := s.keys.PutTenant(r.Context(), t)
	if err != nil {
		writeError(w, r, err)
		return
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindKey, Action: "tenant.put", Target: name, Result: "ok",
		Detail: map[string]any{"quotas": t.Quotas, "boundary": t.Boundary != nil}})
	t, err = (keysAPI{s}).tenantWithUsage(r.Context(), name)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, t)
}
