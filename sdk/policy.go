package sdk

import (
	"context"
	"net/http"
	"net/url"

	"github.com/spacehq/space/api"
)

// maxApprovalLine bounds one line of a followed approvals stream.
const maxApprovalLine = 256 << 10

// PolicyRules is GET /v1/policy/rules: every rule set the key may see.
func (c *Client) PolicyRules(ctx context.Context) ([]api.PolicyRuleSet, error) {
	var out api.PolicyRuleSetList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/policy/rules"}, &out); err != nil {
		return nil, err
	}
	return out.RuleSets, nil
}

// PolicyRuleSet is GET /v1/policy/rules/{scope} ("server", "tenant:NAME",
// "template:REF", "sandbox:ID").
func (c *Client) PolicyRuleSet(ctx context.Context, scope string) (*api.PolicyRuleSet, error) {
	if err := checkID("scope", scope); err != nil {
		return nil, err
	}
	var out api.PolicyRuleSet
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/policy/rules/" + seg(scope)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SetPolicyRuleSet is PUT /v1/policy/rules/{scope}: it replaces the
// scope's rule set; the next action decided sees it.
func (c *Client) SetPolicyRuleSet(ctx context.Context, scope string, rs api.PolicyRuleSet) (*api.PolicyRuleSet, error) {
	if err := checkID("scope", scope); err != nil {
		return nil, err
	}
	if rs.Rules == nil {
		rs.Rules = []api.PolicyRule{}
	}
	var out api.PolicyRuleSet
	if err := c.do(ctx, request{method: http.MethodPut, path: "/v1/policy/rules/" + seg(scope), json: rs}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// DeletePolicyRuleSet is DELETE /v1/policy/rules/{scope}.
func (c *Client) DeletePolicyRuleSet(ctx context.Context, scope string) error {
	if err := checkID("scope", scope); err != nil {
		return err
	}
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/policy/rules/" + seg(scope)}, nil)
}

// ApprovalsOptions filters GET /v1/approvals.
type ApprovalsOptions struct {
	State   string // pending | approved | denied | expired; "" = all
	Sandbox string
}

func (o ApprovalsOptions) query() url.Values {
	q := url.Values{}
	if o.State != "" {
		q.Set("state", o.State)
	}
	if o.Sandbox != "" {
		q.Set("sandbox", o.Sandbox)
	}
	return q
}

// Approvals is GET /v1/approvals: approvals oldest first and the
// destinations network policies refused (proposals).
func (c *Client) Approvals(ctx context.Context, o ApprovalsOptions) (*api.ApprovalList, error) {
	var out api.ApprovalList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/approvals", query: o.query()}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// FollowApprovals is GET /v1/approvals?follow=true: fn gets the matching
// approvals, then each one created or changed, until ctx ends (nil) or fn
// fails (its error).
func (c *Client) FollowApprovals(ctx context.Context, o ApprovalsOptions, fn func(api.Approval) error) error {
	q := o.query()
	q.Set("follow", "true")
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/v1/approvals", query: q})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return readNDJSON(ctx, resp.Body, ndjsonStream{what: "approvals", item: "approval", maxLine: maxApprovalLine}, fn)
}

// Approve is POST /v1/approvals/{id}/approve: the held action proceeds; a
// proposal id (prop:<sandbox>:<name>) adds the name to that sandbox's
// allow_out.
func (c *Client) Approve(ctx context.Context, id, reason string) (*api.Approval, error) {
	return c.answer(ctx, id, "approve", reason)
}

// Deny is POST /v1/approvals/{id}/deny: the held action is refused with
// reason.
func (c *Client) Deny(ctx context.Context, id, reason string) (*api.Approval, error) {
	return c.answer(ctx, id, "deny", reason)
}

func (c *Client) answer(ctx context.Context, id, verb, reason string) (*api.Approval, error) {
	if err := checkID("approval", id); err != nil {
		return nil, err
	}
	var out api.Approval
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/approvals/" + seg(id) + "/" + verb, json: api.ApprovalAnswer{Reason: reason}}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
