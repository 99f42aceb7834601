package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spacehq/space/api"
)

// SandboxFilter selects sandboxes. Zero fields match everything; every
// label must match exactly.
type SandboxFilter struct {
	State  string
	Labels map[string]string
}

// OperationFilter selects operations. Zero fields match everything.
type OperationFilter struct {
	SandboxID  string
	Unfinished bool // only operations that are neither succeeded nor failed
}

// CommandRecord is a command session as the server keeps it: the public
// view plus what it needs to start the process and check attach tokens.
// The plaintext attach token (Command.AttachToken) is never persisted.
type CommandRecord struct {
	api.Command
	Spec        api.ExecRequest `json:"spec"`
	TokenHash   string          `json:"token_hash,omitempty"`
	TokenExpiry time.Time       `json:"token_expiry"`
	Detached    bool            `json:"detached,omitempty"`
}

// PutSandbox inserts or replaces s, keyed by s.ID. The whole record —
// its network policy included — is the data column's JSON; the other
// columns only index it.
func (d *DB) PutSandbox(ctx context.Context, s api.Sandbox) error {
	if err := requireID("sandbox", s.ID); err != nil {
		return err
	}
	data, err := json.Marshal(s)
	if err != nil {
		return fmt.Errorf("encode sandbox %q: %w", s.ID, err)
	}
	labels := s.Labels
	if labels == nil {
		labels = map[string]string{}
	}
	labelJSON, err := json.Marshal(labels)
	if err != nil {
		return fmt.Errorf("encode sandbox %q labels: %w", s.ID, err)
	}
	return d.writeThen(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `
INSERT INTO sandboxes (id, state, runtime, created_at, labels, data) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET state = excluded.state, runtime = excluded.runtime,
	created_at = excluded.created_at, labels = excluded.labels, data = excluded.data`,
			s.ID, s.State, s.Runtime, unixNano(s.CreatedAt), string(labelJSON), string(data))
		if err != nil {
			return fmt.Errorf("put sandbox %q: %w", s.ID, err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM sandbox_labels WHERE sandbox_id = ?`, s.ID); err != nil {
			return fmt.Errorf("put sandbox %q labels: %w", s.ID, err)
		}
		for k, v := range labels {
			if _, err := tx.ExecContext(ctx, `INSERT INTO sandbox_labels (sandbox_id, key, value) VALUES (?, ?, ?)`, s.ID, k, v); err != nil {
				return fmt.Errorf("put sandbox %q label %q: %w", s.ID, k, err)
			}
		}
		return nil
	}, func(err error) {
		var rec *api.Sandbox
		if err == nil { // else rolled back, or a commit whose outcome is unknown
			// What a read from SQLite would return: the decoded JSON.
			rec = new(api.Sandbox)
			if json.Unmarshal(data, rec) != nil {
				rec = nil
			}
		}
		d.sandboxes.put(s.ID, rec)
	})
}

// GetSandbox returns the sandbox with the given id, or an error wrapping
// errdefs.ErrNotFound.
func (d *DB) GetSandbox(ctx context.Context, id string) (api.Sandbox, error) {
	s, gen, ok := d.sandboxes.get(id)
	if ok {
		return s, nil
	}
	var data []byte
	err := d.db.QueryRowContext(ctx, `SELECT data FROM sandboxes WHERE id = ?`, id).Scan(&data)
	if isNoRows(err) {
		return api.Sandbox{}, notFound("sandbox", id)
	}
	if err != nil {
		return api.Sandbox{}, fmt.Errorf("get sandbox %q: %w", id, err)
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return api.Sandbox{}, fmt.Errorf("decode sandbox %q: %w", id, err)
	}
	d.sandboxes.fill(id, s, gen)
	return s, nil
}

// ListSandboxes returns the sandboxes matching f, oldest first.
func (d *DB) ListSandboxes(ctx context.Context, f SandboxFilter) ([]api.Sandbox, error) {
	var (
		where []string
		args  []any
	)
	if f.State != "" {
		where = append(where, "s.state = ?")
		args = append(args, f.State)
	}
	// Sorted so the generated SQL is deterministic (and cacheable).
	keys := make([]string, 0, len(f.Labels))
	for k := range f.Labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		where = append(where, "EXISTS (SELECT 1 FROM sandbox_labels l WHERE l.sandbox_id = s.id AND l.key = ? AND l.value = ?)")
		args = append(args, k, f.Labels[k])
	}
	q := `SELECT s.data FROM sandboxes s`
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	q += " ORDER BY s.created_at, s.id"
	return queryJSON[api.Sandbox](ctx, d.db, "list sandboxes", q, args...)
}

// DeleteSandbox removes the sandbox and its command sessions. Its
// operations stay (see the schema). A missing sandbox is ErrNotFound.
func (d *DB) DeleteSandbox(ctx context.Context, id string) error {
	return d.writeThen(ctx, func(tx *sql.Tx) error {
		// Commands and labels go by ON DELETE CASCADE.
		res, err := tx.ExecContext(ctx, `DELETE FROM sandboxes WHERE id = ?`, id)
		if err != nil {
			return fmt.Errorf("delete sandbox %q: %w", id, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return notFound("sandbox", id)
		}
		return nil
	}, func(error) { d.sandboxes.put(id, nil) })
}

// PutOperation inserts or replaces o, keyed by o.ID.
func (d *DB) PutOperation(ctx context.Context, o api.Operation) error {
	if err := requireID("operation", o.ID); err != nil {
		return err
	}
	data, err := json.Marshal(o)
	if err != nil {
		return fmt.Errorf("encode operation %q: %w", o.ID, err)
	}
	finished := 0
	if o.Done() {
		finished = 1
	}
	return d.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `
INSERT INTO operations (id, sandbox_id, kind, state, finished, created_at, data) VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET sandbox_id = excluded.sandbox_id, kind = excluded.kind, state = excluded.state,
	finished = excluded.finished, created_at = excluded.created_at, data = excluded.data`,
			o.ID, o.SandboxID, o.Kind, o.State, finished, unixNano(o.CreatedAt), string(data))
		if err != nil {
			return fmt.Errorf("put operation %q: %w", o.ID, err)
		}
		return nil
	})
}

// GetOperation returns the operation with the given id, or ErrNotFound.
func (d *DB) GetOperation(ctx context.Context, id string) (api.Operation, error) {
	var data string
	err := d.db.QueryRowContext(ctx, `SELECT data FROM operations WHERE id = ?`, id).Scan(&data)
	if isNoRows(err) {
		return api.Operation{}, notFound("operation", id)
	}
	if err != nil {
		return api.Operation{}, fmt.Errorf("get operation %q: %w", id, err)
	}
	var o api.Operation
	if err := json.Unmarshal([]byte(data), &o); err != nil {
		return api.Operation{}, fmt.Errorf("decode operation %q: %w", id, err)
	}
	return o, nil
}

// ListOperations returns the operations matching f, oldest first.
func (d *DB) ListOperations(ctx context.Context, f OperationFilter) ([]api.Operation, error) {
	var (
		where []string
		args  []any
	)
	if f.SandboxID != "" {
		where = append(where, "sandbox_id = ?")
		args = append(args, f.SandboxID)
	}
	if f.Unfinished {
		where = append(where, "finished = 0")
	}
	q := `SELECT data FROM operations`
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	q += " ORDER BY created_at, id"
	return queryJSON[api.Operation](ctx, d.db, "list operations", q, args...)
}

// DeleteOperationsBefore removes finished operations created before t and
// returns how many went. Unfinished operations are never pruned: recovery
// needs them.
func (d *DB) DeleteOperationsBefore(ctx context.Context, t time.Time) (int64, error) {
	var n int64
	err := d.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM operations WHERE finished = 1 AND created_at < ?`, unixNano(t))
		if err != nil {
			return fmt.Errorf("prune operations: %w", err)
		}
		n, _ = res.RowsAffected()
		return nil
	})
	return n, err
}

