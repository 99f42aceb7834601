// Package tenancy keeps the server's API keys and tenants: who may call,
// for which tenant, with which scopes, and what each tenant may hold
// (quotas) and reach (its network boundary).
//
// Keys are stored as SHA-256 digests of the whole key: a key is 192 random
// bits, so a fast hash is enough to make a stolen store useless (no
// dictionary to try), and lookups stay one indexed read. The key itself
// is shown once, by CreateKey.
package tenancy

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
)

// schema is the tenancy_ tables; its version lives in tenancy_schema
// (PRAGMA user_version belongs to internal/store).
var schema = []string{`
CREATE TABLE tenancy_keys (
	id         TEXT PRIMARY KEY,
	digest     TEXT NOT NULL UNIQUE,
	name       TEXT NOT NULL,
	tenant     TEXT NOT NULL,
	scopes     TEXT NOT NULL,
	prefix     TEXT NOT NULL,
	created_at INTEGER NOT NULL,
	last_used  INTEGER,
	revoked_at INTEGER
);
CREATE TABLE tenancy_tenants (
	name       TEXT PRIMARY KEY,
	quotas     TEXT NOT NULL,
	boundary   TEXT,
	updated_at INTEGER NOT NULL
);`, `
CREATE TABLE tenancy_template_tags (
	tag    TEXT PRIMARY KEY,
	tenant TEXT NOT NULL
);`}

// Store is the keys and tenants of one server. Safe for concurrent use.
type Store struct {
	db *sql.DB

	mu    sync.RWMutex
	byDig map[string]api.APIKey // digest → live key: authentication never reads the database
	used  map[string]time.Time  // key id → last use not yet written
}

