// Package actions names what a sandbox (or a caller acting on one) does, as
// the platform sees it — an exec start, a files API call, a DNS query, a
// connection, an intercepted HTTP request, a secret use, a port exposure, a
// lifecycle verb — and the verdict a policy gives it.
//
// It is a leaf package so that every layer that sees actions (the sandbox
// manager, the server, the gateway process) can ask one Decider without
// importing the policy engine.
package actions

import (
	"context"
	"time"
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

// Action is one thing that is about to happen to or in a sandbox.
type Action struct {
	Kind     string    `json:"kind"`
	Time     time.Time `json:"time"`
	Sandbox  string    `json:"sandbox,omitempty"`
	Tenant   string    `json:"tenant,omitempty"`
	Template string    `json:"template,omitempty"`

	Argv []string `json:"argv,omitempty"`
	User string   `json:"user,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	// Path is a file path (files API) or an HTTP request path.
	Path   string `json:"path,omitempty"`
	Name   string `json:"name,omitempty"`
	IP     string `json:"ip,omitempty"`
	Port   int    `json:"port,omitempty"`
	SNI    string `json:"sni,omitempty"`
	Method string `json:"method,omitempty"`
	Secret string `json:"secret,omitempty"`
	Verb   string `json:"verb,omitempty"`
	// Exe is the executable that opened a connection, as the host saw it
	// without trusting the sandbox; empty where the host cannot see it.
	Exe string `json:"exe,omitempty"`
}

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
