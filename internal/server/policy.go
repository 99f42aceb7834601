package server

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/principal"
)

// The temporal policy's routes: rule sets per scope, approvals and the
// proposals made of denied destinations (internal/policy).

// approvalsWriteTimeout bounds one line of a followed approvals stream.
const approvalsWriteTimeout = 30 * time.Second

// caller is the request's principal; a request without one (no keys yet)
// is the server's own.
func caller(ctx context.Context) principal.Principal {
	if p, ok := principal.From(ctx); ok {
		return p
	}
	return principal.System
}

// CanSeeScope checks p may see the rule set of scope: server- and
// template-wide rules are the admin's; a tenant's its own; a sandbox's
// whoever sees the sandbox, which seesSandbox says (the single box from
// its manager, a cluster replica from the sandbox's row). What the caller
// may not see is not found.
func CanSeeScope(ctx context.Context, p principal.Principal, scope string, seesSandbox func(ctx context.Context, id string) error) error {
	kind, name, _ := strings.Cut(scope, ":")
	switch kind {
	case "server", "template":
		if !p.Admin() {
			return fmt.Errorf("rule sets of %s scope are administered with the admin scope: %w", kind, errdefs.ErrPermissionDenied)
		}
	case "tenant":
		if !p.Sees(name) {
			return fmt.Errorf("tenant %q: %w", name, errdefs.ErrNotFound)
		}
	case "sandbox":
		return seesSandbox(ctx, name)
	}
	return nil
}

// canScope is CanSeeScope for the request's caller, a sandbox's tenant
// read from the manager.
func (part policyAPI) canScope(ctx context.Context, scope string) error {
	p := caller(ctx)
	return CanSeeScope(ctx, p, scope, func(ctx context.Context, id string) error {
		sb, err := part.s.mgr.Get(ctx, id)
		if err != nil {
			return err
		}
		if !p.Sees(sb.Tenant) {
			return fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
		}
		return nil
	})
}

