package sandbox

import (
	"context"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
)

// SetExpiry moves a sandbox's deadline: at (when set) is when the reconcile
// loop applies the sandbox's expiry action (delete, or suspend — see
// api.Sandbox.OnExpiry); nil removes the deadline. A deadline in the past
// takes effect on the next tick.
//
// A deadline moved earlier, or set where there was none less than
// shortFuse away, brings the expiry action closer: the policy decides that
// verb now (the loop that applies it later is housekeeping, not decided),
// so a caller a rule keeps from deleting cannot set a deadline of now
// instead. Moving a deadline later, removing it, or giving a sandbox
// without one a deadline at least shortFuse away (what E2B's connect does,
// 5 minutes by default) is not decided.
func (part *Verbs) SetExpiry(ctx context.Context, id string, at *time.Time) (api.Sandbox, error) {
	m := part.m
	if err := ValidID(id); err != nil {
		return api.Sandbox{}, err
	}
	if at != nil && at.After(time.Now().Add(maxTTLSeconds*time.Second)) {
		return api.Sandbox{}, invalid("the deadline may be at most %d seconds away", maxTTLSeconds)
	}
	if at != nil {
		cur, err := m.Get(ctx, id)
		if err != nil {
			return api.Sandbox{}, err
		}
		if cur.ExpiresAt != nil && at.Before(*cur.ExpiresAt) || cur.ExpiresAt == nil && time.Until(*at) < shortFuse {
			verb := api.OpDelete
			if cur.OnExpiry == api.ExpirySuspend {
				verb = api.OpSuspend
			}
			if err := m.decide(ctx, cur, actions.Action{Kind: actions.Lifecycle, Verb: verb}); err != nil {
				return api.Sandbox{}, err
			}
		}
	}
	return m.updateRecord(ctx, id, "set the deadline of", func(sb *api.Sandbox) (bool, error) {
		if at != nil {
			t := at.UTC()
			sb.ExpiresAt = &t
		} else {
			sb.ExpiresAt = nil
		}
		return true, nil
	}, nil)
}

// shortFuse is how soon a first deadline must be to count as bringing the
// expiry action closer (SetExpiry).
const shortFuse = 4 * time.Minute

// expire applies sandbox sb's expiry action now that its deadline passed.
func (part *Verbs) expire(ctx context.Context, sb api.Sandbox) {
	m := part.m
	if sb.OnExpiry == api.ExpirySuspend {
		switch sb.State {
		case api.StateSuspended, api.StateStopped:
			// Nothing runs: the deadline is spent.
			m.verbs.SetExpiry(ctx, sb.ID, nil)
			return
		}
		m.log.Info("sandbox deadline passed; suspending", "sandbox", sb.ID)
		if _, err := m.verbs.systemLifecycle(ctx, sb.ID, api.OpSuspend, false); err == nil {
			m.verbs.SetExpiry(ctx, sb.ID, nil)
			return
		}
		// A runtime that cannot suspend stops instead: the disk survives.
		m.log.Info("sandbox cannot suspend; stopping it at its deadline", "sandbox", sb.ID)
		if _, err := m.verbs.systemLifecycle(ctx, sb.ID, api.OpStop, true); err == nil {
			m.verbs.SetExpiry(ctx, sb.ID, nil)
		}
		return
	}
	m.log.Info("sandbox TTL expired; deleting", "sandbox", sb.ID)
	m.verbs.systemLifecycle(ctx, sb.ID, api.OpDelete, true)
}
