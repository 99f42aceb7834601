// Package store is space's embedded state store: sandboxes, operations and
// command sessions in one SQLite database (pure Go driver, WAL journal).
//
// Every Put is a single transaction, so a crash at any moment leaves either
// the old or the new record and never a half-written one. Persisting intent
// before acting on it is the caller's job; the store only promises that what
// it acknowledged survives kill -9 and reopening.
//
// Records are stored as the JSON of their api types plus a few indexed
// columns used for filtering and ordering. The JSON is authoritative; the
// columns are derived from it on every write.
package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" driver

	"github.com/spacehq/space/internal/errdefs"
)

// busyTimeout is how long a connection waits for another writer (another
// goroutine's connection, or another process such as the CLI) before giving
// up with SQLITE_BUSY.
const busyTimeout = 30 * time.Second

// DB is the space state store. It is safe for concurrent use.
type DB struct {
	db *sql.DB
	// writeMu serialises this process's write transactions. SQLite allows
	// one writer at a time anyway; queueing here instead of in SQLite's
	// sleep-and-retry busy handler keeps latency fair and low. Other
	// processes are still handled by busy_timeout.
	writeMu sync.Mutex
	// sandboxes caches the sandbox records (cache.go).
	sandboxes *recordCache
}

// Open opens (creating if needed) the database at path and migrates its
// schema to the current version. The file is created mode 0600: it holds
// token hashes and sandbox environment variables.
func Open(path string) (*DB, error) {
	if path == "" {
		return nil, fmt.Errorf("store path is empty: %w", errdefs.ErrInvalidArgument)
	}
	// The driver takes everything after the first '?' as options.
	if strings.ContainsAny(path, "?#") {
		return nil, fmt.Errorf("store path %q must not contain '?' or '#': %w", path, errdefs.ErrInvalidArgument)
	}
	if path != ":memory:" {
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return nil, fmt.Errorf("create store dir: %w", err)
		}
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			return nil, fmt.Errorf("open store %s: %w", path, err)
		}
		f.Close()
	}
	// Every pooled connection gets the same settings: wait for locks,
	// enforce foreign keys, WAL, and BEGIN IMMEDIATE so a read-then-write
	// transaction takes the write lock up front instead of failing with
	// SQLITE_BUSY on upgrade. synchronous=NORMAL: in WAL mode a committed
	// transaction survives a crash of this process (kill -9, the case the
	// design requires) because it is in the OS page cache; only a power loss
	// can drop the newest commits, and then every sandbox process died too
	// and reconcile/sweep clean the host either way. FULL cost ~1.7 ms of
	// fsync per commit here, several per create.
	dsn := fmt.Sprintf("%s?_busy_timeout=%d&_foreign_keys=1&_journal_mode=WAL&_synchronous=NORMAL&_txlock=immediate",
		path, busyTimeout.Milliseconds())
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", path, err)
	}
	if path == ":memory:" {
		// Each connection to :memory: is its own empty database.
		db.SetMaxOpenConns(1)
	}
	// Opening a SQLite connection costs milliseconds (file open, pragmas,
	// WAL index); with database/sql's default of 2 idle connections, a few
	// concurrent readers (long-polls, the idle loop) churn connections on
	// every request. Keep a pool and never expire it.
	db.SetMaxIdleConns(16)
	db.SetConnMaxIdleTime(0)
	d := &DB{db: db, sandboxes: newRecordCache()}
	if err := d.migrate(context.Background()); err != nil {
		db.Close()
		return nil, fmt.Errorf("migrate store %s: %w", path, err)
	}
	return d, nil
}

// Close closes the database.
func (d *DB) Close() error { return d.db.Close() }

// SQL returns the underlying handle, for packages that keep their own
// tables in the same file (they must prefix their table names and manage
// their own schema versions; user_version belongs to this package).
func (d *DB) SQL() *sql.DB { return d.db }

// write runs fn in one IMMEDIATE transaction.
func (d *DB) write(ctx context.Context, fn func(*sql.Tx) error) error {
	return d.writeThen(ctx, fn, nil)
}

// writeThen is write that then calls after (if not nil) with the outcome,
// still holding writeMu, so a cache sees writes in commit order.
func (d *DB) writeThen(ctx context.Context, fn func(*sql.Tx) error, after func(error)) error {
	d.writeMu.Lock()
	defer d.writeMu.Unlock()
	err := d.writeLocked(ctx, fn)
	if after != nil {
		after(err)
	}
	return err
}

