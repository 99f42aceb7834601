package sandbox

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
)

// fakeRecords is the store's sandbox list, in memory.
type fakeRecords struct {
	mu  sync.Mutex
	sbs []api.Sandbox
}

var _ sandboxLister = (*fakeRecords)(nil)

func (f *fakeRecords) ListSandboxes(context.Context, store.SandboxFilter) ([]api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]api.Sandbox(nil), f.sbs...), nil
}

func (f *fakeRecords) put(sb api.Sandbox) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sbs = append(f.sbs, sb)
	return nil
}

func (f *fakeRecords) get(_ context.Context, id string) (api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, sb := range f.sbs {
		if sb.ID == id {
			return sb, nil
		}
	}
	return api.Sandbox{}, errdefs.ErrNotFound
}

// quotaTenants gives every tenant the same quotas and refuses any
// boundary with an allowed destination.
type quotaTenants struct {
	noTenants
	q api.Quotas
}

func (t quotaTenants) Quotas(context.Context, string) (api.Quotas, error) { return t.q, nil }
func (t quotaTenants) Bound(_ context.Context, _ string, p api.NetworkPolicy) error {
	if len(p.AllowOut) > 0 {
		return errors.New("allow_out[0] is outside")
	}
	return nil
}

// TestTenancyWithoutTheManager: the Tenancy part on fakes — usage counts a
// tenant's own sandboxes and no pool member; admission holds concurrent
// creates to the quota (the last unit goes once); the boundary's refusal
// names the tenant; Visible hides another tenant's sandbox as missing.
func TestTenancyWithoutTheManager(t *testing.T) {
	ctx := context.Background()
	lim := api.Limits{CPUs: 1, MemoryMiB: 512, DiskMiB: 1024}
	recs := &fakeRecords{sbs: []api.Sandbox{
		{ID: "sb-a1", Tenant: "a", Limits: lim},
		{ID: "sb-b1", Tenant: "b", Limits: lim},
		{ID: "sb-pool", Labels: map[string]string{PoolLabel: "p"}, Limits: lim},
		{ID: "sb-old", Limits: lim}, // a record from before tenants: the default tenant's
	}}
	tn := newTenancy(recs, quotaTenants{q: api.Quotas{Sandboxes: 3}}, recs.get)

	u, err := tn.Usage(ctx, "a")
	if err != nil || u != (api.Usage{Sandboxes: 1, CPUs: 1, MemoryMiB: 512, DiskMiB: 1024}) {
		t.Fatalf("usage of a: %+v %v", u, err)
	}
	if u, _ := tn.Usage(ctx, principal.DefaultTenant); u.Sandboxes != 1 {
		t.Fatalf("the default tenant's usage counts %d sandboxes, want the tenantless record only", u.Sandboxes)
	}

	// Ten creates at once for tenant a, two units left: two get in.
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted, refused := 0, 0
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := tn.admitAndPut(ctx, "a", func() error {
				return recs.put(api.Sandbox{ID: "sb-new" + string(rune('0'+i)), Tenant: "a", Limits: lim})
			}, lim)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				refused++
			} else {
				admitted++
			}
		}()
	}
	wg.Wait()
	if admitted != 2 || refused != 8 {
		t.Fatalf("admitted %d, refused %d; want 2 and 8 under a quota of 3 with 1 used", admitted, refused)
	}

	if err := tn.bound(ctx, "a", api.NetworkPolicy{AllowOut: []string{"example.test"}}); err == nil || !strings.Contains(err.Error(), "tenant a's boundary") {
		t.Fatalf("bound: %v", err)
	}
	if err := tn.bound(ctx, "a", api.NetworkPolicy{}); err != nil {
		t.Fatalf("bound of an empty policy: %v", err)
	}

	asA := principal.With(ctx, principal.Principal{KeyName: "k", Tenant: "a"})
	if _, err := tn.Visible(asA, "sb-a1"); err != nil {
		t.Fatalf("a's own sandbox: %v", err)
	}
	if _, err := tn.Visible(asA, "sb-b1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("b's sandbox as a: %v, want not found", err)
	}
}