func (part policyAPI) listPolicyRules(w http.ResponseWriter, r *http.Request) {
	s := part.s
	out := api.PolicyRuleSetList{RuleSets: []api.PolicyRuleSet{}}
	for _, rs := range s.policy.ListRules() {
		if (policyAPI{s}).canScope(r.Context(), rs.Scope) == nil {
			out.RuleSets = append(out.RuleSets, rs)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// policyScope is the {scope} of the path, checked and visible.
func (part policyAPI) policyScope(r *http.Request) (string, error) {
	s := part.s
	scope := r.PathValue("scope")
	if err := policy.ValidScope(scope); err != nil {
		return "", err
	}
	return scope, (policyAPI{s}).canScope(r.Context(), scope)
}

func (part policyAPI) getPolicyRules(w http.ResponseWriter, r *http.Request) {
	s := part.s
	scope, err := (policyAPI{s}).policyScope(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	rs, err := s.policy.Rules(scope)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rs)
}

func (part policyAPI) putPolicyRules(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var rs api.PolicyRuleSet
	if err := decodeJSON(w, r, &rs); err != nil {
		writeError(w, r, err)
		return
	}
	scope, err := (policyAPI{s}).policyScope(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	out, err := s.policy.SetRules(r.Context(), scope, rs)
	if err != nil {
		writeError(w, r, err)
		return
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindPolicy, Action: "set", Target: scope, Result: "ok",
		Detail: map[string]any{"rules": len(out.Rules)}})
	s.decisionScopeChanged() // the gateway now asks about these sandboxes' connections
	writeJSON(w, http.StatusOK, out)
}

func (part policyAPI) deletePolicyRules(w http.ResponseWriter, r *http.Request) {
	s := part.s
	scope, err := (policyAPI{s}).policyScope(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if err := s.policy.DeleteRules(r.Context(), scope); err != nil {
		writeError(w, r, err)
		return
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindPolicy, Action: "remove", Target: scope, Result: "ok"})
	s.decisionScopeChanged()
	w.WriteHeader(http.StatusNoContent)
}

// listApprovals answers GET /v1/approvals[?state=…&sandbox=…&follow=true]:
// a list (with the proposals made of denied destinations, unless a state
// other than pending is asked for), or with follow an NDJSON stream of the
// matching approvals now and then of each one created or changed.
func (part policyAPI) listApprovals(w http.ResponseWriter, r *http.Request) {
	s := part.s
	q := r.URL.Query()
	state, sandboxID := q.Get("state"), q.Get("sandbox")
	follow, err := parseBool(q.Get("follow"), "follow")
	if err != nil {
		writeError(w, r, err)
		return
	}
	p := caller(r.Context())
	keep := func(ap api.Approval) bool {
		return p.Sees(ap.Tenant) && (sandboxID == "" || ap.Sandbox == sandboxID) && (state == "" || ap.State == state)
	}
	list, err := s.policy.Approvals(r.Context(), state, keep)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if !follow {
		out := api.ApprovalList{Approvals: list}
		if out.Approvals == nil {
			out.Approvals = []api.Approval{}
		}
		if state == "" || state == api.ApprovalPending {
			if out.Proposals, err = (policyAPI{s}).proposals(r.Context(), sandboxID); err != nil {
				writeError(w, r, err)
				return
			}
		}
		writeJSON(w, http.StatusOK, out)
		return
	}
	var nd *ndjsonWriter
	err = s.policy.FollowApprovals(r.Context(), func() error {
		// Listed again once subscribed, so no change falls in between.
		list, err := s.policy.Approvals(r.Context(), state, keep)
		if err != nil {
			return err
		}
		nd = newNDJSON(w, approvalsWriteTimeout)
		for _, ap := range list {
			if err := nd.Send(ap); err != nil {
				return err
			}
		}
		return nil
	}, func(ap api.Approval) error {
		if !keep(ap) {
			return nil
		}
		return nd.Send(ap)
	})
	if nd == nil {
		if err != nil {
			writeError(w, r, err)
		}
		return
	}
	nd.Close()
}

// proposalPrefix starts the id of a proposal: "prop:<sandbox>:<name>".
const proposalPrefix = "prop:"

// proposals counts, per visible sandbox (or the one asked for), the names
// its network policy refused that its allow_out does not list.
func (part policyAPI) proposals(ctx context.Context, sandboxID string) ([]api.Proposal, error) {
	s := part.s
	var sbs []api.Sandbox
	if sandboxID != "" {
		sb, err := s.mgr.Get(ctx, sandboxID)
		if err != nil {
			return nil, err
		}
		sbs = []api.Sandbox{sb}
	} else {
		var err error
		if sbs, err = s.mgr.List(ctx, "", nil); err != nil {
			return nil, err
		}
	}
	p := caller(ctx)
	var out []api.Proposal
	for _, sb := range sbs {
		if !p.Sees(sb.Tenant) {
			if sandboxID != "" {
				return nil, fmt.Errorf("sandbox %s: %w", sandboxID, errdefs.ErrNotFound)
			}
			continue
		}
		props, err := (policyAPI{s}).sandboxProposals(ctx, sb)
		if err != nil {
			return nil, err
		}
		out = append(out, props...)
	}
	return out, nil
}

func (part policyAPI) sandboxProposals(ctx context.Context, sb api.Sandbox) ([]api.Proposal, error) {
	s := part.s
	byName := map[string]*api.Proposal{}
	var order []string
	err := s.mgr.Networking().NetworkEvents(ctx, sb.ID, 0, false, func(ev api.NetworkEvent) error {
		if ev.Verdict != api.VerdictDeny || ev.Name == "" || strings.ContainsAny(ev.Name, ": /") {
			return nil
		}
		name := strings.TrimSuffix(strings.ToLower(ev.Name), ".")
		if sb.Network != nil && slices.Contains(sb.Network.AllowOut, name) {
			return nil
		}
		pr := byName[name]
		if pr == nil {
			pr = &api.Proposal{ID: proposalPrefix + sb.ID + ":" + name, Sandbox: sb.ID, Name: name}
			byName[name] = pr
			order = append(order, name)
		}
		pr.Count++
		if ev.Time.After(pr.LastAt) {
			pr.LastAt = ev.Time
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	out := make([]api.Proposal, 0, len(order))
	for _, n := range order {
		out = append(out, *byName[n])
	}
	return out, nil
}

func (part policyAPI) approveApproval(w http.ResponseWriter, r *http.Request) {
	s := part.s
	(policyAPI{s}).answerApproval(w, r, true)
}
func (part policyAPI) denyApproval(w http.ResponseWriter, r *http.Request) {
	part.answerApproval(w, r, false)
}

func (part policyAPI) answerApproval(w http.ResponseWriter, r *http.Request, approve bool) {
	s := part.s
	var ans api.ApprovalAnswer
	if r.ContentLength != 0 {
		if err := decodeJSON(w, r, &ans); err != nil {
			writeError(w, r, err)
			return
		}
	}
	id := r.PathValue("id")
	if strings.HasPrefix(id, proposalPrefix) {
		(policyAPI{s}).answerProposal(w, r, id, approve)
		return
	}
	ap, err := s.policy.Approval(r.Context(), id)
	if err == nil && !caller(r.Context()).Sees(ap.Tenant) {
		err = fmt.Errorf("approval %q: %w", id, errdefs.ErrNotFound)
	}
	if err == nil {
		ap, err = s.policy.Answer(r.Context(), id, approve, ans.Reason)
	}
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, ap)
}

// answerProposal adds a refused name to its sandbox's allow_out, within
// the tenant's boundary (checkBoundary). A proposal is not denied: the
// destination simply stays refused.
func (part policyAPI) answerProposal(w http.ResponseWriter, r *http.Request, id string, approve bool) {
	s := part.s
	sbID, name, ok := strings.Cut(strings.TrimPrefix(id, proposalPrefix), ":")
	if !ok || sbID == "" || name == "" {
		writeError(w, r, fmt.Errorf("proposal id must be prop:<sandbox>:<name>, got %q: %w", id, errdefs.ErrInvalidArgument))
		return
	}
	if !approve {
		writeError(w, r, fmt.Errorf("a proposal cannot be denied: its destination stays refused unless it is approved: %w", errdefs.ErrInvalidArgument))
		return
	}
	ctx := r.Context()
	props, err := (policyAPI{s}).proposals(ctx, sbID)
	if err != nil {
		writeError(w, r, err)
		return
	}
	i := slices.IndexFunc(props, func(p api.Proposal) bool { return p.Name == name })
	if i < 0 {
		writeError(w, r, fmt.Errorf("sandbox %s has no refused destination %q to allow: %w", sbID, name, errdefs.ErrNotFound))
		return
	}
	sb, err := s.mgr.Get(ctx, sbID)
	if err != nil {
		writeError(w, r, err)
		return
	}
	var pol api.NetworkPolicy
	if sb.Network != nil {
		pol = *sb.Network
		pol.AllowOut = slices.Clone(pol.AllowOut)
	}
	pol.AllowOut = append(pol.AllowOut, name)
	if s.checkBoundary != nil {
		if err := s.checkBoundary(ctx, sbID, pol); err != nil {
			writeError(w, r, err)
			return
		}
	}
	if _, err := s.mgr.Networking().SetNetwork(ctx, sbID, pol); err != nil {
		writeError(w, r, err)
		return
	}
	now := time.Now().UTC()
	out := api.Approval{ID: id, Sandbox: sbID, Tenant: sb.Tenant, Action: api.PolicyAction{Kind: actions.DNS, Name: name, Sandbox: sbID},
		Rule: "network-policy", Reason: fmt.Sprintf("refused %d times by the network policy", props[i].Count), State: api.ApprovalApproved,
		CreatedAt: props[i].LastAt, ExpiresAt: now, AnsweredAt: &now, AnsweredBy: caller(ctx).KeyID, AnswerReason: "added to allow_out"}
	s.audit.Record(ctx, audit.Event{Kind: audit.KindApproval, Action: "approve", Sandbox: sbID, Target: id, Result: "allow_out += " + name})
	writeJSON(w, http.StatusOK, out)
}
