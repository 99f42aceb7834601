// Package clusterstore holds cluster mode's shared desired state in
// PostgreSQL: the nodes that run sandboxes, their heartbeats and free
// capacity, and (as cluster mode grows) what every API replica must agree
// on. A single box never opens one (internal/server uses it only as a
// cluster node); SQLite stays its store.
//
// Open returns a Store: the one connection pool and the schema, and the
// parts that keep what is stored, which share that pool — NodeStore
// (nodes, heartbeats, placement), SandboxStore (sandbox rows: desired and
// observed state, moves, the nodes' wake-ups), KeyStore (API keys),
// SettingsStore (what every node mirrors: tenants, policy rule sets, warm
// pools), SecretStore (sealed secrets, mirrored too) and AuditHeadStore
// (each node's audit chain head).
//
// Time comparisons use the database's clock (now()), never a replica's, so
// replicas with skewed clocks agree on which node is late.
package clusterstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/internal/errdefs"
)

// ErrSchemaTooNew is returned by Open when the database was migrated by a
// newer space than this one: running an old replica against a newer schema
// could write rows the new one misreads.
var ErrSchemaTooNew = errors.New("cluster database schema is newer than this binary")

// Store is a connection pool to the cluster database, with the schema
// migrated, and the parts of the cluster's state that share it. The Store
// itself only opens, migrates and closes; what is stored a caller reaches
// through the part that keeps it (st.Nodes(), st.Sandboxes(), ...), and a
// caller that needs one part takes just that part. Close closes the pool
// for all.
type Store struct {
	pool *pgxpool.Pool

	nodes     *NodeStore
	sandboxes *SandboxStore
	keys      *KeyStore
	settings  *SettingsStore
	secrets   *SecretStore
	audit     *AuditHeadStore
}

func newStore(pool *pgxpool.Pool) *Store {
	return &Store{
		pool:      pool,
		nodes:     &NodeStore{pool: pool},
		sandboxes: &SandboxStore{pool: pool},
		keys:      &KeyStore{pool: pool},
		settings:  &SettingsStore{pool: pool},
		secrets:   &SecretStore{pool: pool},
		audit:     &AuditHeadStore{pool: pool},
	}
}

// Nodes is the store's NodeStore part: nodes, heartbeats, placement.
func (s *Store) Nodes() *NodeStore { return s.nodes }

// Sandboxes is the store's SandboxStore part: sandbox rows, moves, the
// nodes' wake-ups.
func (s *Store) Sandboxes() *SandboxStore { return s.sandboxes }

// Keys is the store's KeyStore part: API keys.
func (s *Store) Keys() *KeyStore { return s.keys }

// Settings is the store's SettingsStore part: tenants, policy rule sets,
// warm pools.
func (s *Store) Settings() *SettingsStore { return s.settings }

// Secrets is the store's SecretStore part: sealed secrets.
func (s *Store) Secrets() *SecretStore { return s.secrets }

// AuditHeads is the store's AuditHeadStore part: each node's audit chain
// head.
func (s *Store) AuditHeads() *AuditHeadStore { return s.audit }

