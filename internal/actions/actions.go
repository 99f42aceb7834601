// Package actions names what a sandbox (or a caller acting on one) does, as
// the platform sees it — an exec start, a files API call, a DNS query, a
// connection, an intercepted HTTP request, a secret use, a port exposure, a
// lifecycle verb — and the verdict a policy gives it.
//
// It imports only the api package (the wire types, itself a leaf) so that
// every layer that sees actions (the sandbox manager, the server, the
// gateway process) can ask one Decider without importing the policy engine.
package actions

import (
	"context"

	"github.com/spacehq/space/api"
)

// Kinds of action.
const (
	Exec       = "exec"        // Argv, User, Cwd
	FileRead   = "file.read"   // Path
	FileWrite  = "file.write"  // Path
	FileDelete = "file.delete" // Path
	DNS        = "dns"         // Name
	Connect    = "connect"     // Name (if proven), IP, Port, SNI
	HTTP       = "http"        // Name, Method, Path (intercepted hosts only)
	SecretUse  = "secret"      // Secret, Name
	Port       = "port"        // Port
	Lifecycle  = "lifecycle"   // Verb
)

// Action is one thing that is about to happen to or in a sandbox. It is
// api.PolicyAction, the one action type: deciders get it, the policy
// engine's rules and history see it (with its verdict), approvals, `space
// policy test` and the gateway's decision stream carry it. The alias keeps
// this package the vocabulary every layer speaks.
type Action = api.PolicyAction

// Verdict is a policy's answer.
type Verdict string

// Verdicts.
const (
	Allow Verdict = "allow"
	Deny  Verdict = "deny"
	Ask   Verdict = "ask"
)

// Decision is the final answer for one action: Allow or Deny (an Ask is
// resolved — approved, denied or timed out — before a Decider returns).
type Decision struct {
	Verdict Verdict `json:"verdict"`
	Reason  string  `json:"reason,omitempty"` // shown to the caller on deny
	Rule    string  `json:"rule,omitempty"`   // the rule that decided, if any
	// Approval is the id of the approval an Ask waited on, if any.
	Approval string `json:"approval,omitempty"`
}

// Allowed reports whether d lets the action proceed.
func (d Decision) Allowed() bool { return d.Verdict == Allow }

// Decider decides actions. Decide may block while an approval is pending
// (bounded by ctx and the approval timeout) and must be safe for
// concurrent use.
type Decider interface {
	Decide(ctx context.Context, a Action) Decision
}

// AllowAll allows everything: the Decider when no policy is configured.
type AllowAll struct{}

// Decide allows a.
func (AllowAll) Decide(context.Context, Action) Decision { return Decision{Verdict: Allow} }

var _ Decider = AllowAll{}
