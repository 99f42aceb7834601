package policy

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
)

// ask records an approval for a, tells the followers, and waits for its
// answer, its expiry or the end of ctx (which expires it: nobody is left
// to run the action).
func (e *Engine) ask(ctx context.Context, a actions.Action, r Result) actions.Decision {
	now := e.cfg.Now().UTC()
	ap := api.Approval{ID: newApprovalID(), Sandbox: a.Sandbox, Tenant: a.Tenant, Action: a, Rule: r.Rule,
		Reason: r.Reason, State: api.ApprovalPending, CreatedAt: now, ExpiresAt: now.Add(e.cfg.ApprovalTimeout)}
	ch := make(chan api.Approval, 1)
	e.amu.Lock()
	e.waiting[ap.ID] = ch
	e.amu.Unlock()
	defer func() {
		e.amu.Lock()
		delete(e.waiting, ap.ID)
		e.amu.Unlock()
	}()
	deny := func(why string) actions.Decision {
		return actions.Decision{Verdict: actions.Deny, Rule: r.Rule, Reason: why, Approval: ap.ID}
	}
	if err := e.put(context.WithoutCancel(ctx), ap); err != nil {
		e.cfg.Logger.Error("recording an approval", "err", err)
		return deny("the approval could not be recorded; failing closed")
	}
	e.record(ctx, "ask", ap)
	e.publish(ap)
	timer := time.NewTimer(e.cfg.ApprovalTimeout)
	defer timer.Stop()
	select {
	case ans := <-ch:
		return e.decisionOf(ans, r)
	case <-timer.C:
		return e.expire(ctx, ap, ch, r, fmt.Sprintf("nobody answered within %v", e.cfg.ApprovalTimeout))
	case <-ctx.Done():
		return e.expire(ctx, ap, ch, r, "the request that needed it ended")
	}
}

func (e *Engine) decisionOf(ap api.Approval, r Result) actions.Decision {
	d := actions.Decision{Verdict: actions.Deny, Rule: r.Rule, Approval: ap.ID}
	switch ap.State {
	case api.ApprovalApproved:
		d.Verdict, d.Reason = actions.Allow, "approved"
	case api.ApprovalDenied:
		d.Reason = "denied by an approver"
		if ap.AnswerReason != "" {
			d.Reason += ": " + ap.AnswerReason
		}
	default:
		d.Reason = "approval " + ap.State
		if ap.AnswerReason != "" {
			d.Reason += ": " + ap.AnswerReason
		}
	}
	return d
}

// expire ends a pending approval unanswered, unless an answer won the race.
func (e *Engine) expire(ctx context.Context, ap api.Approval, ch chan api.Approval, r Result, why string) actions.Decision {
	now := e.cfg.Now().UTC()
	ap.State, ap.AnsweredAt, ap.AnswerReason = api.ApprovalExpired, &now, why
	ok, err := e.update(context.WithoutCancel(ctx), ap)
	if err != nil {
		e.cfg.Logger.Error("expiring an approval", "id", ap.ID, "err", err)
	}
	if !ok {
		select {
		case ans := <-ch:
			return e.decisionOf(ans, r)
		default:
		}
	}
	e.record(ctx, "expire", ap)
	e.publish(ap)
	return e.decisionOf(ap, r)
}

// Answer approves or denies a pending approval; answering one that is no
// longer pending is ErrConflict naming its state.
func (e *Engine) Answer(ctx context.Context, id string, approve bool, reason string) (api.Approval, error) {
	if len(reason) > 1024 {
		return api.Approval{}, fmt.Errorf("reason is more than 1024 bytes: %w", errdefs.ErrInvalidArgument)
	}
	ap, err := e.Approval(ctx, id)
	if err != nil {
		return ap, err
	}
	if ap.State != api.ApprovalPending {
		return ap, fmt.Errorf("approval %s is already %s: %w", id, ap.State, errdefs.ErrConflict)
	}
	now := e.cfg.Now().UTC()
	ap.State, ap.AnsweredAt, ap.AnswerReason = api.ApprovalDenied, &now, reason
	if approve {
		ap.State = api.ApprovalApproved
	}
	if p, ok := principal.From(ctx); ok {
		ap.AnsweredBy = p.KeyID
	}
	ok, err := e.update(ctx, ap)
	if err != nil {
		return ap, err
	}
	if !ok {
		cur, _ := e.Approval(ctx, id)
		return cur, fmt.Errorf("approval %s is already %s: %w", id, cur.State, errdefs.ErrConflict)
	}
	e.amu.Lock()
	ch := e.waiting[id]
	e.amu.Unlock()
	if ch != nil {
		select {
		case ch <- ap:
		default:
		}
	}
	verb := "deny"
	if approve {
		verb = "approve"
	}
	e.record(ctx, verb, ap)
	e.publish(ap)
	return ap, nil
}