// PutCommand inserts or replaces c, keyed by (c.SandboxID, c.ID). The
// sandbox must exist (ErrNotFound otherwise). c.AttachToken is not stored.
func (d *DB) PutCommand(ctx context.Context, c CommandRecord) error {
	if err := requireID("sandbox", c.SandboxID); err != nil {
		return err
	}
	if err := requireID("command", c.ID); err != nil {
		return err
	}
	c.AttachToken = ""
	data, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("encode command %q: %w", c.ID, err)
	}
	return d.write(ctx, func(tx *sql.Tx) error {
		var one int
		err := tx.QueryRowContext(ctx, `SELECT 1 FROM sandboxes WHERE id = ?`, c.SandboxID).Scan(&one)
		if isNoRows(err) {
			return fmt.Errorf("command %q: %w", c.ID, notFound("sandbox", c.SandboxID))
		}
		if err != nil {
			return fmt.Errorf("put command %q: %w", c.ID, err)
		}
		_, err = tx.ExecContext(ctx, `
INSERT INTO commands (sandbox_id, id, state, created_at, data) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (sandbox_id, id) DO UPDATE SET state = excluded.state, created_at = excluded.created_at, data = excluded.data`,
			c.SandboxID, c.ID, c.State, unixNano(c.CreatedAt), string(data))
		if err != nil {
			return fmt.Errorf("put command %q: %w", c.ID, err)
		}
		return nil
	})
}

