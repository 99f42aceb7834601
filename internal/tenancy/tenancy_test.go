package tenancy

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
)

// TestKeysStoredAsDigests: a key authenticates to its principal until
// revoked, and the database file never holds the key itself.
func TestKeysStoredAsDigests(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "space.db")
	db, err := store.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Open(ctx, db.SQL())
	if err != nil {
		t.Fatal(err)
	}
	k, err := s.CreateKey(ctx, api.CreateKeyRequest{Name: "ci", Tenant: "team-a", Scopes: []string{"files:read", "sandbox:write", "files:read"}})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(k.Scopes, ",") != "files:read,sandbox:write" || !strings.HasPrefix(k.Key, k.Prefix) || len(k.Prefix) >= len(k.Key) {
		t.Fatalf("created %+v", k)
	}
	p, err := s.Authenticate(k.Key)
	if err != nil || p.Tenant != "team-a" || p.KeyID != k.ID || !p.Can(principal.ScopeFilesRead) || p.Can(principal.ScopeFilesWrite) || !p.Can(principal.ScopeSandboxRead) {
		t.Fatalf("principal %+v, %v", p, err)
	}
	if _, err := s.Authenticate(k.Key + "x"); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Errorf("a wrong key: %v", err)
	}
	// A store opened afresh (a restarted server) knows the key too.
	s2, err := Open(ctx, db.SQL())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s2.Authenticate(k.Key); err != nil {
		t.Errorf("after reopening: %v", err)
	}
	if _, err := s.RevokeKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Authenticate(k.Key); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Errorf("a revoked key: %v", err)
	}
	db.Close()
	for _, f := range []string{path, path + "-wal"} {
		b, _ := os.ReadFile(f)
		if strings.Contains(string(b), k.Key) || strings.Contains(string(b), k.Key[3:]) {
			t.Errorf("%s holds the key in clear", filepath.Base(f))
		}
	}
}

func TestAdmit(t *testing.T) {
	q := api.Quotas{Sandboxes: 2, MemoryMiB: 1024, CPUs: 2}
	u := UsageOf([]api.Sandbox{{Limits: api.Limits{MemoryMiB: 512, CPUs: 1}}})
	if err := Admit(q, u, api.Limits{MemoryMiB: 512, CPUs: 1}); err != nil {
		t.Errorf("exactly at the quota: %v", err)
	}
	err := Admit(q, u, api.Limits{MemoryMiB: 513, CPUs: 0.5})
	if !errors.Is(err, errdefs.ErrQuotaExceeded) || !strings.Contains(err.Error(), "memory: 512 MiB used + 513 MiB asked > quota 1024 MiB") {
		t.Errorf("over memory: %v", err)
	}
	if err := Admit(q, u, api.Limits{}, api.Limits{}); err == nil || !strings.Contains(err.Error(), "sandboxes: 1 used + 2 asked > quota 2") {
		t.Errorf("a fork of two over the sandbox quota: %v", err)
	}
	if err := Admit(api.Quotas{}, api.Usage{Sandboxes: 1000}, api.Limits{MemoryMiB: 1 << 20}); err != nil {
		t.Errorf("no quotas: %v", err)
	}
}
