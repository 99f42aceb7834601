package clusterstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/internal/errdefs"
)

// SecretStore keeps the tenants' secrets set through replicas, sealed
// with the cluster's secrets key (never in the clear here). Every change
// NOTIFYs the settings channel, so nodes mirror secrets as they do the
// SettingsStore's rows (ListenSettings wakes for both).
type SecretStore struct {
	pool *pgxpool.Pool
}

// Secret is a secret as the cluster keeps it: its value sealed with the
// cluster's secrets key (secrets.Sealer) for its tenant, name and version.
type Secret struct {
	Tenant    string
	Name      string
	Hosts     []string
	Header    string
	Version   int
	Sealed    []byte
	CreatedAt time.Time
	UpdatedAt time.Time
}

// PutSecret creates or rotates tenant's secret name: the version goes up
// by one and seal seals the value for that version. created says which.
func (sc *SecretStore) PutSecret(ctx context.Context, tenant, name string, hosts []string, header string, seal func(version int) ([]byte, error)) (sec Secret, created bool, err error) {
	if hosts == nil {
		hosts = []string{}
	}
	err = pgx.BeginFunc(ctx, sc.pool, func(tx pgx.Tx) error {
		var version int
		err := tx.QueryRow(ctx, `SELECT version FROM secrets WHERE tenant = $1 AND name = $2 FOR UPDATE`, tenant, name).Scan(&version)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			created = true
		case err != nil:
			return err
		}
		sealed, err := seal(version + 1)
		if err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `INSERT INTO secrets (tenant, name, hosts, header, version, sealed) VALUES ($1, $2, $3, $4, $5, $6)
			ON CONFLICT (tenant, name) DO UPDATE SET hosts = excluded.hosts, header = excluded.header, version = excluded.version,
				sealed = excluded.sealed, updated_at = now()
			RETURNING `+secretColumns, tenant, name, hosts, header, version+1, sealed)
		if err != nil {
			return err
		}
		if sec, err = pgx.CollectExactlyOneRow(rows, scanSecret); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `SELECT pg_notify($1, '')`, settingsChannel)
		return err
	})
	if err != nil {
		return Secret{}, false, fmt.Errorf("secret %s of %s: %w", name, tenant, err)
	}
	return sec, created, nil
}

// DeleteSecret removes tenant's secret name (ErrNotFound if none).
func (sc *SecretStore) DeleteSecret(ctx context.Context, tenant, name string) error {
	err := changeSettings(ctx, sc.pool, `DELETE FROM secrets WHERE tenant = $1 AND name = $2`, tenant, name)
	if errors.Is(err, errNoRow) {
		return fmt.Errorf("secret %q: %w", name, errdefs.ErrNotFound)
	}
	return err
}

const secretColumns = `tenant, name, hosts, header, version, sealed, created_at, updated_at`

func scanSecret(r pgx.CollectableRow) (Secret, error) {
	var sec Secret
	err := r.Scan(&sec.Tenant, &sec.Name, &sec.Hosts, &sec.Header, &sec.Version, &sec.Sealed, &sec.CreatedAt, &sec.UpdatedAt)
	return sec, err
}

// Secrets lists the secrets of tenant ("": every tenant's), by tenant and
// name.
func (sc *SecretStore) Secrets(ctx context.Context, tenant string) ([]Secret, error) {
	rows, err := sc.pool.Query(ctx, `SELECT `+secretColumns+` FROM secrets WHERE $1 = '' OR tenant = $1 ORDER BY tenant, name`, tenant)
	if err != nil {
		return nil, fmt.Errorf("list secrets: %w", err)
	}
	return pgx.CollectRows(rows, scanSecret)
}

// GetSecret is tenant's secret name (ErrNotFound if none).
func (sc *SecretStore) GetSecret(ctx context.Context, tenant, name string) (Secret, error) {
	rows, err := sc.pool.Query(ctx, `SELECT `+secretColumns+` FROM secrets WHERE tenant = $1 AND name = $2`, tenant, name)
	if err != nil {
		return Secret{}, fmt.Errorf("secret %s: %w", name, err)
	}
	sec, err := pgx.CollectExactlyOneRow(rows, scanSecret)
	if errors.Is(err, pgx.ErrNoRows) {
		return Secret{}, fmt.Errorf("secret %q: %w", name, errdefs.ErrNotFound)
	}
	return sec, err
}
