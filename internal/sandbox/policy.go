package sandbox

import (
	"context"
	"fmt"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
)

// Decide asks the temporal policy (Config.Decider) whether a, an action on
// sandbox id, may happen; it fills in the sandbox, its tenant and its
// template. It may block while an approval is pending. A refusal is an
// ErrPolicyDenied error carrying the reason. Callers act only on nil.
func (m *Manager) Decide(ctx context.Context, id string, a actions.Action) error {
	sb, err := m.Get(ctx, id)
	if err != nil {
		return err
	}
	return m.decide(ctx, sb, a)
}

func (m *Manager) decide(ctx context.Context, sb api.Sandbox, a actions.Action) error {
	a.Sandbox, a.Tenant, a.Template = sb.ID, TenantOf(sb), sb.Template
	d := m.cfg.Decider.Decide(ctx, a)
	if d.Rule != "" || d.Approval != "" || !d.Allowed() {
		// Not a plain allow: a rule (or an approver) had a say.
		ev := audit.Event{Kind: audit.KindPolicy, Action: string(d.Verdict), Sandbox: sb.ID, Target: describe(a),
			Result: d.Reason, Tenant: a.Tenant, Detail: map[string]any{"kind": a.Kind, "rule": d.Rule}}
		if d.Approval != "" {
			ev.Detail["approval"] = d.Approval
		}
		m.cfg.Audit.Record(ctx, ev)
	}
	if d.Allowed() {
		return nil
	}
	msg := fmt.Sprintf("%s refused by policy: %s", describe(a), d.Reason)
	if d.Approval != "" {
		msg += " (approval " + d.Approval + ")"
	}
	return fmt.Errorf("%s: %w", msg, errdefs.ErrPolicyDenied)
}

// describe names an action for a message: "exec of curl", "file.read of
// /data/x", "lifecycle stop", "port 8080".
func describe(a actions.Action) string {
	switch {
	case len(a.Argv) > 0:
		return a.Kind + " of " + truncate(a.Argv[0], 64)
	case a.Path != "":
		return a.Kind + " of " + truncate(a.Path, 128)
	case a.Verb != "":
		return a.Kind + " " + a.Verb
	case a.Port != 0:
		return fmt.Sprintf("%s %d", a.Kind, a.Port)
	case a.Name != "":
		return a.Kind + " to " + a.Name
	}
	return a.Kind
}

// forgetPolicy tells the Decider a sandbox is gone, if it keeps state per sandbox.
func (m *Manager) forgetPolicy(id string) {
	if f, ok := m.cfg.Decider.(interface{ Forget(string) }); ok {
		f.Forget(id)
	}
}
