package replica

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/tenancy"
)

// settingsStore is what tenants and policy rule sets keep in the cluster's
// settings.
type settingsStore interface {
	tenantStore
	Settings(ctx context.Context) (clusterstore.Settings, error)
	PutTenant(ctx context.Context, t api.Tenant) error
	PutRules(ctx context.Context, rs api.PolicyRuleSet) error
	DeleteRules(ctx context.Context, scope string) error
}

var _ settingsStore = (*clusterstore.SettingsStore)(nil)

// settings serves tenants and policy rule sets: checked here as a single
// box checks them, stored in PostgreSQL, mirrored by every node within
// its poll (NOTIFY makes it sooner).
type settings struct {
	store settingsStore
	rows  sandboxCounter // a tenant's usage
	nodes *nodeClient    // a sandbox scope's row
}

func (s *settings) listTenants(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	st, err := s.store.Settings(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusOK, api.TenantList{Tenants: st.Tenants})
}

func (s *settings) getTenant(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	name := req.PathValue("name")
	if err := tenancy.ValidTenant(name); err != nil {
		server.WriteError(w, req, err)
		return
	}
	if !p.Sees(name) {
		server.WriteError(w, req, fmt.Errorf("tenant %s not found: %w", name, errdefs.ErrNotFound))
		return
	}
	t, err := s.store.Tenant(req.Context(), name)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	n, err := s.rows.CountSandboxes(req.Context(), name)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	t.Usage = &api.Usage{Sandboxes: n}
	server.WriteJSON(w, http.StatusOK, t)
}

// putTenant stores a tenant's quotas and boundary in the cluster. Unlike a
// single box, a boundary is not checked against the tenant's running
// sandboxes (they are on the nodes): it binds their next policy change.
func (s *settings) putTenant(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	var t api.Tenant
	if err := server.DecodeJSON(w, req, &t); err != nil {
		server.WriteError(w, req, err)
		return
	}
	name := req.PathValue("name")
	if t.Name != "" && t.Name != name {
		server.WriteError(w, req, fmt.Errorf("body names tenant %q but the path %q: %w", t.Name, name, errdefs.ErrInvalidArgument))
		return
	}
	t.Name = name
	if err := tenancy.ValidTenant(name); err != nil {
		server.WriteError(w, req, err)
		return
	}
	q := t.Quotas
	if q.Sandboxes < 0 || q.CPUs < 0 || q.MemoryMiB < 0 || q.DiskMiB < 0 {
		server.WriteError(w, req, fmt.Errorf("quotas must not be negative (0 = unlimited): %w", errdefs.ErrInvalidArgument))
		return
	}
	if t.Boundary != nil {
		if err := sandbox.ValidatePolicy(*t.Boundary); err != nil {
			server.WriteError(w, req, fmt.Errorf("boundary: %w", err))
			return
		}
	}
	if err := s.store.PutTenant(req.Context(), t); err != nil {
		server.WriteError(w, req, err)
		return
	}
	t.Usage = nil
	server.WriteJSON(w, http.StatusOK, t)
}

// canScope is the single box's rule for who may see a policy scope
// (server.CanSeeScope), with a sandbox's tenant read from its row.
func (s *settings) canScope(ctx context.Context, p principal.Principal, scope string) error {
	return server.CanSeeScope(ctx, p, scope, func(ctx context.Context, id string) error {
		_, err := s.nodes.sandboxRow(ctx, id, &p)
		return err
	})
}

func (s *settings) policyScope(req *http.Request, p principal.Principal) (string, error) {
	scope := req.PathValue("scope")
	if err := policy.ValidScope(scope); err != nil {
		return "", err
	}
	return scope, s.canScope(req.Context(), p, scope)
}

func (s *settings) listRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	st, err := s.store.Settings(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	out := api.PolicyRuleSetList{RuleSets: []api.PolicyRuleSet{}}
	for _, rs := range st.Rules {
		if s.canScope(req.Context(), p, rs.Scope) == nil {
			out.RuleSets = append(out.RuleSets, rs)
		}
	}
	server.WriteJSON(w, http.StatusOK, out)
}

func (s *settings) getRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	scope, err := s.policyScope(req, p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	st, err := s.store.Settings(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	for _, rs := range st.Rules {
		if rs.Scope == scope {
			server.WriteJSON(w, http.StatusOK, rs)
			return
		}
	}
	server.WriteError(w, req, fmt.Errorf("no rule set is attached to %s: %w", scope, errdefs.ErrNotFound))
}

// putRules compiles the rule set here (a set no node could load is
// refused before any node sees it) and stores it for the nodes to mirror.
func (s *settings) putRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	var rs api.PolicyRuleSet
	if err := server.DecodeJSON(w, req, &rs); err != nil {
		server.WriteError(w, req, err)
		return
	}
	scope, err := s.policyScope(req, p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if rs.Scope != "" && rs.Scope != scope {
		server.WriteError(w, req, fmt.Errorf("body's scope %q differs from the path's %q: %w", rs.Scope, scope, errdefs.ErrInvalidArgument))
		return
	}
	if rs.Rules == nil {
		rs.Rules = []api.PolicyRule{}
	}
	now := time.Now().UTC()
	rs.Scope, rs.UpdatedAt = scope, &now
	if _, err := policy.Compile(rs); err != nil {
		server.WriteError(w, req, err)
		return
	}
	if err := s.store.PutRules(req.Context(), rs); err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusOK, rs)
}

func (s *settings) deleteRules(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	scope, err := s.policyScope(req, p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if err := s.store.DeleteRules(req.Context(), scope); err != nil {
		server.WriteError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