// GetCommand returns one command session, or ErrNotFound.
func (d *DB) GetCommand(ctx context.Context, sandboxID, id string) (CommandRecord, error) {
	var data string
	err := d.db.QueryRowContext(ctx, `SELECT data FROM commands WHERE sandbox_id = ? AND id = ?`, sandboxID, id).Scan(&data)
	if isNoRows(err) {
		return CommandRecord{}, fmt.Errorf("sandbox %q: %w", sandboxID, notFound("command", id))
	}
	if err != nil {
		return CommandRecord{}, fmt.Errorf("get command %q: %w", id, err)
	}
	var c CommandRecord
	if err := json.Unmarshal([]byte(data), &c); err != nil {
		return CommandRecord{}, fmt.Errorf("decode command %q: %w", id, err)
	}
	return c, nil
}

// ListCommands returns a sandbox's command sessions, oldest first. An
// unknown sandbox has none (no error).
func (d *DB) ListCommands(ctx context.Context, sandboxID string) ([]CommandRecord, error) {
	return queryJSON[CommandRecord](ctx, d.db, "list commands",
		`SELECT data FROM commands WHERE sandbox_id = ? ORDER BY created_at, id`, sandboxID)
}

// queryJSON runs a query whose single column is a JSON document of T.
func queryJSON[T any](ctx context.Context, db *sql.DB, what, q string, args ...any) ([]T, error) {
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	defer rows.Close()
	out := []T{}
	for rows.Next() {
		var data string
		if err := rows.Scan(&data); err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		var v T
		if err := json.Unmarshal([]byte(data), &v); err != nil {
			return nil, fmt.Errorf("%s: decode: %w", what, err)
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return out, nil
}

// maxNetworkSummaries bounds the summaries kept per sandbox (the oldest go).
const maxNetworkSummaries = 100

// AddNetworkSummary records what one ended network link of sandbox id
// counted. A missing sandbox is ErrNotFound.
func (d *DB) AddNetworkSummary(ctx context.Context, id string, s api.NetworkSummary) error {
	data, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return d.write(ctx, func(tx *sql.Tx) error {
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM sandboxes WHERE id = ?`, id).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return notFound("sandbox", id)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO network_summaries (sandbox_id, ended_at, data) VALUES (?, ?, ?)`,
			id, s.EndedAt.UnixNano(), string(data)); err != nil {
			return fmt.Errorf("add network summary of %q: %w", id, err)
		}
		_, err := tx.ExecContext(ctx, `DELETE FROM network_summaries WHERE sandbox_id = ? AND rowid NOT IN
			(SELECT rowid FROM network_summaries WHERE sandbox_id = ? ORDER BY ended_at DESC LIMIT ?)`, id, id, maxNetworkSummaries)
		return err
	})
}

// NetworkSummaries returns up to limit summaries of sandbox id, newest first.
func (d *DB) NetworkSummaries(ctx context.Context, id string, limit int) ([]api.NetworkSummary, error) {
	rows, err := d.db.QueryContext(ctx, `SELECT data FROM network_summaries WHERE sandbox_id = ? ORDER BY ended_at DESC LIMIT ?`, id, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []api.NetworkSummary
	for rows.Next() {
		var data string
		if err := rows.Scan(&data); err != nil {
			return nil, err
		}
		var s api.NetworkSummary
		if err := json.Unmarshal([]byte(data), &s); err != nil {
			return nil, fmt.Errorf("network summary of %q: %w", id, err)
		}
		out = append(out, s)
	}
	return out, rows.Err()
}
