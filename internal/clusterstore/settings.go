package clusterstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// SettingsStore keeps the cluster's settings every node mirrors: tenants
// (quotas and network boundary), policy rule sets by scope and warm pools.
// Every change NOTIFYs the settings channel, which ListenSettings follows.
type SettingsStore struct {
	pool *pgxpool.Pool
}

// settingsChannel is NOTIFYed after every change of tenants, policy
// rules, secrets or pools, so nodes mirror it without waiting for their next poll.
const settingsChannel = "space_settings"

// Settings are what every node mirrors: tenants, policy rule sets and
// warm pools.
type Settings struct {
	Tenants []api.Tenant
	Rules   []api.PolicyRuleSet
	// Pools are the warm pools' specs (normalised by the node a replica
	// asked), by id.
	Pools map[string]api.PoolSpec
}

// PutPool stores the warm pool id with its (normalised) spec.
func (st *SettingsStore) PutPool(ctx context.Context, id string, spec api.PoolSpec) error {
	b, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return changeSettings(ctx, st.pool, `INSERT INTO pools (id, spec) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET spec = excluded.spec, updated_at = now()`, id, b)
}

// DeletePool removes warm pool id (ErrNotFound if the cluster has none).
func (st *SettingsStore) DeletePool(ctx context.Context, id string) error {
	err := changeSettings(ctx, st.pool, `DELETE FROM pools WHERE id = $1`, id)
	if errors.Is(err, errNoRow) {
		return fmt.Errorf("the cluster has no warm pool %s: %w", id, errdefs.ErrNotFound)
	}
	return err
}

// PutTenant stores a tenant's quotas and boundary (validated by the caller).
func (st *SettingsStore) PutTenant(ctx context.Context, t api.Tenant) error {
	t.Usage, t.UpdatedAt = nil, nil
	spec, err := json.Marshal(t)
	if err != nil {
		return err
	}
	return changeSettings(ctx, st.pool, `INSERT INTO tenants (name, spec) VALUES ($1, $2)
		ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, updated_at = now()`, t.Name, spec)
}

// PutRules stores the rule set of a scope (compiled by the caller).
func (st *SettingsStore) PutRules(ctx context.Context, rs api.PolicyRuleSet) error {
	spec, err := json.Marshal(rs)
	if err != nil {
		return err
	}
	return changeSettings(ctx, st.pool, `INSERT INTO policy_rules (scope, spec) VALUES ($1, $2)
		ON CONFLICT (scope) DO UPDATE SET spec = excluded.spec, updated_at = now()`, rs.Scope, spec)
}

// DeleteRules removes the rule set of a scope (ErrNotFound if none).
func (st *SettingsStore) DeleteRules(ctx context.Context, scope string) error {
	err := changeSettings(ctx, st.pool, `DELETE FROM policy_rules WHERE scope = $1`, scope)
	if errors.Is(err, errNoRow) {
		return fmt.Errorf("no rule set is attached to %s: %w", scope, errdefs.ErrNotFound)
	}
	return err
}

var errNoRow = errors.New("no row")

// changeSettings runs sql in a transaction with a NOTIFY of the settings
// channel; errNoRow when it changed no row.
func changeSettings(ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sql, args...)
		if err != nil {
			return fmt.Errorf("cluster settings: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return errNoRow
		}
		_, err = tx.Exec(ctx, `SELECT pg_notify($1, '')`, settingsChannel)
		return err
	})
}

// Settings reads every tenant and rule set.
func (st *SettingsStore) Settings(ctx context.Context) (Settings, error) {
	var out Settings
	rows, err := st.pool.Query(ctx, `SELECT spec, updated_at FROM tenants ORDER BY name`)
	if err != nil {
		return out, fmt.Errorf("read tenants: %w", err)
	}
	out.Tenants, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (api.Tenant, error) {
		var t api.Tenant
		var spec []byte
		if err := r.Scan(&spec, &t.UpdatedAt); err != nil {
			return t, err
		}
		err := json.Unmarshal(spec, &t)
		return t, err
	})
	if err != nil {
		return out, fmt.Errorf("read tenants: %w", err)
	}
	rows, err = st.pool.Query(ctx, `SELECT spec FROM policy_rules ORDER BY scope`)
	if err != nil {
		return out, fmt.Errorf("read policy rules: %w", err)
	}
	out.Rules, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (api.PolicyRuleSet, error) {
		var rs api.PolicyRuleSet
		var spec []byte
		if err := r.Scan(&spec); err != nil {
			return rs, err
		}
		err := json.Unmarshal(spec, &rs)
		return rs, err
	})
	if err != nil {
		return out, fmt.Errorf("read policy rules: %w", err)
	}
	rows, err = st.pool.Query(ctx, `SELECT id, spec FROM pools`)
	if err != nil {
		return out, fmt.Errorf("read pools: %w", err)
	}
	out.Pools = map[string]api.PoolSpec{}
	var id string
	var spec []byte
	_, err = pgx.ForEachRow(rows, []any{&id, &spec}, func() error {
		var ps api.PoolSpec
		if err := json.Unmarshal(spec, &ps); err != nil {
			return fmt.Errorf("pool %s: %w", id, err)
		}
		out.Pools[id] = ps
		return nil
	})
	if err != nil {
		return out, fmt.Errorf("read pools: %w", err)
	}
	return out, nil
}

// Tenant returns one tenant's settings (a tenant nobody configured has
// none: no quotas, no boundary).
func (st *SettingsStore) Tenant(ctx context.Context, name string) (api.Tenant, error) {
	t := api.Tenant{Name: name}
	var spec []byte
	err := st.pool.QueryRow(ctx, `SELECT spec FROM tenants WHERE name = $1`, name).Scan(&spec)
	if errors.Is(err, pgx.ErrNoRows) {
		return t, nil
	}
	if err != nil {
		return t, fmt.Errorf("read tenant %s: %w", name, err)
	}
	err = json.Unmarshal(spec, &t)
	return t, err
}

// ListenSettings calls wake after every change of the settings (and once
// per (re)connect), until ctx ends.
func (st *SettingsStore) ListenSettings(ctx context.Context, wake func()) error {
	return listen(ctx, st.pool, settingsChannel, func(string) bool { return true }, wake)
}
