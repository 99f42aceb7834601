package clusterstore

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func TestSettingsWakeListeners(t *testing.T) {
	s, _ := open(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	woke := make(chan struct{}, 16)
	go s.Settings().ListenSettings(ctx, func() { woke <- struct{}{} })
	select {
	case <-woke: // the wake after connecting
	case <-time.After(5 * time.Second):
		t.Fatal("no wake after LISTEN")
	}
	expectWake := func(what string) {
		t.Helper()
		select {
		case <-woke:
		case <-time.After(5 * time.Second):
			t.Fatalf("no wake after %s", what)
		}
	}
	if got, err := s.Settings().Tenant(ctx, "acme"); err != nil || got.Name != "acme" || got.Boundary != nil {
		t.Fatalf("unconfigured tenant: %+v %v", got, err)
	}
	b := &api.NetworkPolicy{AllowOut: []string{"example.com"}}
	if err := s.Settings().PutTenant(ctx, api.Tenant{Name: "acme", Quotas: api.Quotas{Sandboxes: 2}, Boundary: b}); err != nil {
		t.Fatal(err)
	}
	expectWake("a tenant change")
	if err := s.Settings().PutRules(ctx, api.PolicyRuleSet{Scope: "tenant:acme", Rules: []api.PolicyRule{}}); err != nil {
		t.Fatal(err)
	}
	expectWake("a rule set change")
	st, err := s.Settings().Settings(ctx)
	if err != nil || len(st.Tenants) != 1 || st.Tenants[0].Quotas.Sandboxes != 2 || st.Tenants[0].Boundary == nil ||
		st.Tenants[0].UpdatedAt == nil || len(st.Rules) != 1 || st.Rules[0].Scope != "tenant:acme" {
		t.Fatalf("settings %+v %v", st, err)
	}
	if err := s.Settings().DeleteRules(ctx, "tenant:acme"); err != nil {
		t.Fatal(err)
	}
	expectWake("a rule set removal")
	if err := s.Settings().DeleteRules(ctx, "tenant:acme"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("removing a missing rule set: %v", err)
	}
	beat(t, s, "n1")
	for _, id := range []string{"a", "b"} {
		if err := s.Sandboxes().AddSandbox(ctx, id, "n1", "acme", api.CreateSandboxRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sandboxes().SetDesired(ctx, "b", DesiredDeleted); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Sandboxes().CountSandboxes(ctx, "acme"); err != nil || n != 1 {
		t.Fatalf("acme counts %d %v, want 1 (one is being deleted)", n, err)
	}
}
