package templatesvc

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/tenancy"
)

// TestTenantsTemplates: a tenant sees shared templates and its own, never
// another's (not found, as a missing one); it cannot move or remove shared
// tags or take another tenant's names.
func TestTenantsTemplates(t *testing.T) {
	s := newService(t, &fakeSandboxes{}, map[string]runtime.Runtime{})
	db, err := store.Open(":memory:")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	owners, err := tenancy.Open(context.Background(), db.SQL())
	if err != nil {
		t.Fatal(err)
	}
	s.cfg.Owners = owners
	admin := principal.With(context.Background(), principal.Principal{Tenant: "default", Scopes: []string{principal.ScopeAdmin}})
	a := principal.With(context.Background(), principal.Principal{Tenant: "team-a", Scopes: []string{principal.ScopeTemplatesWrite}})
	b := principal.With(context.Background(), principal.Principal{Tenant: "team-b", Scopes: []string{principal.ScopeTemplatesWrite}})

	if _, err := s.Import(admin, FormatTar, bytes.NewReader(rootfsTar(t, "shared")), []string{"shared:1"}); err != nil {
		t.Fatal(err)
	}
	ta, err := s.Import(a, FormatTar, bytes.NewReader(rootfsTar(t, "a")), []string{"app:1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Import(b, FormatTar, bytes.NewReader(rootfsTar(t, "b")), []string{"app:1"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("team-b importing as team-a's tag: %v, want conflict", err)
	}
	// What each sees.
	names := func(ctx context.Context) map[string]bool {
		ts, err := s.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, t := range ts {
			for _, tag := range t.Tags {
				out[tag] = true
			}
		}
		return out
	}
	if n := names(b); !n["shared:1"] || n["app:1"] || len(n) != 1 {
		t.Errorf("team-b sees %v", n)
	}
	if n := names(a); !n["shared:1"] || !n["app:1"] || len(n) != 2 {
		t.Errorf("team-a sees %v", n)
	}
	if n := names(admin); len(n) != 2 {
		t.Errorf("admin sees %v", n)
	}
	for _, ref := range []string{"app:1", ta.Digest} {
		if _, err := s.Get(b, ref); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("team-b get %s: %v, want not found", ref, err)
		}
		if err := s.Export(b, ref, &bytes.Buffer{}); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("team-b export %s: %v", ref, err)
		}
		if err := s.Remove(b, ref, false); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("team-b remove %s: %v", ref, err)
		}
	}
	if _, err := s.Tag(b, "app:1", "mine:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("team-b tagging team-a's template: %v", err)
	}
	// Shared tags: seen, used, never moved or removed by a tenant.
	if _, err := s.Tag(b, "shared:1", "mine:1"); err != nil {
		t.Errorf("team-b tagging a shared template as its own: %v", err)
	}
	if _, err := s.Tag(b, "mine:1", "shared:1"); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("team-b moving a shared tag: %v", err)
	}
	if err := s.Remove(b, "shared:1", false); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("team-b removing a shared tag: %v", err)
	}
	if n := names(a); n["mine:1"] {
		t.Errorf("team-a sees team-b's tag: %v", n)
	}
	// A tenant removes its own; the name is free again after.
	if err := s.Remove(a, "app:1", false); err != nil {
		t.Errorf("team-a removing its own tag: %v", err)
	}
	if _, err := s.Import(b, FormatTar, bytes.NewReader(rootfsTar(t, "b")), []string{"app:1"}); err != nil {
		t.Errorf("team-b taking a freed name: %v", err)
	}
}
