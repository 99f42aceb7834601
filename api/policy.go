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

// PolicyAction is one thing that is about to happen to or in a sandbox, as
// the platform sees it — an exec start, a files API call, a DNS query, a
// connection, an intercepted HTTP request, a secret use, a port exposure or
// a lifecycle verb. It is the one action type: what deciders get
// (internal/actions.Action is this type), what the policy engine's rules see
// (the cel tags are the field names rules use: action.path, h.kind), what
// approvals, `space policy test` and the gateway's decision stream carry.
// Which fields a kind sets is listed with the kinds in internal/actions.
type PolicyAction struct {
	Kind     string    `json:"kind" cel:"kind"`
	Time     time.Time `json:"time" cel:"time"`
	Sandbox  string    `json:"sandbox,omitempty" cel:"sandbox"`
	Tenant   string    `json:"tenant,omitempty" cel:"tenant"`
	Template string    `json:"template,omitempty" cel:"template"`
	Argv     []string  `json:"argv,omitempty" cel:"argv"`
	User     string    `json:"user,omitempty" cel:"user"`
	Cwd      string    `json:"cwd,omitempty" cel:"cwd"`
	// Path is a file path (files API) or an HTTP request path.
	Path   string `json:"path,omitempty" cel:"path"`
	Name   string `json:"name,omitempty" cel:"name"`
	IP     string `json:"ip,omitempty" cel:"ip"`
	Port   int    `json:"port,omitempty" cel:"port"`
	SNI    string `json:"sni,omitempty" cel:"sni"`
	Method string `json:"method,omitempty" cel:"method"`
	Secret string `json:"secret,omitempty" cel:"secret"`
	Verb   string `json:"verb,omitempty" cel:"verb"`
	// Exe is the executable that opened a connection, as the host saw it
	// without trusting the sandbox; empty where the host cannot see it.
	Exe string `json:"exe,omitempty" cel:"exe"`
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
