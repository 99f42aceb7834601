// Package audit is the tamper-evident record of what callers and sandboxes
// did. Producers (the API, the sandbox manager, the gateway's verdicts, the
// secret broker, the policy engine) hand Events to a Sink; the log behind it
// chains and signs them.
package audit

import "context"

// Kinds of event.
const (
	KindAPI       = "api"       // one API call: route, target, status
	KindLifecycle = "lifecycle" // a lifecycle operation's end
	KindCommand   = "command"   // command start and exit
	KindFiles     = "files"     // a files API change
	KindNetwork   = "network"   // a network verdict
	KindSecret    = "secret"    // a secret's use, grant, rotation, revocation
	KindPolicy    = "policy"    // a policy decision
	KindApproval  = "approval"  // an approval asked, answered, timed out
	KindKey       = "key"       // API key and tenant administration
)

// Event is one thing to record. KeyID and Tenant are taken from the
// context's principal when empty. Never put a secret's value in an Event.
type Event struct {
	Kind    string         `json:"kind"`
	Action  string         `json:"action"`            // e.g. "POST /v1/sandboxes", "start", "exit", "write", "deny"
	Sandbox string         `json:"sandbox,omitempty"` // the sandbox concerned, if any
	Target  string         `json:"target,omitempty"`  // what was acted on (path, name:port, template, key id…)
	Result  string         `json:"result,omitempty"`  // "ok", an HTTP status, an exit code, "denied: reason"…
	KeyID   string         `json:"key_id,omitempty"`
	Tenant  string         `json:"tenant,omitempty"`
	Detail  map[string]any `json:"detail,omitempty"`
}

// Sink receives events. Record must not block for long and is safe for
// concurrent use; a sink that cannot persist an event logs the failure.
type Sink interface {
	Record(ctx context.Context, e Event)
}

// Nop discards events.
type Nop struct{}

// Record discards e.
func (Nop) Record(context.Context, Event) {}

var _ Sink = Nop{}