// Open migrates the tenancy tables of db and loads the live keys.
func Open(ctx context.Context, db *sql.DB) (*Store, error) {
	s := &Store{db: db, used: map[string]time.Time{}}
	if err := s.migrate(ctx); err != nil {
		return nil, fmt.Errorf("tenancy schema: %w", err)
	}
	if err := s.load(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Store) migrate(ctx context.Context) error {
	return store.MigrateTables(ctx, s.db, "tenancy", schema)
}

func (s *Store) load(ctx context.Context) error {
	keys, digests, err := s.query(ctx, `WHERE revoked_at IS NULL`)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byDig = map[string]api.APIKey{}
	for i, k := range keys {
		s.byDig[digests[i]] = k
	}
	return nil
}

func digest(key string) string {
	d := sha256.Sum256([]byte(key))
	return hex.EncodeToString(d[:])
}

var (
	nameRE   = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$`)
	tenantRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)
)

// ValidTenant checks a tenant name: lowercase letters, digits and '-', ≤ 63.
func ValidTenant(t string) error {
	if !tenantRE.MatchString(t) {
		return fmt.Errorf("tenant %q must be 1-63 lowercase letters, digits or '-', starting with a letter or digit: %w", clip(t), errdefs.ErrInvalidArgument)
	}
	return nil
}

// ValidScopes checks scopes against principal.AllScopes and returns them
// sorted and without duplicates.
func ValidScopes(scopes []string) ([]string, error) {
	if len(scopes) == 0 {
		return nil, fmt.Errorf("a key needs at least one scope (one of %s): %w", strings.Join(principal.AllScopes, ", "), errdefs.ErrInvalidArgument)
	}
	out := make([]string, 0, len(scopes))
	for _, sc := range scopes {
		sc = strings.TrimSpace(sc)
		if !slices.Contains(principal.AllScopes, sc) {
			return nil, fmt.Errorf("unknown scope %q (scopes: %s): %w", clip(sc), strings.Join(principal.AllScopes, ", "), errdefs.ErrInvalidArgument)
		}
		out = append(out, sc)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// NewKeySecret returns a fresh key: "sk_" and 48 hex digits.
func NewKeySecret() string {
	var b [24]byte
	rand.Read(b[:])
	return "sk_" + hex.EncodeToString(b[:])
}

// CreateKey stores a new key and returns it with its secret, which is
// never available again.
func (s *Store) CreateKey(ctx context.Context, req api.CreateKeyRequest) (api.CreatedKey, error) {
	secret := NewKeySecret()
	k, err := s.ImportKey(ctx, req, secret)
	if err != nil {
		return api.CreatedKey{}, err
	}
	return api.CreatedKey{APIKey: k, Key: secret}, nil
}

// NewKey checks a key request and builds the key record for secret, and
// the digest it is found by. Storing it is the caller's (this store, or the
// cluster's PostgreSQL).
func NewKey(req api.CreateKeyRequest, secret string) (api.APIKey, string, error) {
	if !nameRE.MatchString(req.Name) {
		return api.APIKey{}, "", fmt.Errorf("key name %q must be 1-63 letters, digits, '.', '_' or '-': %w", clip(req.Name), errdefs.ErrInvalidArgument)
	}
	if req.Tenant == "" {
		req.Tenant = principal.DefaultTenant
	}
	if err := ValidTenant(req.Tenant); err != nil {
		return api.APIKey{}, "", err
	}
	scopes, err := ValidScopes(req.Scopes)
	if err != nil {
		return api.APIKey{}, "", err
	}
	if len(secret) < 16 {
		return api.APIKey{}, "", fmt.Errorf("a key must be at least 16 characters: %w", errdefs.ErrInvalidArgument)
	}
	var idb [6]byte
	rand.Read(idb[:])
	k := api.APIKey{
		ID: "key_" + hex.EncodeToString(idb[:]), Name: req.Name, Tenant: req.Tenant, Scopes: scopes,
		Prefix: secret[:min(len(secret), 9)], CreatedAt: time.Now().UTC().Truncate(time.Millisecond),
	}
	return k, Digest(secret), nil
}

// Digest is what a key is stored and looked up by.
func Digest(secret string) string { return digest(secret) }

// ImportKey stores secret as a key (the server's first key, kept in its
// api-key file for the local CLI, is imported this way).
func (s *Store) ImportKey(ctx context.Context, req api.CreateKeyRequest, secret string) (api.APIKey, error) {
	k, dig, err := NewKey(req, secret)
	if err != nil {
		return api.APIKey{}, err
	}
	sj, _ := json.Marshal(k.Scopes)
	if _, err := s.db.ExecContext(ctx, `INSERT INTO tenancy_keys (id, digest, name, tenant, scopes, prefix, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)`,
		k.ID, dig, k.Name, k.Tenant, string(sj), k.Prefix, k.CreatedAt.UnixMilli()); err != nil {
		if strings.Contains(err.Error(), "UNIQUE") {
			return api.APIKey{}, fmt.Errorf("that key is already stored: %w", errdefs.ErrConflict)
		}
		return api.APIKey{}, err
	}
	s.mu.Lock()
	s.byDig[dig] = k
	s.mu.Unlock()
	return k, nil
}

// Authenticate returns the principal of a live key.
func (s *Store) Authenticate(secret string) (principal.Principal, error) {
	dig := digest(secret)
	s.mu.RLock()
	k, ok := s.byDig[dig]
	s.mu.RUnlock()
	if !ok {
		return principal.Principal{}, fmt.Errorf("missing, wrong or revoked API key: %w", errdefs.ErrUnauthorized)
	}
	s.mu.Lock()
	s.used[k.ID] = time.Now()
	s.mu.Unlock()
	return principal.Principal{KeyID: k.ID, KeyName: k.Name, Tenant: k.Tenant, Scopes: slices.Clone(k.Scopes)}, nil
}

// FlushUsage writes the keys' last-use times (batched: authentication
// never waits for a write).
func (s *Store) FlushUsage(ctx context.Context) error {
	s.mu.Lock()
	used := s.used
	s.used = map[string]time.Time{}
	s.mu.Unlock()
	for id, t := range used {
		if _, err := s.db.ExecContext(ctx, `UPDATE tenancy_keys SET last_used = ? WHERE id = ?`, t.UnixMilli(), id); err != nil {
			return err
		}
	}
	return nil
}

// CountKeys is the number of keys ever created (revoked included).
func (s *Store) CountKeys(ctx context.Context) (int, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM tenancy_keys`).Scan(&n)
	return n, err
}

// ListKeys lists keys, of one tenant or ("") all.
func (s *Store) ListKeys(ctx context.Context, tenant string) ([]api.APIKey, error) {
	where, args := `ORDER BY created_at, id`, []any{}
	if tenant != "" {
		where, args = `WHERE tenant = ? ORDER BY created_at, id`, []any{tenant}
	}
	keys, _, err := s.query(ctx, where, args...)
	return keys, err
}

