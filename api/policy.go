package api

import "time"

// VerdictAsk is the policy verdict that holds an action for an approval
// (rules may also give VerdictAllow and VerdictDeny).
const VerdictAsk = "ask"

// Approval states.
const (
	ApprovalPending  = "pending"
	ApprovalApproved = "approved"
	ApprovalDenied   = "denied"
	ApprovalExpired  = "expired"
)

// PolicyRule is one temporal policy rule: when Match (a CEL expression over
// action, history and now) is true, the rule gives Verdict.
type PolicyRule struct {
	Name    string `json:"name" yaml:"name"`
	Match   string `json:"match" yaml:"match"`
	Verdict string `json:"verdict" yaml:"verdict"` // allow | deny | ask
	Reason  string `json:"reason,omitempty" yaml:"reason,omitempty"`
}

// PolicyRuleSet is the rules attached to one scope: "server",
// "tenant:NAME", "template:REF" or "sandbox:ID" (PUT/GET/DELETE
// /v1/policy/rules/{scope}).
type PolicyRuleSet struct {
	Scope     string       `json:"scope,omitempty" yaml:"scope,omitempty"` // set by the server
	Rules     []PolicyRule `json:"rules" yaml:"rules"`
	UpdatedAt *time.Time   `json:"updated_at,omitempty" yaml:"updated_at,omitempty"`
}

// PolicyRuleSetList is GET /v1/policy/rules.
type PolicyRuleSetList struct {
	RuleSets []PolicyRuleSet `json:"rule_sets"`
}

// PolicyAction is an action as policies and approvals see it: an exec
// start, a files API call, a DNS query, a connection, an intercepted HTTP
// request, a secret use, a port exposure or a lifecycle verb.
type PolicyAction struct {
	Kind     string    `json:"kind"`
	Time     time.Time `json:"time"`
	Sandbox  string    `json:"sandbox,omitempty"`
	Tenant   string    `json:"tenant,omitempty"`
	Template string    `json:"template,omitempty"`
	Argv     []string  `json:"argv,omitempty"`
	User     string    `json:"user,omitempty"`
	Cwd      string    `json:"cwd,omitempty"`
	Path     string    `json:"path,omitempty"`
	Name     string    `json:"name,omitempty"`
	IP       string    `json:"ip,omitempty"`
	Port     int       `json:"port,omitempty"`
	SNI      string    `json:"sni,omitempty"`
	Method   string    `json:"method,omitempty"`
	Secret   string    `json:"secret,omitempty"`
	Verb     string    `json:"verb,omitempty"`
	Exe      string    `json:"exe,omitempty"`
}

// Approval is an action a rule said "ask" for, held until someone answers
// or it expires (which denies it).
type Approval struct {
	ID           string       `json:"id"`
	Sandbox      string       `json:"sandbox"`
	Tenant       string       `json:"tenant"`
	Action       PolicyAction `json:"action"`
	Rule         string       `json:"rule"`
	Reason       string       `json:"reason,omitempty"`
	State        string       `json:"state"` // pending | approved | denied | expired
	CreatedAt    time.Time    `json:"created_at"`
	ExpiresAt    time.Time    `json:"expires_at"`
	AnsweredAt   *time.Time   `json:"answered_at,omitempty"`
	AnsweredBy   string       `json:"answered_by,omitempty"` // key id of who answered ("" for the server itself)
	AnswerReason string       `json:"answer_reason,omitempty"`
}

// Proposal is a destination a sandbox's network policy refused: approving
// it (POST /v1/approvals/{id}/approve) adds Name to the sandbox's allow_out.
type Proposal struct {
	ID      string    `json:"id"` // "prop:<sandbox>:<name>"
	Sandbox string    `json:"sandbox"`
	Name    string    `json:"name"`
	Count   int       `json:"count"`
	LastAt  time.Time `json:"last_at"`
}

// ApprovalList is GET /v1/approvals.
type ApprovalList struct {
	Approvals []Approval `json:"approvals"`
	Proposals []Proposal `json:"proposals,omitempty"`
}

// ApprovalAnswer is the body of POST /v1/approvals/{id}/approve and …/deny
// (optional on both).
type ApprovalAnswer struct {
	Reason string `json:"reason,omitempty"`
}

// PolicyTestResult is one line of `space policy test`: the verdict the
// rule set gives an action given the actions before it as history.
type PolicyTestResult struct {
	Line    int          `json:"line"`
	Action  PolicyAction `json:"action"`
	Verdict string       `json:"verdict"`
	Rule    string       `json:"rule,omitempty"`
	Reason  string       `json:"reason,omitempty"`
}
