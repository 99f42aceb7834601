package audit

import (
	"context"
	"crypto/ed25519"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/spacehq/space/internal/audit/chain"
)

// A log's chain proves its records were not changed after the fact only to
// someone who holds a later record's hash from elsewhere: whoever can write
// the SQLite file can also roll it back to an older copy, or cut its tail.
// In a cluster each node publishes its newest signed checkpoint to the
// cluster's PostgreSQL (its "head"), and checks before every publish that
// its own log still holds the head published last and verifies from there.

// ErrAnchorMismatch is VerifySince's finding that the log does not hold, or
// does not verify from, a head published outside it.
var ErrAnchorMismatch = errors.New("the audit log does not continue its anchored head")

// Head is a signed checkpoint of the log: its seq and hash, and its line
// exactly as stored (which carries the signature).
type Head struct {
	Seq  uint64
	Hash string
	Line string
}

// Anchor is what a published head pins: the record at Seq has Hash.
func (h Head) Anchor() Anchor { return Anchor{Seq: h.Seq, Hash: h.Hash} }

// VerifySince checks the log against a: the record at a.Seq must be there
// with hash a.Hash, and every record after it must match its hash, link to
// the one before and, at each checkpoint, carry a signature of this log's
// key. It returns the newest checkpoint (ok false when the log has none),
// which is what to publish next. A zero a (nothing published yet) checks
// only the newest checkpoint; an a older than the log's retained start
// checks from that start (a retention cut is itself a signed checkpoint).
// Records before a are not read: `space audit verify --anchor` on an
// export checks the whole chain.
func (l *Log) VerifySince(ctx context.Context, a Anchor) (head Head, ok bool, err error) {
	// The newest checkpoint first, so that the range read after it holds it.
	var first, last, cp sql.NullInt64
	if err := l.db.QueryRowContext(ctx, `SELECT MAX(seq) FROM audit_records WHERE kind = ?`, KindCheckpoint).Scan(&cp); err != nil {
		return Head{}, false, fmt.Errorf("audit log: %w", err)
	}
	if err := l.db.QueryRowContext(ctx, `SELECT MIN(seq), MAX(seq) FROM audit_records`).Scan(&first, &last); err != nil {
		return Head{}, false, fmt.Errorf("audit log: %w", err)
	}
	if a.Seq > 0 && (!last.Valid || uint64(last.Int64) < a.Seq) {
		return Head{}, false, fmt.Errorf("%w: it ends at seq %d, before its anchored checkpoint (seq %d): records were removed or the log was rolled back",
			ErrAnchorMismatch, last.Int64, a.Seq)
	}
	if !cp.Valid {
		return Head{}, false, nil
	}
	from := uint64(cp.Int64)
	if a.Seq > 0 {
		from = max(a.Seq, uint64(first.Int64))
	}
	o := chain.VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}, AllowUnsignedTail: true}
	if a.Seq > 0 {
		o.Anchors = []Anchor{a}
	}
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(l.copyLines(ctx, from, uint64(last.Int64), pw))
	}()
	rep, err := chain.Verify(pr, o)
	pr.CloseWithError(io.ErrClosedPipe) // stops the writer if Verify ended early
	if err != nil {
		return Head{}, false, fmt.Errorf("audit log: %w", err)
	}
	if !rep.OK() {
		p := rep.Problems[0]
		more := ""
		if len(rep.Problems) > 1 {
			more = fmt.Sprintf(" (and %d more problems)", len(rep.Problems)-1)
		}
		return Head{}, false, fmt.Errorf("%w: seq %d: %s: %s%s", ErrAnchorMismatch, p.Seq, p.Kind, p.Message, more)
	}
	var line string
	if err := l.db.QueryRowContext(ctx, `SELECT line FROM audit_records WHERE seq = ?`, cp.Int64).Scan(&line); err != nil {
		return Head{}, false, fmt.Errorf("audit log: %w", err)
	}
	var rec Record
	if err := json.Unmarshal([]byte(line), &rec); err != nil {
		return Head{}, false, fmt.Errorf("stored audit record does not parse: %w", err)
	}
	return Head{Seq: rec.Seq, Hash: rec.Hash, Line: line}, true, nil
}

// copyLines writes the stored lines with seq in [from, to] to w, one per
// line, in seq order.
func (l *Log) copyLines(ctx context.Context, from, to uint64, w io.Writer) error {
	after := from - 1
	for after < to {
		rows, err := l.db.QueryContext(ctx, `SELECT seq, line FROM audit_records WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT 1000`, int64(after), int64(to))
		if err != nil {
			return err
		}
		n := 0
		for rows.Next() {
			var s int64
			var line string
			if err := rows.Scan(&s, &line); err != nil {
				rows.Close()
				return err
			}
			n++
			after = uint64(s)
			if _, err := io.WriteString(w, line+"\n"); err != nil {
				rows.Close()
				return err
			}
		}
		err = rows.Err()
		rows.Close()
		if err != nil || n == 0 {
			return err
		}
	}
	return nil
}
