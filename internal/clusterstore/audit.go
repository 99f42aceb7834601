package clusterstore

import (
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/internal/audit/chain"
	"github.com/spacehq/space/internal/errdefs"
)

// AuditHeadStore keeps each node's audit chain head: the witness, outside
// the node, that its audit log was not rolled back or rewritten. A node
// anchors its newest signed checkpoint and reports a log that stopped
// continuing it; an admin forgets a head to let the node start afresh.
type AuditHeadStore struct {
	pool *pgxpool.Pool
}

// AuditHead is a node's audit chain head as the cluster keeps it: the
// newest signed checkpoint the node published, and the problem the node
// reported when its log no longer continued it.
type AuditHead struct {
	Node       string
	Seq        uint64
	Hash       string
	KeyID      string
	PublicKey  string // standard base64 of the node's ed25519 audit key
	Checkpoint string // the checkpoint's line, exactly as the node stores it
	SignedAt   time.Time
	AnchoredAt time.Time
	Problem    string
	ProblemAt  *time.Time
}

// ErrAuditHeadStale refuses a head that does not move the anchored one
// forward (an older or equal seq, another key, or a node with a problem on
// record).
var ErrAuditHeadStale = fmt.Errorf("audit head does not advance the anchored one: %w", errdefs.ErrConflict)

// AnchorAudit publishes node's newest signed checkpoint (its stored line)
// as its head, if the line is a checkpoint whose hash and signature hold
// with publicKey, and it advances the head on record under the same key.
func (a *AuditHeadStore) AnchorAudit(ctx context.Context, node, line string, publicKey ed25519.PublicKey) error {
	if node == "" {
		return fmt.Errorf("audit head needs the node: %w", errdefs.ErrInvalidArgument)
	}
	rep, err := chain.Verify(strings.NewReader(line), chain.VerifyOptions{Keys: []ed25519.PublicKey{publicKey}})
	if err != nil {
		return fmt.Errorf("audit head of %s: %v: %w", node, err, errdefs.ErrInvalidArgument)
	}
	var rec chain.Record
	if json.Unmarshal([]byte(line), &rec) != nil || rec.Kind != chain.KindCheckpoint || !rep.OK() || rep.Checkpoints != 1 {
		return fmt.Errorf("audit head of %s is not a checkpoint signed by its key (%v): %w", node, rep.Problems, errdefs.ErrInvalidArgument)
	}
	tag, err := a.pool.Exec(ctx, `
		INSERT INTO audit_heads (node, seq, hash, key_id, public_key, checkpoint, signed_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7)
		ON CONFLICT (node) DO UPDATE SET seq = EXCLUDED.seq, hash = EXCLUDED.hash, checkpoint = EXCLUDED.checkpoint,
			signed_at = EXCLUDED.signed_at, anchored_at = now()
		WHERE audit_heads.seq < EXCLUDED.seq AND audit_heads.key_id = EXCLUDED.key_id AND audit_heads.problem = ''`,
		node, int64(rec.Seq), rec.Hash, chain.KeyID(publicKey), base64.StdEncoding.EncodeToString(publicKey), line, rec.Time)
	if err != nil {
		return fmt.Errorf("audit head of %s: %w", node, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("node %s, seq %d: %w", node, rec.Seq, ErrAuditHeadStale)
	}
	return nil
}

// ReportAuditProblem records that node's log no longer continues its head.
// The head stays as it was: it is the evidence.
func (a *AuditHeadStore) ReportAuditProblem(ctx context.Context, node, problem string) error {
	if problem == "" {
		return fmt.Errorf("an audit problem needs its description: %w", errdefs.ErrInvalidArgument)
	}
	// The first report stands; a node with no head has nothing to contradict.
	if _, err := a.pool.Exec(ctx, `UPDATE audit_heads SET problem = $2, problem_at = now() WHERE node = $1 AND problem = ''`, node, problem); err != nil {
		return fmt.Errorf("audit problem of %s: %w", node, err)
	}
	return nil
}

// ForgetAuditHead drops node's head (and its problem): the node anchors
// its log afresh from its newest checkpoint. An admin's decision after
// looking into a problem, or for a node rebuilt on purpose.
func (a *AuditHeadStore) ForgetAuditHead(ctx context.Context, node string) error {
	tag, err := a.pool.Exec(ctx, `DELETE FROM audit_heads WHERE node = $1`, node)
	if err != nil {
		return fmt.Errorf("forget audit head of %s: %w", node, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("no audit head for node %q: %w", node, errdefs.ErrNotFound)
	}
	return nil
}

const auditHeadColumns = `node, seq, hash, key_id, public_key, checkpoint, signed_at, anchored_at, problem, problem_at`

func scanAuditHead(r pgx.CollectableRow) (AuditHead, error) {
	var h AuditHead
	var seq int64
	err := r.Scan(&h.Node, &seq, &h.Hash, &h.KeyID, &h.PublicKey, &h.Checkpoint, &h.SignedAt, &h.AnchoredAt, &h.Problem, &h.ProblemAt)
	h.Seq = uint64(seq)
	return h, err
}

// AuditHead is node's head; ErrNotFound when it has published none.
func (a *AuditHeadStore) AuditHead(ctx context.Context, node string) (AuditHead, error) {
	rows, err := a.pool.Query(ctx, `SELECT `+auditHeadColumns+` FROM audit_heads WHERE node = $1`, node)
	if err != nil {
		return AuditHead{}, fmt.Errorf("audit head of %s: %w", node, err)
	}
	h, err := pgx.CollectExactlyOneRow(rows, scanAuditHead)
	if errors.Is(err, pgx.ErrNoRows) {
		return AuditHead{}, fmt.Errorf("no audit head for node %q: %w", node, errdefs.ErrNotFound)
	}
	if err != nil {
		return AuditHead{}, fmt.Errorf("audit head of %s: %w", node, err)
	}
	return h, nil
}

// AuditHeads lists every node's head, by node.
func (a *AuditHeadStore) AuditHeads(ctx context.Context) ([]AuditHead, error) {
	rows, err := a.pool.Query(ctx, `SELECT `+auditHeadColumns+` FROM audit_heads ORDER BY node`)
	if err != nil {
		return nil, fmt.Errorf("list audit heads: %w", err)
	}
	return pgx.CollectRows(rows, scanAuditHead)
}
