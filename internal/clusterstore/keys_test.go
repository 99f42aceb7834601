package clusterstore

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func testKey(id, tenant string) api.APIKey {
	return api.APIKey{ID: id, Name: id, Tenant: tenant, Scopes: []string{"sandbox:read"}, Prefix: "sk_" + id, CreatedAt: time.Now().UTC().Truncate(time.Millisecond)}
}

func TestKeysShareAcrossReplicas(t *testing.T) {
	s, dsn := open(t)
	ctx := context.Background()
	// Four replicas starting on an empty table: exactly one first key.
	var wg sync.WaitGroup
	stored := make(chan string, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := Open(ctx, dsn)
			if err != nil {
				t.Error(err)
				return
			}
			defer r.Close()
			id := string(rune('a' + i))
			ok, err := r.Keys().AddFirstKey(ctx, testKey("first-"+id, "default"), "digest-"+id)
			if err != nil {
				t.Error(err)
			}
			if ok {
				stored <- id
			}
		}()
	}
	wg.Wait()
	close(stored)
	var winners []string
	for id := range stored {
		winners = append(winners, id)
	}
	if len(winners) != 1 {
		t.Fatalf("first key stored by %v, want exactly one replica", winners)
	}
	if err := s.Keys().AddKey(ctx, testKey("k2", "acme"), "digest-k2"); err != nil {
		t.Fatal(err)
	}
	if err := s.Keys().AddKey(ctx, testKey("k3", "acme"), "digest-k2"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a second key with the same digest: %v", err)
	}
	k, err := s.Keys().LiveKey(ctx, "digest-k2")
	if err != nil || k.ID != "k2" || k.Tenant != "acme" || len(k.Scopes) != 1 || k.RevokedAt != nil {
		t.Fatalf("live key %+v %v", k, err)
	}
	if _, err := s.Keys().LiveKey(ctx, "nope"); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Fatalf("unknown digest: %v", err)
	}
	if keys, err := s.Keys().Keys(ctx, "acme"); err != nil || len(keys) != 1 {
		t.Fatalf("acme's keys %v %v", keys, err)
	}
	if keys, _ := s.Keys().Keys(ctx, ""); len(keys) != 2 {
		t.Fatalf("all keys %v", keys)
	}
	r1, err := s.Keys().RevokeKey(ctx, "k2")
	if err != nil || r1.RevokedAt == nil {
		t.Fatalf("revoke %+v %v", r1, err)
	}
	r2, _ := s.Keys().RevokeKey(ctx, "k2")
	if r2.RevokedAt == nil || !r2.RevokedAt.Equal(*r1.RevokedAt) {
		t.Fatalf("revoking twice moved the time: %v then %v", r1.RevokedAt, r2.RevokedAt)
	}
	if _, err := s.Keys().LiveKey(ctx, "digest-k2"); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Fatalf("revoked key still live: %v", err)
	}
	if _, err := s.Keys().RevokeKey(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("revoke unknown: %v", err)
	}
}

func TestIdempotencyKeyGivesOneRow(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	beat(t, s, "n1")
	beat(t, s, "n2")
	req := api.CreateSandboxRequest{Template: "base:latest"}
	if err := s.Sandboxes().AddSandboxRecord(ctx, NewSandbox{ID: "a", Node: "n1", Tenant: "acme", IdempotencyKey: "k1", CreateOperation: "op-1", Request: req}); err != nil {
		t.Fatal(err)
	}
	// The same key from the same tenant, made on another node: refused.
	if err := s.Sandboxes().AddSandboxRecord(ctx, NewSandbox{ID: "b", Node: "n2", Tenant: "acme", IdempotencyKey: "k1", Request: req}); !errors.Is(err, ErrIdempotencyKeyUsed) || !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second row under one key: %v", err)
	}
	// Another tenant may use the same key; no key never conflicts.
	if err := s.Sandboxes().AddSandboxRecord(ctx, NewSandbox{ID: "c", Node: "n2", Tenant: "other", IdempotencyKey: "k1", Request: req}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"d", "e"} {
		if err := s.Sandboxes().AddSandbox(ctx, id, "n2", "acme", req); err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.Sandboxes().SandboxByKey(ctx, "acme", "k1")
	if err != nil || got.ID != "a" || got.Node != "n1" || got.CreateOperation != "op-1" {
		t.Fatalf("by key: %+v %v", got, err)
	}
	if _, err := s.Sandboxes().SandboxByKey(ctx, "acme", "k2"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown key: %v", err)
	}
	if all, _ := s.Sandboxes().Sandboxes(ctx, ""); len(all) != 4 {
		t.Fatalf("all rows %d, want 4", len(all))
	}
	if acme, _ := s.Sandboxes().Sandboxes(ctx, "acme"); len(acme) != 3 {
		t.Fatalf("acme's rows %d, want 3", len(acme))
	}
}
