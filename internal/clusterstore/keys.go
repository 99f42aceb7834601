package clusterstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// KeyStore keeps the cluster's API keys by the digest of their secret
// (never the secret), which every replica checks a caller's key against.
type KeyStore struct {
	pool *pgxpool.Pool
}

// firstKeyLock serialises replicas that start on an empty key table, so
// exactly one of them stores the first admin key.
const firstKeyLock = 0x73706163655f6b31 // "space_k1"

// AddKey stores an API key by its digest (the secret is never stored).
func (ks *KeyStore) AddKey(ctx context.Context, k api.APIKey, digest string) error {
	_, err := ks.pool.Exec(ctx, `INSERT INTO api_keys (id, digest, name, tenant, scopes, prefix, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		k.ID, digest, k.Name, k.Tenant, k.Scopes, k.Prefix, k.CreatedAt)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" {
		return fmt.Errorf("that key is already stored: %w", errdefs.ErrConflict)
	}
	return err
}

// AddFirstKey stores k only if the cluster has no key at all, under a lock
// every replica takes for it; it reports whether k was stored.
func (ks *KeyStore) AddFirstKey(ctx context.Context, k api.APIKey, digest string) (bool, error) {
	stored := false
	err := pgx.BeginFunc(ctx, ks.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(firstKeyLock)); err != nil {
			return err
		}
		var n int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM api_keys`).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
		_, err := tx.Exec(ctx, `INSERT INTO api_keys (id, digest, name, tenant, scopes, prefix, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
			k.ID, digest, k.Name, k.Tenant, k.Scopes, k.Prefix, k.CreatedAt)
		stored = err == nil
		return err
	})
	return stored, err
}

const keyColumns = `id, name, tenant, scopes, prefix, created_at, revoked_at`

func scanKey(r pgx.CollectableRow) (api.APIKey, error) {
	var k api.APIKey
	err := r.Scan(&k.ID, &k.Name, &k.Tenant, &k.Scopes, &k.Prefix, &k.CreatedAt, &k.RevokedAt)
	k.CreatedAt = k.CreatedAt.UTC()
	return k, err
}

// LiveKey returns the unrevoked key with this digest.
func (ks *KeyStore) LiveKey(ctx context.Context, digest string) (api.APIKey, error) {
	rows, err := ks.pool.Query(ctx, `SELECT `+keyColumns+` FROM api_keys WHERE digest = $1 AND revoked_at IS NULL`, digest)
	if err != nil {
		return api.APIKey{}, fmt.Errorf("look up key: %w", err)
	}
	k, err := pgx.CollectExactlyOneRow(rows, scanKey)
	if errors.Is(err, pgx.ErrNoRows) {
		return api.APIKey{}, fmt.Errorf("missing, wrong or revoked API key: %w", errdefs.ErrUnauthorized)
	}
	return k, err
}

// Keys lists keys, of one tenant or ("") all, oldest first.
func (ks *KeyStore) Keys(ctx context.Context, tenant string) ([]api.APIKey, error) {
	rows, err := ks.pool.Query(ctx, `SELECT `+keyColumns+` FROM api_keys WHERE $1 = '' OR tenant = $1 ORDER BY created_at, id`, tenant)
	if err != nil {
		return nil, fmt.Errorf("list keys: %w", err)
	}
	return pgx.CollectRows(rows, scanKey)
}

// RevokeKey revokes a key (a revoked key stays revoked, with its first
// revocation time) and returns it.
func (ks *KeyStore) RevokeKey(ctx context.Context, id string) (api.APIKey, error) {
	rows, err := ks.pool.Query(ctx, `UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 RETURNING `+keyColumns, id)
	if err != nil {
		return api.APIKey{}, fmt.Errorf("revoke key: %w", err)
	}
	k, err := pgx.CollectExactlyOneRow(rows, scanKey)
	if errors.Is(err, pgx.ErrNoRows) {
		return api.APIKey{}, fmt.Errorf("key %q not found: %w", id, errdefs.ErrNotFound)
	}
	return k, err
}