// Open connects to the PostgreSQL database at dsn (a URL or key=value
// string) and migrates its schema to this binary's version.
func Open(ctx context.Context, dsn string) (*Store, error) {
	if dsn == "" {
		return nil, fmt.Errorf("cluster store DSN is empty: %w", errdefs.ErrInvalidArgument)
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("cluster store DSN: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect cluster store: %w", err)
	}
	s := newStore(pool)
	if err := s.migrate(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	return s, nil
}

// Close closes the pool (every part's).
func (s *Store) Close() { s.pool.Close() }

// SchemaVersion is the schema version the database is at.
func (s *Store) SchemaVersion(ctx context.Context) (int, error) {
	var v int
	err := s.pool.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM space_schema`).Scan(&v)
	return v, err
}

// migrationLock is the advisory lock key every replica takes while
// migrating, so replicas starting together apply each migration once.
const migrationLock = 0x73706163655f6d31 // "space_m1"

// migrate applies the migrations the database lacks, in one transaction
// under the advisory lock (PostgreSQL DDL is transactional: a failed
// migration leaves the previous version intact).
func (s *Store) migrate(ctx context.Context) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(migrationLock)); err != nil {
			return fmt.Errorf("migration lock: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS space_schema (
			version integer PRIMARY KEY,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return fmt.Errorf("create space_schema: %w", err)
		}
		var have int
		if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM space_schema`).Scan(&have); err != nil {
			return fmt.Errorf("read schema version: %w", err)
		}
		if have > len(migrations) {
			return fmt.Errorf("%w: database at version %d, this binary knows %d", ErrSchemaTooNew, have, len(migrations))
		}
		for v := have + 1; v <= len(migrations); v++ {
			if _, err := tx.Exec(ctx, migrations[v-1]); err != nil {
				return fmt.Errorf("migration %d: %w", v, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO space_schema (version) VALUES ($1)`, v); err != nil {
				return fmt.Errorf("record migration %d: %w", v, err)
			}
		}
		return nil
	})
}

// migrations are the schema's versions in order; migrations[i] takes the
// database from version i to i+1. Never edit a released entry: append.
var migrations = []string{
	// 1: nodes, their heartbeats and what placement reads.
	`CREATE TABLE nodes (
		id            text PRIMARY KEY CHECK (id <> ''),
		address       text NOT NULL,
		mem_free      bigint NOT NULL DEFAULT 0 CHECK (mem_free >= 0),
		cpus          integer NOT NULL DEFAULT 0 CHECK (cpus >= 0),
		sandboxes     integer NOT NULL DEFAULT 0 CHECK (sandboxes >= 0),
		templates     text[] NOT NULL DEFAULT '{}',
		state         text NOT NULL DEFAULT 'ready' CHECK (state IN ('ready', 'draining', 'lost')),
		state_reason  text NOT NULL DEFAULT '',
		registered_at timestamptz NOT NULL DEFAULT now(),
		heartbeat_at  timestamptz NOT NULL DEFAULT now()
	)`,
	// 2: sandboxes' desired state (written by replicas) and observed
	// state (reported by the node that runs each).
	`CREATE TABLE sandboxes (
		id           text PRIMARY KEY CHECK (id <> ''),
		node         text NOT NULL REFERENCES nodes (id),
		tenant       text NOT NULL DEFAULT '',
		request      jsonb NOT NULL,
		desired      text NOT NULL CHECK (desired IN ('running', 'paused', 'suspended', 'deleted')),
		generation   bigint NOT NULL DEFAULT 1 CHECK (generation > 0),
		observed     bigint NOT NULL DEFAULT 0,
		status       jsonb,
		state        text NOT NULL DEFAULT 'creating',
		state_reason text NOT NULL DEFAULT '',
		created_at   timestamptz NOT NULL DEFAULT now(),
		updated_at   timestamptz NOT NULL DEFAULT now()
	);
	CREATE INDEX sandboxes_by_node ON sandboxes (node, id);
	CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant, created_at)`,
	// 3: what replicas share to answer callers: API keys (digests only),
	// and a create's idempotency key, unique per tenant, so a create
	// retried through another replica finds the sandbox the first made.
	`CREATE TABLE api_keys (
		id         text PRIMARY KEY CHECK (id <> ''),
		digest     text NOT NULL UNIQUE,
		name       text NOT NULL,
		tenant     text NOT NULL,
		scopes     text[] NOT NULL,
		prefix     text NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now(),
		revoked_at timestamptz
	);
	ALTER TABLE sandboxes ADD COLUMN idempotency_key text CHECK (idempotency_key <> '');
	ALTER TABLE sandboxes ADD COLUMN create_operation text NOT NULL DEFAULT '';
	CREATE UNIQUE INDEX sandboxes_idempotency ON sandboxes (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL`,
	// 4: the cluster's settings every node mirrors: tenants (quotas and
	// network boundary) and policy rule sets by scope.
	`CREATE TABLE tenants (
		name       text PRIMARY KEY CHECK (name <> ''),
		spec       jsonb NOT NULL,
		updated_at timestamptz NOT NULL DEFAULT now()
	);
	CREATE TABLE policy_rules (
		scope      text PRIMARY KEY CHECK (scope <> ''),
		spec       jsonb NOT NULL,
		updated_at timestamptz NOT NULL DEFAULT now()
	)`,
	// 5: each node's audit chain head: its newest signed checkpoint, the
	// witness outside the node that its log was not rolled back or
	// rewritten; problem is what the node found when its log stopped
	// continuing the head (publishing stops until an admin forgets it).
	`CREATE TABLE audit_heads (
		node        text PRIMARY KEY CHECK (node <> ''),
		seq         bigint NOT NULL CHECK (seq > 0),
		hash        text NOT NULL,
		key_id      text NOT NULL,
		public_key  text NOT NULL,
		checkpoint  text NOT NULL,
		signed_at   timestamptz NOT NULL,
		anchored_at timestamptz NOT NULL DEFAULT now(),
		problem     text NOT NULL DEFAULT '',
		problem_at  timestamptz
	)`,
	// 6: secrets set through replicas, sealed with the cluster's secrets
	// key (never in the clear here), which every node mirrors into its own
	// store; NOTIFY space_settings like tenants and policies.
	`CREATE TABLE secrets (
		tenant     text NOT NULL CHECK (tenant <> ''),
		name       text NOT NULL CHECK (name <> ''),
		hosts      text[] NOT NULL,
		header     text NOT NULL,
		version    integer NOT NULL CHECK (version > 0),
		sealed     bytea NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now(),
		updated_at timestamptz NOT NULL DEFAULT now(),
		PRIMARY KEY (tenant, name)
	)`,
	// 7: warm pools set through replicas (every node mirrors them, NOTIFY
	// space_settings), and each node's warm members by template name, one
	// entry per ready member, so placement prefers a node holding one.
	`CREATE TABLE pools (
		id         text PRIMARY KEY CHECK (id <> ''),
		spec       jsonb NOT NULL,
		updated_at timestamptz NOT NULL DEFAULT now()
	);
	ALTER TABLE nodes ADD COLUMN warm text[] NOT NULL DEFAULT '{}'`,
}
