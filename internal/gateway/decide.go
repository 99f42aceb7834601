package gateway

import (
	"context"
	"net/netip"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/spacehq/space/internal/actions"
)

// How the gateway asks the temporal policy (Options.Decider):
//
//   - only for what the network policy already allows: a DNS query of an
//     allowed name (actions.DNS) and a TCP connection after its name is
//     proven (actions.Connect). What the network policy refuses never
//     costs a decision;
//   - a deny is NXDOMAIN for DNS (indistinguishable from a name the network
//     policy does not allow) and a reset for TCP, with a "deny" event
//     carrying the decision's reason;
//   - an ask is the Decider blocking: a DNS query waits unanswered, a
//     connection waits accepted (the sandbox's connect has returned; its
//     first bytes are read, since they prove the name, and nothing is
//     relayed until the decision). Every connection and query has a
//     goroutine of its own (the TCP forwarder starts one per SYN, DNS one
//     per query), so one that waits holds up no other;
//   - a link whose sandbox no rule applies to (LinkOptions.Decide false,
//     the server says so at attach and on every rule change) never asks:
//     no round trip, no goroutine.

// maxDecisionWait is the gateway's own ceiling on one decision, a backstop
// for a Decider that never answers: the approval timeout is the server's
// and is normally much shorter. Detaching the link ends a wait at once.
const maxDecisionWait = 15 * time.Minute

// maxHeldDNS bounds one sandbox's DNS queries waiting for a decision at
// once: each holds a goroutine in the process every sandbox shares.
// Waiting connections count towards Limits.MaxConns instead.
const maxHeldDNS = 64

// ConnInfo is the connection an action is about, as the gateway saw it on
// the link: Src is the sandbox's end (its address and source port), Dst
// what the sandbox dialled (before a loopback alias is undone). With them
// the host can find the socket in the sandbox's own socket table.
type ConnInfo struct {
	Src netip.AddrPort `json:"src"`
	Dst netip.AddrPort `json:"dst"`
}

// ConnDecider is a Decider that is also told which connection an action is
// about. With the decision it returns the executable that opened the
// connection when the host could see it without trusting the sandbox, ""
// otherwise (it is put in the connection's event).
type ConnDecider interface {
	actions.Decider
	DecideConn(ctx context.Context, a actions.Action, c ConnInfo) (actions.Decision, string)
}

// LinkOptions are a link's settings beside its network policy.
type LinkOptions struct {
	// Decide makes the gateway ask Options.Decider about the sandbox's
	// DNS queries and connections. False is the fast path for a sandbox
	// no rule applies to.
	Decide bool
}

// SetDecide turns asking Options.Decider on or off for an attached
// sandbox (its rules changed). Decisions in progress are not affected.
func (g *Gateway) SetDecide(id string, on bool) error {
	l, err := g.link(id)
	if err != nil {
		return err
	}
	l.decideOn.Store(on)
	return nil
}

var allowed = actions.Decision{Verdict: actions.Allow}

// decide asks the Decider about a (ci: the connection it is about, if
// any), unless the link's sandbox has no rules. Anything but an explicit
// allow is a deny: a Decider that returns an unresolved ask or nothing
// fails closed.
func (l *link) decide(a actions.Action, ci *ConnInfo) (actions.Decision, string) {
	if !l.decideOn.Load() {
		return allowed, ""
	}
	a.Sandbox = l.id
	if a.Time.IsZero() {
		a.Time = time.Now().UTC()
	}
	ctx, cancel := context.WithTimeout(l.ctx, maxDecisionWait)
	defer cancel()
	var d actions.Decision
	exe := ""
	if cd, ok := l.g.opts.Decider.(ConnDecider); ok && ci != nil {
		d, exe = cd.DecideConn(ctx, a, *ci)
	} else {
		d = l.g.opts.Decider.Decide(ctx, a)
	}
	if d.Verdict != actions.Allow && d.Verdict != actions.Deny {
		why := "the policy decision did not resolve (verdict " + string(d.Verdict) + ")"
		if ctx.Err() != nil {
			why = "no policy decision in time"
		}
		d = actions.Decision{Verdict: actions.Deny, Reason: why, Rule: d.Rule, Approval: d.Approval}
	}
	return d, exe
}

// decideConnect asks about one accepted TCP connection of the sandbox
// (id: as the forwarder saw it; name: the proven name, "" if allowed by
// address; proto: "tls", "http" or "tcp"). A waiting connection counts
// towards the link's open connections.
func (l *link) decideConnect(id stack.TransportEndpointID, name, proto string, dst netip.Addr, port uint16) (actions.Decision, string) {
	if !l.decideOn.Load() {
		return allowed, ""
	}
	a := actions.Action{Kind: actions.Connect, Name: name, IP: dst.String(), Port: int(port)}
	if proto == "tls" {
		a.SNI = name
	}
	ci := &ConnInfo{
		Src: netip.AddrPortFrom(netip.AddrFrom4(id.RemoteAddress.As4()), id.RemotePort),
		Dst: netip.AddrPortFrom(netip.AddrFrom4(id.LocalAddress.As4()), id.LocalPort),
	}
	return l.decide(a, ci)
}

// decideDNS asks about a query of an allowed name; ok=false with a reason
// when too many of the sandbox's queries already wait.
func (l *link) decideDNS(name string) (d actions.Decision, limited bool) {
	if !l.decideOn.Load() {
		return allowed, false
	}
	if l.heldDNS.Add(1) > maxHeldDNS {
		l.heldDNS.Add(-1)
		return actions.Decision{}, true
	}
	defer l.heldDNS.Add(-1)
	d, _ = l.decide(actions.Action{Kind: actions.DNS, Name: name}, nil)
	return d, false
}

// deniedBy is the event reason of a decision that denied.
func deniedBy(d actions.Decision) string {
	why := "denied by policy"
	if d.Rule != "" {
		why += " (rule " + d.Rule + ")"
	}
	if d.Reason != "" {
		why += ": " + d.Reason
	}
	if d.Approval != "" {
		why += " [approval " + d.Approval + "]"
	}
	return why
}

// allowedBy appends what a rule that allowed adds to an event's reason.
func allowedBy(reason string, d actions.Decision) string {
	if d.Rule == "" && d.Approval == "" {
		return reason
	}
	reason += "; allowed by policy"
	if d.Rule != "" {
		reason += " (rule " + d.Rule + ")"
	}
	if d.Approval != "" {
		reason += " [approval " + d.Approval + "]"
	}
	return reason
}
