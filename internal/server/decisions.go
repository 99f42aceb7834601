package server

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/gateway"
	"github.com/spacehq/space/internal/gateway/gwctl"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
)

// The gateway's questions (DNS queries and connections of sandboxes, see
// internal/gateway/decide.go) are answered here, by the server's Decider,
// over the decisions stream the server keeps open (gwctl.RunDecisions).
// Before deciding, the server completes the action with what only it
// knows: the sandbox's tenant and template, and for a connection of a
// sandbox whose runtime lets the host see it (native), the executable that
// opened it (Manager.SocketOwner) — never anything the sandbox says.

// ScopedDecider is a Decider that can tell which sandboxes it has rules
// for. The gateway asks about a sandbox only when its Decider applies to
// it, so a sandbox without rules pays no round trip per connection. A
// Decider without the method applies to every sandbox; AllowAll to none.
// When its answer may have changed (rules added, removed, attached to a
// tenant or template), call Server.decisionScopeChanged.
type ScopedDecider interface {
	actions.Decider
	Applies(sandbox string) bool
}

// deciderRef is the server's Decider, swappable: the policy engine may be
// built after the gateway started (s.decider.set(d), then
// s.decisionScopeChanged()).
type deciderRef struct {
	p atomic.Pointer[actions.Decider]
}

func newDeciderRef(d actions.Decider) *deciderRef {
	r := &deciderRef{}
	r.set(d)
	return r
}

func (r *deciderRef) set(d actions.Decider) {
	if d == nil {
		d = actions.AllowAll{}
	}
	r.p.Store(&d)
}

func (r *deciderRef) get() actions.Decider { return *r.p.Load() }

// applies reports whether the gateway must ask about sandbox id.
func (r *deciderRef) applies(id string) bool {
	switch d := r.get().(type) {
	case actions.AllowAll:
		return false
	case ScopedDecider:
		return d.Applies(id)
	}
	return true
}

// decisionScopeChanged re-tells the gateway, for every sandbox it serves,
// whether the Decider applies to it (ScopedDecider). Call it after rules
// change.
func (s *Server) decisionScopeChanged() {
	if n, ok := s.netw.(*gatewayNetwork); ok {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		n.refreshScope(ctx)
	}
}

// decideFor answers the gateway's questions with dec.
func decideFor(dec *deciderRef, mgr *sandbox.Manager) gwctl.DecideFunc {
	return func(ctx context.Context, a actions.Action, c *gateway.ConnInfo) (actions.Decision, string) {
		a.Exe, a.Tenant, a.Template = "", "", "" // the server's to fill
		if sb, err := mgr.Get(ctx, a.Sandbox); err == nil {
			a.Tenant, a.Template = sb.Tenant, sb.Template
		}
		if a.Tenant == "" {
			a.Tenant = principal.DefaultTenant
		}
		if a.Kind == actions.Connect && c != nil && c.Src.IsValid() && c.Dst.IsValid() {
			a.Exe = mgr.Networking().SocketOwner(ctx, a.Sandbox, c.Src, c.Dst)
		}
		return dec.get().Decide(ctx, a), a.Exe
	}
}

// policyDecider is the policy engine as the gateway's Decider: it applies
// to a sandbox when a rule set of the server, its tenant, its template or
// itself exists.
type policyDecider struct {
	eng *policy.Engine
	srv *Server // its manager is set after the gateway starts
}

var _ ScopedDecider = policyDecider{}

func (p policyDecider) Decide(ctx context.Context, a actions.Action) actions.Decision {
	return p.eng.Decide(ctx, a)
}

func (p policyDecider) Applies(id string) bool {
	if p.srv.mgr == nil {
		return true // not known yet: ask (fail closed)
	}
	sb, err := p.srv.mgr.Get(context.Background(), id)
	if err != nil {
		return true
	}
	return p.eng.AppliesTo(sb.Tenant, sb.Template, id)
}

// SetDecider makes d the Decider of the gateway's questions (DNS queries
// and connections) in place of the policy engine, until restore is called.
// For tests that drive the gateway's decisions with a Decider of their own
// on a shared server; execs and files calls keep the policy engine.
func (s *Server) SetDecider(d actions.Decider) (restore func()) {
	old := s.decider.get()
	s.decider.set(d)
	s.decisionScopeChanged()
	return func() {
		s.decider.set(old)
		s.decisionScopeChanged()
	}
}
