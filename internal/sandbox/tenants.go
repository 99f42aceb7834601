package sandbox

import (
	"context"
	"fmt"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/tenancy"
)

// Tenants is what the manager asks about a tenant before a sandbox of it
// is created or its network policy widened.
type Tenants interface {
	// Quotas returns the tenant's quotas (zero fields: unlimited).
	Quotas(ctx context.Context, tenant string) (api.Quotas, error)
	// Bound checks p against the tenant's network boundary; the error
	// (invalid argument) names every entry of p outside it.
	Bound(ctx context.Context, tenant string, p api.NetworkPolicy) error
	// UseTemplate checks that the caller in ctx may create a sandbox from
	// template t, which ref names (ErrNotFound if it may not see it).
	UseTemplate(ctx context.Context, ref string, t api.Template) error
	// ClaimTag checks that the caller in ctx may point template tag at a
	// new template; OwnTag records it as the tag's owner after.
	ClaimTag(ctx context.Context, tag string) error
	OwnTag(ctx context.Context, tag string) error
}

// noTenants has no quotas and no boundaries.
type noTenants struct{}

func (noTenants) Quotas(context.Context, string) (api.Quotas, error)      { return api.Quotas{}, nil }
func (noTenants) Bound(context.Context, string, api.NetworkPolicy) error  { return nil }
func (noTenants) UseTemplate(context.Context, string, api.Template) error { return nil }
func (noTenants) ClaimTag(context.Context, string) error                  { return nil }
func (noTenants) OwnTag(context.Context, string) error                    { return nil }

var _ Tenants = noTenants{}

// tenantOf is the tenant a request acts for: its principal's, else the
// default (the server's own work).
func tenantOf(ctx context.Context) string {
	if p, ok := principal.From(ctx); ok && p.Tenant != "" {
		return p.Tenant
	}
	return principal.DefaultTenant
}

// TenantOf is the tenant of sb; records from before tenants belong to the
// default one.
func TenantOf(sb api.Sandbox) string {
	if sb.Tenant == "" {
		return principal.DefaultTenant
	}
	return sb.Tenant
}

// sandboxLister is what the Tenancy part reads of the store.
type sandboxLister interface {
	ListSandboxes(ctx context.Context, f store.SandboxFilter) ([]api.Sandbox, error)
}

var _ sandboxLister = (*store.DB)(nil)

// newTenancy makes the Tenancy part from what it needs, not the Manager:
// the sandbox records (for usage), the tenants' quotas and boundaries, and
// get, which returns a sandbox by id (for Visible).
func newTenancy(sandboxes sandboxLister, tenants Tenants, get func(ctx context.Context, id string) (api.Sandbox, error)) *Tenancy {
	return &Tenancy{sandboxes: sandboxes, tenants: tenants, get: get}
}

// Usage sums what the sandboxes of tenant hold now.
func (part *Tenancy) Usage(ctx context.Context, tenant string) (api.Usage, error) {
	sbs, err := part.sandboxes.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		return api.Usage{}, err
	}
	var mine []api.Sandbox
	for _, sb := range sbs {
		if TenantOf(sb) == tenant && !isPoolMember(sb) {
			mine = append(mine, sb)
		}
	}
	return tenancy.UsageOf(mine), nil
}

// admit checks that tenant's quotas allow sandboxes with limits add and
// returns holding the quota lock: release it once the records it admitted
// are stored. One lock across check and insert, so two concurrent creates
// cannot both take the last unit of a quota. A tenant without quotas
// takes no lock.
func (part *Tenancy) admit(ctx context.Context, tenant string, add ...api.Limits) (release func(), err error) {
	q, err := part.tenants.Quotas(ctx, tenant)
	if err != nil {
		return nil, err
	}
	if q == (api.Quotas{}) {
		return func() {}, nil
	}
	part.admitMu.Lock()
	u, err := part.Usage(ctx, tenant)
	if err == nil {
		err = tenancy.Admit(q, u, add...)
	}
	if err != nil {
		part.admitMu.Unlock()
		return nil, err
	}
	return part.admitMu.Unlock, nil
}

// admitAndPut stores new sandbox records if their tenant's quotas allow
// them (admit).
func (part *Tenancy) admitAndPut(ctx context.Context, tenant string, put func() error, add ...api.Limits) error {
	release, err := part.admit(ctx, tenant, add...)
	if err != nil {
		return err
	}
	defer release()
	return put()
}

// bound checks p against tenant's boundary.
func (part *Tenancy) bound(ctx context.Context, tenant string, p api.NetworkPolicy) error {
	if err := part.tenants.Bound(ctx, tenant, p); err != nil {
		return fmt.Errorf("network policy outside tenant %s's boundary: %w", tenant, err)
	}
	return nil
}

// Visible returns sandbox id if the caller in ctx may see it; another
// tenant's sandbox is not found, exactly like one that does not exist.
func (part *Tenancy) Visible(ctx context.Context, id string) (api.Sandbox, error) {
	sb, err := part.get(ctx, id)
	if err != nil {
		return api.Sandbox{}, err
	}
	if p, ok := principal.From(ctx); ok && !p.Sees(sb.Tenant) {
		return api.Sandbox{}, fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	return sb, nil
}
