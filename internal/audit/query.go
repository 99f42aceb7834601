package audit

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Filter selects records.
type Filter struct {
	Sandbox string // only this sandbox's records
	Kind    string // only this kind
	Tenant  string // only this tenant's records ("" = every tenant)
	After   uint64 // only records with a larger seq
	Limit   int    // at most this many (List; default 1000)
}

// DefaultLimit and MaxLimit bound List.
const (
	DefaultLimit = 1000
	MaxLimit     = 10000
)

func (f Filter) where() (string, []any) {
	conds := []string{"seq > ?"}
	args := []any{int64(f.After)}
	if f.Sandbox != "" {
		conds, args = append(conds, "sandbox = ?"), append(args, f.Sandbox)
	}
	if f.Kind != "" {
		conds, args = append(conds, "kind = ?"), append(args, f.Kind)
	}
	if f.Tenant != "" {
		conds, args = append(conds, "tenant = ?"), append(args, f.Tenant)
	}
	return strings.Join(conds, " AND "), args
}

// lines returns the stored lines matching f, oldest first, at most limit.
func (l *Log) lines(ctx context.Context, f Filter, limit int) ([]string, []uint64, error) {
	w, args := f.where()
	rows, err := l.db.QueryContext(ctx, `SELECT seq, line FROM audit_records WHERE `+w+` ORDER BY seq LIMIT ?`, append(args, limit)...)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	var out []string
	var seqs []uint64
	for rows.Next() {
		var s int64
		var line string
		if err := rows.Scan(&s, &line); err != nil {
			return nil, nil, err
		}
		out, seqs = append(out, line), append(seqs, uint64(s))
	}
	return out, seqs, rows.Err()
}

// List returns the records matching f, oldest first.
func (l *Log) List(ctx context.Context, f Filter) ([]Record, error) {
	limit := f.Limit
	if limit <= 0 {
		limit = DefaultLimit
	}
	limit = min(limit, MaxLimit)
	lines, _, err := l.lines(ctx, f, limit)
	if err != nil {
		return nil, err
	}
	out := make([]Record, 0, len(lines))
	for _, line := range lines {
		var r Record
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			return nil, fmt.Errorf("stored audit record does not parse: %w", err)
		}
		out = append(out, r)
	}
	return out, nil
}

// Follow calls fn for every record matching f (Limit ignored), oldest
// first, then for new ones as they are committed, until ctx ends or fn
// fails.
func (l *Log) Follow(ctx context.Context, f Filter, fn func(Record) error) error {
	for {
		ch := l.changedCh()
		recs, err := l.List(ctx, Filter{Sandbox: f.Sandbox, Kind: f.Kind, Tenant: f.Tenant, After: f.After, Limit: MaxLimit})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		for _, r := range recs {
			if err := fn(r); err != nil {
				return err
			}
			f.After = r.Seq
		}
		if len(recs) == MaxLimit {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ch:
		case <-l.done:
			return nil
		}
	}
}

// Export writes the chain's lines (each exactly as stored, so the output
// verifies) from the last checkpoint at or before since (from the start
// of the log when there is none, or since is zero) through a checkpoint
// signed now, so the whole file is covered by a signature. A non-empty
// tenant keeps only that tenant's records and the checkpoints (such a
// file shows gaps to Verify: other tenants' records are not in it).
func (l *Log) Export(ctx context.Context, since time.Time, tenant string, fn func(line []byte) error) error {
	if err := l.Flush(ctx); err != nil {
		return err
	}
	end, err := l.Checkpoint(ctx)
	if err != nil {
		return err
	}
	if end == 0 {
		return nil
	}
	start, err := l.exportStart(ctx, since)
	if err != nil {
		return err
	}
	after := start - 1
	for after < end {
		rows, err := l.db.QueryContext(ctx, `SELECT seq, kind, tenant, line FROM audit_records WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT 1000`, int64(after), int64(end))
		if err != nil {
			return err
		}
		n := 0
		for rows.Next() {
			var s int64
			var kind, t, line string
			if err := rows.Scan(&s, &kind, &t, &line); err != nil {
				rows.Close()
				return err
			}
			n++
			after = uint64(s)
			if tenant != "" && t != tenant && kind != KindCheckpoint {
				continue
			}
			if err := fn([]byte(line)); err != nil {
				rows.Close()
				return err
			}
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return err
		}
		if n == 0 {
			break
		}
	}
	return nil
}

// exportStart is the first seq an export since t starts at: the newest
// checkpoint at or before t, never before the retention anchor.
func (l *Log) exportStart(ctx context.Context, t time.Time) (uint64, error) {
	var first, anchor sql.NullInt64
	if err := l.db.QueryRowContext(ctx, `SELECT MIN(seq) FROM audit_records`).Scan(&first); err != nil {
		return 0, err
	}
	if err := l.db.QueryRowContext(ctx, `SELECT MAX(seq) FROM audit_anchors`).Scan(&anchor); err != nil {
		return 0, err
	}
	start := uint64(max(first.Int64, anchor.Int64, 1))
	if !t.IsZero() {
		var cp sql.NullInt64
		if err := l.db.QueryRowContext(ctx, `SELECT MAX(seq) FROM audit_records WHERE kind = ? AND time <= ?`, KindCheckpoint, t.UnixNano()).Scan(&cp); err != nil {
			return 0, err
		}
		if cp.Valid {
			start = max(start, uint64(cp.Int64))
		}
	}
	return start, nil
}

// NetworkCursor is the link sequence number (Detail "link_seq") of the
// newest network record of sandbox, 0 if none: where a follower of its
// gateway link resumes after a server restart.
func (l *Log) NetworkCursor(ctx context.Context, sandbox string) (uint64, error) {
	var line string
	err := l.db.QueryRowContext(ctx, `SELECT line FROM audit_records WHERE sandbox = ? AND kind = ? ORDER BY seq DESC LIMIT 1`, sandbox, KindNetwork).Scan(&line)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	var r struct {
		Detail struct {
			LinkSeq uint64 `json:"link_seq"`
		} `json:"detail"`
	}
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		return 0, err
	}
	return r.Detail.LinkSeq, nil
}