func (d *DB) writeLocked(ctx context.Context, fn func(*sql.Tx) error) error {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// migrations[i] brings the schema from version i to i+1. Append only: a
// released migration is never edited.
var migrations = []string{
	// 1: sandboxes, their labels, operations, command sessions.
	`
CREATE TABLE sandboxes (
	id         TEXT PRIMARY KEY,
	state      TEXT NOT NULL,
	runtime    TEXT NOT NULL,
	created_at INTEGER NOT NULL, -- unix nanoseconds
	labels     TEXT NOT NULL,    -- JSON object, as in data
	data       TEXT NOT NULL     -- api.Sandbox JSON
) STRICT;
CREATE INDEX sandboxes_by_created ON sandboxes (created_at, id);
CREATE INDEX sandboxes_by_state ON sandboxes (state, created_at);

CREATE TABLE sandbox_labels (
	sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
	key        TEXT NOT NULL,
	value      TEXT NOT NULL,
	PRIMARY KEY (sandbox_id, key)
) STRICT, WITHOUT ROWID;
CREATE INDEX sandbox_labels_by_kv ON sandbox_labels (key, value);

-- Operations outlive their sandbox: a finished delete operation must stay
-- pollable after the sandbox row is gone, so there is no foreign key.
CREATE TABLE operations (
	id         TEXT PRIMARY KEY,
	sandbox_id TEXT NOT NULL,
	kind       TEXT NOT NULL,
	state      TEXT NOT NULL,
	finished   INTEGER NOT NULL, -- 0 or 1
	created_at INTEGER NOT NULL,
	data       TEXT NOT NULL     -- api.Operation JSON
) STRICT;
CREATE INDEX operations_by_sandbox ON operations (sandbox_id, created_at);
CREATE INDEX operations_unfinished ON operations (finished, created_at);

CREATE TABLE commands (
	sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
	id         TEXT NOT NULL,
	state      TEXT NOT NULL,
	created_at INTEGER NOT NULL,
	data       TEXT NOT NULL,    -- CommandRecord JSON
	PRIMARY KEY (sandbox_id, id)
) STRICT;
CREATE INDEX commands_by_created ON commands (sandbox_id, created_at);
`,
	// 2: what each ended network link of a sandbox counted.
	`
CREATE TABLE network_summaries (
	sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
	ended_at   INTEGER NOT NULL, -- unix nanoseconds
	data       TEXT NOT NULL     -- api.NetworkSummary JSON
) STRICT;
CREATE INDEX network_summaries_by_sandbox ON network_summaries (sandbox_id, ended_at);
`,
}

// SchemaVersion is the schema version this build writes.
var SchemaVersion = len(migrations)

func (d *DB) migrate(ctx context.Context) error {
	for {
		done, err := d.migrateOne(ctx)
		if err != nil || done {
			return err
		}
	}
}

// migrateOne applies the next pending migration in its own transaction,
// re-reading user_version under the write lock so two processes opening a
// fresh database at once do not both apply it.
func (d *DB) migrateOne(ctx context.Context) (done bool, err error) {
	err = d.write(ctx, func(tx *sql.Tx) error {
		var v int
		if err := tx.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
			return err
		}
		switch {
		case v > len(migrations):
			return fmt.Errorf("database schema version %d is newer than this build's %d: %w",
				v, len(migrations), errdefs.ErrUnprocessable)
		case v == len(migrations):
			done = true
			return nil
		}
		if _, err := tx.ExecContext(ctx, migrations[v]); err != nil {
			return fmt.Errorf("migration %d: %w", v+1, err)
		}
		// PRAGMA takes no bind parameters; v is an int we control.
		if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", v+1)); err != nil {
			return err
		}
		return nil
	})
	return done, err
}

// unixNano maps the zero time to 0 (time.Time{}.UnixNano overflows).
func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func notFound(kind, id string) error {
	return fmt.Errorf("%s %q: %w", kind, id, errdefs.ErrNotFound)
}

func requireID(kind, id string) error {
	if id == "" {
		return fmt.Errorf("%s id is empty: %w", kind, errdefs.ErrInvalidArgument)
	}
	return nil
}

// isNoRows reports whether err is sql.ErrNoRows.
func isNoRows(err error) bool { return errors.Is(err, sql.ErrNoRows) }
