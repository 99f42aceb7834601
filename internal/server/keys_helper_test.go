package server

import (
	"context"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/tenancy"
)

// withKeys gives a hand-built test server its key store, holding s.apiKey
// as the admin key (in s.db, else in a database of its own).
func withKeys(t testing.TB, s *Server) *Server {
	t.Helper()
	db := s.db
	if db == nil {
		var err error
		if db, err = store.Open(":memory:"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
	}
	if s.keys == nil {
		s.keys = testKeyStore(t, db, s.apiKey)
	}
	if s.audit == nil {
		s.audit = audit.Nop{}
	}
	return s
}

// testKeyStore is a key store in db holding key as the admin key.
func testKeyStore(t testing.TB, db *store.DB, key string) *tenancy.Store {
	t.Helper()
	keys, err := tenancy.Open(context.Background(), db.SQL())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := keys.ImportKey(context.Background(), api.CreateKeyRequest{Name: "admin", Scopes: []string{principal.ScopeAdmin}}, key); err != nil {
		t.Fatal(err)
	}
	return keys
}
