package server

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
)

// anchorAudit publishes this node's audit chain head to the cluster every
// interval, after checking that the log still holds the head published
// before and verifies from it (audit.Log.VerifySince). When it does not —
// the file rolled back, cut, rewritten, or signed by another key — the
// node reports the problem on its head (which stays as the evidence),
// records it in its own log, and publishes nothing more until an admin
// forgets the head (DELETE /v1/audit/heads/{node} through a replica).
func (part auditAPI) anchorAudit(ctx context.Context, cs *clusterstore.AuditHeadStore, node string, interval time.Duration) {
	s := part.s
	if s.auditLog == nil {
		return // a test server without a log
	}
	log := s.cfg.Logger.With("component", "audit-anchor")
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := (auditAPI{s}).anchorOnce(ctx, cs, node); err != nil && ctx.Err() == nil {
			log.Warn("anchoring the audit head", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (part auditAPI) anchorOnce(ctx context.Context, cs *clusterstore.AuditHeadStore, node string) error {
	s := part.s
	anchored, err := cs.AuditHead(ctx, node)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		anchored = clusterstore.AuditHead{}
	case err != nil:
		return err
	case anchored.Problem != "":
		return nil // frozen until an admin forgets it
	}
	if anchored.Seq > 0 && anchored.KeyID != s.auditLog.KeyID() {
		return (auditAPI{s}).auditMismatch(ctx, cs, node, "the cluster anchored audit key "+anchored.KeyID+", but this node's log signs with "+s.auditLog.KeyID())
	}
	head, ok, err := s.auditLog.VerifySince(ctx, audit.Anchor{Seq: anchored.Seq, Hash: anchored.Hash})
	if errors.Is(err, audit.ErrAnchorMismatch) {
		return (auditAPI{s}).auditMismatch(ctx, cs, node, err.Error())
	}
	if err != nil || !ok || head.Seq <= anchored.Seq {
		return err
	}
	err = cs.AnchorAudit(ctx, node, head.Line, s.auditLog.PublicKey())
	if errors.Is(err, clusterstore.ErrAuditHeadStale) {
		return nil // a problem or a newer head appeared meanwhile: the next round sees it
	}
	return err
}

func (part auditAPI) auditMismatch(ctx context.Context, cs *clusterstore.AuditHeadStore, node, problem string) error {
	s := part.s
	s.cfg.Logger.Error("this node's audit log does not continue the head anchored in the cluster; publishing stops until an admin forgets the head",
		"node", node, "problem", problem)
	s.audit.Record(ctx, audit.Event{Kind: audit.KindAudit, Action: "anchor", Target: node, Result: "mismatch: " + problem})
	// The node's own record is committed before the cluster hears of the
	// problem: whoever sees it on the head finds the evidence in the log.
	if err := s.auditLog.Flush(ctx); err != nil {
		return fmt.Errorf("committing the mismatch record: %w", err)
	}
	return cs.ReportAuditProblem(ctx, node, problem)
}
