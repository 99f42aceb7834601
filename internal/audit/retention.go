package audit

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

func (l *Log) retentionLoop(ctx context.Context) {
	defer l.rwg.Done()
	t := time.NewTicker(l.opts.RetentionEvery)
	defer t.Stop()
	for {
		if _, err := l.Retain(ctx); err != nil && ctx.Err() == nil {
			l.log.Warn("audit retention failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Retain applies the retention bounds now and returns how many records it
// deleted. The cut is always just before a checkpoint, which becomes the
// first record: its signature covers the hash of the last record cut (its
// prev), so what is left still verifies from it. The cut is noted in
// audit_anchors first, then old records are deleted in small transactions
// (the writer keeps appending meanwhile); an interrupted cut finishes at
// the next run. A record of kind "audit", action "retention" notes it in
// the chain.
func (l *Log) Retain(ctx context.Context) (int64, error) {
	o := l.opts
	if o.RetainAge <= 0 && o.RetainRecords <= 0 {
		return 0, nil
	}
	var cut int64
	if o.RetainRecords > 0 {
		var maxSeq sql.NullInt64
		if err := l.db.QueryRowContext(ctx, `SELECT MAX(seq) FROM audit_records`).Scan(&maxSeq); err != nil {
			return 0, err
		}
		// Keep at least RetainRecords: cut at the newest checkpoint that
		// leaves that many from it on.
		if limit := maxSeq.Int64 - o.RetainRecords + 1; limit > 1 {
			var c sql.NullInt64
			if err := l.db.QueryRowContext(ctx, `SELECT MAX(seq) FROM audit_records WHERE kind = ? AND seq <= ?`, KindCheckpoint, limit).Scan(&c); err != nil {
				return 0, err
			}
			cut = max(cut, c.Int64)
		}
	}
	if o.RetainAge > 0 {
		// Everything before a checkpoint older than the bound was
		// recorded before it.
		var c sql.NullInt64
		if err := l.db.QueryRowContext(ctx, `SELECT MAX(seq) FROM audit_records WHERE kind = ? AND time <= ?`, KindCheckpoint, o.Now().Add(-o.RetainAge).UnixNano()).Scan(&c); err != nil {
			return 0, err
		}
		cut = max(cut, c.Int64)
	}
	var first sql.NullInt64
	if err := l.db.QueryRowContext(ctx, `SELECT MIN(seq) FROM audit_records`).Scan(&first); err != nil {
		return 0, err
	}
	if cut <= first.Int64 {
		return 0, nil
	}
	var line string
	if err := l.db.QueryRowContext(ctx, `SELECT line FROM audit_records WHERE seq = ?`, cut).Scan(&line); err != nil {
		return 0, err
	}
	var cp struct {
		Detail CheckpointDetail `json:"detail"`
	}
	if err := json.Unmarshal([]byte(line), &cp); err != nil {
		return 0, fmt.Errorf("checkpoint %d does not parse: %w", cut, err)
	}
	if _, err := l.db.ExecContext(ctx, `INSERT OR IGNORE INTO audit_anchors (seq, head, cut_at, deleted) VALUES (?, ?, ?, 0)`,
		cut, cp.Detail.Head, o.Now().UnixNano()); err != nil {
		return 0, err
	}
	var total int64
	for {
		res, err := l.db.ExecContext(ctx, `DELETE FROM audit_records WHERE seq IN (SELECT seq FROM audit_records WHERE seq < ? ORDER BY seq LIMIT 5000)`, cut)
		if err != nil {
			return total, err
		}
		n, _ := res.RowsAffected()
		total += n
		if n == 0 {
			break
		}
	}
	if _, err := l.db.ExecContext(ctx, `UPDATE audit_anchors SET deleted = deleted + ? WHERE seq = ?`, total, cut); err != nil {
		return total, err
	}
	l.Record(ctx, Event{Kind: KindAudit, Action: "retention", Target: strconv.FormatInt(cut, 10), Result: strconv.FormatInt(total, 10),
		Detail: map[string]any{"anchor_seq": cut, "anchor_head": cp.Detail.Head, "deleted": total, "first_before": first.Int64}})
	return total, nil
}