// GetKey returns one key by id.
func (s *Store) GetKey(ctx context.Context, id string) (api.APIKey, error) {
	keys, _, err := s.query(ctx, `WHERE id = ?`, id)
	if err != nil {
		return api.APIKey{}, err
	}
	if len(keys) == 0 {
		return api.APIKey{}, fmt.Errorf("key %q not found: %w", clip(id), errdefs.ErrNotFound)
	}
	return keys[0], nil
}

// RevokeKey revokes a key; it stops working at once. Revoking a revoked
// key is a no-op.
func (s *Store) RevokeKey(ctx context.Context, id string) (api.APIKey, error) {
	k, err := s.GetKey(ctx, id)
	if err != nil {
		return api.APIKey{}, err
	}
	if k.RevokedAt == nil {
		now := time.Now().UTC().Truncate(time.Millisecond)
		if _, err := s.db.ExecContext(ctx, `UPDATE tenancy_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL`, now.UnixMilli(), id); err != nil {
			return api.APIKey{}, err
		}
		k.RevokedAt = &now
	}
	s.mu.Lock()
	for d, lk := range s.byDig {
		if lk.ID == id {
			delete(s.byDig, d)
		}
	}
	s.mu.Unlock()
	return k, nil
}

// LiveAdmins counts unrevoked admin keys (the last one cannot be revoked:
// nobody could administer the server after).
func (s *Store) LiveAdmins() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := 0
	for _, k := range s.byDig {
		if slices.Contains(k.Scopes, principal.ScopeAdmin) {
			n++
		}
	}
	return n
}