// Approval returns one approval.
func (e *Engine) Approval(ctx context.Context, id string) (api.Approval, error) {
	var body string
	err := e.cfg.DB.QueryRowContext(ctx, `SELECT body FROM policy_approvals WHERE id=?`, id).Scan(&body)
	if errors.Is(err, sql.ErrNoRows) {
		return api.Approval{}, fmt.Errorf("approval %q: %w", trunc(id), errdefs.ErrNotFound)
	}
	if err != nil {
		return api.Approval{}, err
	}
	var ap api.Approval
	return ap, json.Unmarshal([]byte(body), &ap)
}

// MaxListed bounds one listing of approvals (the newest are kept).
const MaxListed = 1000

// Approvals lists approvals in state ("" = every state) the filter keeps,
// oldest first, at most MaxListed (the newest).
func (e *Engine) Approvals(ctx context.Context, state string, keep func(api.Approval) bool) ([]api.Approval, error) {
	switch state {
	case "", api.ApprovalPending, api.ApprovalApproved, api.ApprovalDenied, api.ApprovalExpired:
	default:
		return nil, fmt.Errorf("state must be pending, approved, denied or expired, got %q: %w", trunc(state), errdefs.ErrInvalidArgument)
	}
	rows, err := e.cfg.DB.QueryContext(ctx, `SELECT body FROM policy_approvals WHERE (?1 = '' OR state = ?1) ORDER BY created_at DESC, id LIMIT 100000`, state)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []api.Approval
	for rows.Next() && len(out) < MaxListed {
		var body string
		if err := rows.Scan(&body); err != nil {
			return nil, err
		}
		var ap api.Approval
		if err := json.Unmarshal([]byte(body), &ap); err != nil {
			return nil, err
		}
		if keep == nil || keep(ap) {
			out = append(out, ap)
		}
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, rows.Err()
}

// FollowApprovals calls fn with every approval created or changed from now
// on until ctx ends or fn fails. A follower that falls more than 256
// changes behind is ended with ErrUnavailable (it re-lists and follows
// again) rather than holding up the actions waiting on approvals.
//
// started (if not nil) runs once the follower is subscribed, so a caller
// that lists the current approvals there misses no change in between.
func (e *Engine) FollowApprovals(ctx context.Context, started func() error, fn func(api.Approval) error) error {
	ch := make(chan api.Approval, 256)
	e.amu.Lock()
	e.subs[ch] = struct{}{}
	e.amu.Unlock()
	defer func() {
		e.amu.Lock()
		delete(e.subs, ch)
		e.amu.Unlock()
	}()
	if started != nil {
		if err := started(); err != nil {
			return err
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case ap, ok := <-ch:
			if !ok {
				return fmt.Errorf("approval follower fell behind: %w", errdefs.ErrUnavailable)
			}
			if err := fn(ap); err != nil {
				return err
			}
		}
	}
}

func (e *Engine) publish(ap api.Approval) {
	e.amu.Lock()
	defer e.amu.Unlock()
	for ch := range e.subs {
		select {
		case ch <- ap:
		default:
			close(ch)
			delete(e.subs, ch)
		}
	}
}

func (e *Engine) record(ctx context.Context, verb string, ap api.Approval) {
	ev := audit.Event{Kind: audit.KindApproval, Action: verb, Sandbox: ap.Sandbox, Target: ap.ID, Result: ap.State, Tenant: ap.Tenant,
		Detail: map[string]any{"rule": ap.Rule, "kind": ap.Action.Kind}}
	if ap.AnswerReason != "" {
		ev.Detail["reason"] = ap.AnswerReason
	}
	e.cfg.Audit.Record(context.WithoutCancel(ctx), ev)
}

func (e *Engine) put(ctx context.Context, ap api.Approval) error {
	body, _ := json.Marshal(ap)
	_, err := e.cfg.DB.ExecContext(ctx, `INSERT INTO policy_approvals(id, sandbox, tenant, state, created_at, body) VALUES(?,?,?,?,?,?)`,
		ap.ID, ap.Sandbox, ap.Tenant, ap.State, ap.CreatedAt.UTC().Format(tsFormat), string(body))
	return err
}

// update stores ap's answer if the approval is still pending; false if it
// was not.
func (e *Engine) update(ctx context.Context, ap api.Approval) (bool, error) {
	body, _ := json.Marshal(ap)
	res, err := e.cfg.DB.ExecContext(ctx, `UPDATE policy_approvals SET state=?, body=? WHERE id=? AND state=?`,
		ap.State, string(body), ap.ID, api.ApprovalPending)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// tsFormat sorts as text in time order (fixed width, UTC).
const tsFormat = "2006-01-02T15:04:05.000000000Z"

// expireLeftovers expires the approvals a previous process left pending.
func (e *Engine) expireLeftovers(ctx context.Context) error {
	left, err := e.Approvals(ctx, api.ApprovalPending, nil)
	if err != nil {
		return err
	}
	for _, ap := range left {
		now := e.cfg.Now().UTC()
		ap.State, ap.AnsweredAt, ap.AnswerReason = api.ApprovalExpired, &now, "the server restarted while it was pending"
		if _, err := e.update(ctx, ap); err != nil {
			return err
		}
	}
	return nil
}