func (s *Store) query(ctx context.Context, where string, args ...any) ([]api.APIKey, []string, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, digest, name, tenant, scopes, prefix, created_at, last_used, revoked_at FROM tenancy_keys `+where, args...)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	var keys []api.APIKey
	var digs []string
	for rows.Next() {
		var k api.APIKey
		var dig, scopes string
		var created int64
		var used, revoked sql.NullInt64
		if err := rows.Scan(&k.ID, &dig, &k.Name, &k.Tenant, &scopes, &k.Prefix, &created, &used, &revoked); err != nil {
			return nil, nil, err
		}
		if err := json.Unmarshal([]byte(scopes), &k.Scopes); err != nil {
			return nil, nil, fmt.Errorf("key %s: scopes: %w", k.ID, err)
		}
		k.CreatedAt = time.UnixMilli(created).UTC()
		if used.Valid {
			t := time.UnixMilli(used.Int64).UTC()
			k.LastUsedAt = &t
		}
		if revoked.Valid {
			t := time.UnixMilli(revoked.Int64).UTC()
			k.RevokedAt = &t
		}
		keys = append(keys, k)
		digs = append(digs, dig)
	}
	return keys, digs, rows.Err()
}

// GetTenant returns tenant name's settings; a tenant nobody configured has
// no quotas and no boundary.
func (s *Store) GetTenant(ctx context.Context, name string) (api.Tenant, error) {
	t := api.Tenant{Name: name}
	var quotas string
	var boundary sql.NullString
	var updated int64
	err := s.db.QueryRowContext(ctx, `SELECT quotas, boundary, updated_at FROM tenancy_tenants WHERE name = ?`, name).Scan(&quotas, &boundary, &updated)
	if errors.Is(err, sql.ErrNoRows) {
		return t, nil
	}
	if err != nil {
		return api.Tenant{}, err
	}
	if err := json.Unmarshal([]byte(quotas), &t.Quotas); err != nil {
		return api.Tenant{}, fmt.Errorf("tenant %s quotas: %w", name, err)
	}
	if boundary.Valid {
		var p api.NetworkPolicy
		if err := json.Unmarshal([]byte(boundary.String), &p); err != nil {
			return api.Tenant{}, fmt.Errorf("tenant %s boundary: %w", name, err)
		}
		t.Boundary = &p
	}
	u := time.UnixMilli(updated).UTC()
	t.UpdatedAt = &u
	return t, nil
}

// PutTenant stores t's quotas and boundary (validated by the caller).
func (s *Store) PutTenant(ctx context.Context, t api.Tenant) (api.Tenant, error) {
	if err := ValidTenant(t.Name); err != nil {
		return api.Tenant{}, err
	}
	q := t.Quotas
	if q.Sandboxes < 0 || q.CPUs < 0 || q.MemoryMiB < 0 || q.DiskMiB < 0 {
		return api.Tenant{}, fmt.Errorf("quotas must not be negative (0 = unlimited): %w", errdefs.ErrInvalidArgument)
	}
	qj, _ := json.Marshal(q)
	var bj sql.NullString
	if t.Boundary != nil {
		b, _ := json.Marshal(t.Boundary)
		bj = sql.NullString{String: string(b), Valid: true}
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	if _, err := s.db.ExecContext(ctx, `INSERT INTO tenancy_tenants (name, quotas, boundary, updated_at) VALUES (?, ?, ?, ?)
		ON CONFLICT(name) DO UPDATE SET quotas = excluded.quotas, boundary = excluded.boundary, updated_at = excluded.updated_at`,
		t.Name, string(qj), bj, now.UnixMilli()); err != nil {
		return api.Tenant{}, err
	}
	t.UpdatedAt = &now
	t.Usage = nil
	return t, nil
}

// ListTenants lists every tenant that has settings or keys.
func (s *Store) ListTenants(ctx context.Context) ([]api.Tenant, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT name FROM tenancy_tenants UNION SELECT tenant FROM tenancy_keys ORDER BY 1`)
	if err != nil {
		return nil, err
	}
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			rows.Close()
			return nil, err
		}
		names = append(names, n)
	}
	rows.Close()
	out := make([]api.Tenant, 0, len(names))
	for _, n := range names {
		t, err := s.GetTenant(ctx, n)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

// UsageOf sums what sandboxes hold, in the units of quotas.
func UsageOf(sbs []api.Sandbox) api.Usage {
	var u api.Usage
	for _, sb := range sbs {
		u.Sandboxes++
		u.CPUs += sb.Limits.CPUs
		u.MemoryMiB += sb.Limits.MemoryMiB
		u.DiskMiB += sb.Limits.DiskMiB
	}
	return u
}

// Admit checks that adding sandboxes with limits adds to u within q, and
// says what is used and what is asked when it does not.
func Admit(q api.Quotas, u api.Usage, add ...api.Limits) error {
	var want api.Usage
	for _, l := range add {
		want.Sandboxes++
		want.CPUs += l.CPUs
		want.MemoryMiB += l.MemoryMiB
		want.DiskMiB += l.DiskMiB
	}
	var over []string
	if q.Sandboxes > 0 && u.Sandboxes+want.Sandboxes > q.Sandboxes {
		over = append(over, fmt.Sprintf("sandboxes: %d used + %d asked > quota %d", u.Sandboxes, want.Sandboxes, q.Sandboxes))
	}
	if q.CPUs > 0 && u.CPUs+want.CPUs > q.CPUs+1e-9 {
		over = append(over, fmt.Sprintf("cpus: %g used + %g asked > quota %g", u.CPUs, want.CPUs, q.CPUs))
	}
	if q.MemoryMiB > 0 && u.MemoryMiB+want.MemoryMiB > q.MemoryMiB {
		over = append(over, fmt.Sprintf("memory: %d MiB used + %d MiB asked > quota %d MiB", u.MemoryMiB, want.MemoryMiB, q.MemoryMiB))
	}
	if q.DiskMiB > 0 && u.DiskMiB+want.DiskMiB > q.DiskMiB {
		over = append(over, fmt.Sprintf("disk: %d MiB used + %d MiB asked > quota %d MiB", u.DiskMiB, want.DiskMiB, q.DiskMiB))
	}
	if len(over) > 0 {
		return fmt.Errorf("the tenant's quota is used up: %s: %w", strings.Join(over, "; "), errdefs.ErrQuotaExceeded)
	}
	return nil
}

// TagOwner returns the tenant that owns template tag, "" if none does (a
// shared tag: made by an admin, or before tenants existed).
func (s *Store) TagOwner(ctx context.Context, tag string) (string, error) {
	var t string
	err := s.db.QueryRowContext(ctx, `SELECT tenant FROM tenancy_template_tags WHERE tag = ?`, tag).Scan(&t)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	return t, err
}

// SetTagOwner records that tenant owns tag ("" makes it shared).
func (s *Store) SetTagOwner(ctx context.Context, tag, tenant string) error {
	if tenant == "" {
		_, err := s.db.ExecContext(ctx, `DELETE FROM tenancy_template_tags WHERE tag = ?`, tag)
		return err
	}
	_, err := s.db.ExecContext(ctx, `INSERT INTO tenancy_template_tags (tag, tenant) VALUES (?, ?)
		ON CONFLICT(tag) DO UPDATE SET tenant = excluded.tenant`, tag, tenant)
	return err
}
