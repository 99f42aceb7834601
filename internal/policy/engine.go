// Package policy is the temporal policy layer of the trust layer: rule sets
// in CEL attached to the server, a tenant, a template or a sandbox, decided
// on every action the platform sees (exec starts, files API calls, DNS
// queries and connections through the gateway, port exposures, lifecycle
// verbs) against the sandbox's action history, with approvals for the
// rules that say "ask".
//
// The Engine is an actions.Decider. It only narrows: the network policy,
// the tenant boundary and the caller's scopes still apply underneath.
package policy

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
)

// DefaultApprovalTimeout is how long an "ask" waits for an answer before
// it is denied.
const DefaultApprovalTimeout = 5 * time.Minute

// Config configures an Engine.
type Config struct {
	DB              *sql.DB       // the server's SQLite; tables policy_*
	ApprovalTimeout time.Duration // default DefaultApprovalTimeout
	Audit           audit.Sink    // approval events; nil discards
	Logger          *slog.Logger
	// HistoryLen bounds each sandbox's history (default DefaultHistoryLen).
	HistoryLen int
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Engine decides actions against the attached rule sets and the
// sandboxes' histories, and keeps the approvals.
type Engine struct {
	cfg Config

	mu   sync.RWMutex
	sets map[string]*RuleSet // scope → compiled rule set

	hmu  sync.Mutex
	hist map[string]*sandboxHistory

	amu     sync.Mutex
	waiting map[string]chan api.Approval // pending approval id → its answer
	subs    map[chan api.Approval]struct{}
}

var _ actions.Decider = (*Engine)(nil)

type sandboxHistory struct {
	mu sync.Mutex // serialises the decisions of one sandbox, so counts are exact
	h  *History
}

const schema = `
CREATE TABLE IF NOT EXISTS policy_rules (scope TEXT PRIMARY KEY, body TEXT NOT NULL, updated_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS policy_approvals (id TEXT PRIMARY KEY, sandbox TEXT NOT NULL, tenant TEXT NOT NULL,
  state TEXT NOT NULL, created_at TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS policy_approvals_state ON policy_approvals(state, created_at);
`

// New opens the engine: creates its tables, compiles the stored rule sets,
// and expires the approvals a previous server process left pending (their
// actions were refused when that process ended).
func New(ctx context.Context, cfg Config) (*Engine, error) {
	if cfg.ApprovalTimeout <= 0 {
		cfg.ApprovalTimeout = DefaultApprovalTimeout
	}
	if cfg.Audit == nil {
		cfg.Audit = audit.Nop{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	e := &Engine{cfg: cfg, sets: map[string]*RuleSet{}, hist: map[string]*sandboxHistory{},
		waiting: map[string]chan api.Approval{}, subs: map[chan api.Approval]struct{}{}}
	if _, err := cfg.DB.ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("policy tables: %w", err)
	}
	rows, err := cfg.DB.QueryContext(ctx, `SELECT scope, body FROM policy_rules`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var scope, body string
		if err := rows.Scan(&scope, &body); err != nil {
			return nil, err
		}
		var src api.PolicyRuleSet
		if err := json.Unmarshal([]byte(body), &src); err != nil {
			return nil, fmt.Errorf("stored rule set %s: %w", scope, err)
		}
		rs, err := Compile(src)
		if err != nil {
			// A rule set stored by an older version that no longer
			// compiles must not silently stop applying: deny everything
			// in its scope until it is replaced.
			cfg.Logger.Error("stored policy rule set does not compile; its scope denies every action until it is replaced", "scope", scope, "err", err)
			rs = &RuleSet{Src: src, Rules: []Rule{}}
			rs.Rules = append(rs.Rules, brokenRule(scope, err))
		}
		rs.Scope = scope
		e.sets[scope] = rs
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if err := e.expireLeftovers(ctx); err != nil {
		return nil, err
	}
	return e, nil
}

func brokenRule(scope string, err error) Rule {
	c, _ := Compile(api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "broken-rule-set", Match: "true", Verdict: "deny",
		Reason: "the rule set of " + scope + " no longer compiles (" + err.Error() + "); replace it"}}})
	return c.Rules[0]
}

// ValidScope checks a scope: "server", "tenant:NAME", "template:REF" or
// "sandbox:ID".
func ValidScope(s string) error {
	if s == "server" {
		return nil
	}
	kind, name, ok := strings.Cut(s, ":")
	if !ok || (kind != "tenant" && kind != "template" && kind != "sandbox") {
		return fmt.Errorf("scope must be server, tenant:NAME, template:REF or sandbox:ID, got %q: %w", trunc(s), errdefs.ErrInvalidArgument)
	}
	if name == "" || len(name) > 256 || strings.ContainsFunc(name, func(c rune) bool { return c <= 0x20 || c == 0x7f }) {
		return fmt.Errorf("scope %q: the %s must be 1-256 bytes without spaces or control characters: %w", trunc(s), kind, errdefs.ErrInvalidArgument)
	}
	return nil
}

func trunc(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// SetRules compiles rs and attaches it to scope, replacing what was there;
// the next action decided sees it.
func (e *Engine) SetRules(ctx context.Context, scope string, rs api.PolicyRuleSet) (api.PolicyRuleSet, error) {
	if err := ValidScope(scope); err != nil {
		return api.PolicyRuleSet{}, err
	}
	if rs.Scope != "" && rs.Scope != scope {
		return api.PolicyRuleSet{}, fmt.Errorf("body's scope %q differs from the path's %q: %w", trunc(rs.Scope), scope, errdefs.ErrInvalidArgument)
	}
	if rs.Rules == nil {
		rs.Rules = []api.PolicyRule{}
	}
	now := e.cfg.Now().UTC()
	rs.Scope, rs.UpdatedAt = scope, &now
	c, err := Compile(rs)
	if err != nil {
		return api.PolicyRuleSet{}, err
	}
	c.Scope = scope
	body, _ := json.Marshal(rs)
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := e.cfg.DB.ExecContext(ctx, `INSERT INTO policy_rules(scope, body, updated_at) VALUES(?,?,?)
		ON CONFLICT(scope) DO UPDATE SET body=excluded.body, updated_at=excluded.updated_at`, scope, string(body), now.Format(time.RFC3339Nano)); err != nil {
		return api.PolicyRuleSet{}, err
	}
	e.sets[scope] = c
	return rs, nil
}

// Rules returns the rule set of scope (ErrNotFound if none).
func (e *Engine) Rules(scope string) (api.PolicyRuleSet, error) {
	if err := ValidScope(scope); err != nil {
		return api.PolicyRuleSet{}, err
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	rs, ok := e.sets[scope]
	if !ok {
		return api.PolicyRuleSet{}, fmt.Errorf("no rule set is attached to %s: %w", scope, errdefs.ErrNotFound)
	}
	return rs.Src, nil
}

// ListRules returns every attached rule set, by scope.
func (e *Engine) ListRules() []api.PolicyRuleSet {
	e.mu.RLock()
	defer e.mu.RUnlock()
	out := make([]api.PolicyRuleSet, 0, len(e.sets))
	for _, rs := range e.sets {
		out = append(out, rs.Src)
	}
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j].Scope < out[i].Scope {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

// DeleteRules detaches the rule set of scope.
func (e *Engine) DeleteRules(ctx context.Context, scope string) error {
	if err := ValidScope(scope); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.sets[scope]; !ok {
		return fmt.Errorf("no rule set is attached to %s: %w", scope, errdefs.ErrNotFound)
	}
	if _, err := e.cfg.DB.ExecContext(ctx, `DELETE FROM policy_rules WHERE scope=?`, scope); err != nil {
		return err
	}
	delete(e.sets, scope)
	return nil
}

// setsFor returns the rule sets that apply to a, broadest first.
func (e *Engine) setsFor(a *actions.Action) []*RuleSet {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if len(e.sets) == 0 {
		return nil
	}
	var out []*RuleSet
	for _, sc := range []string{"server", "tenant:" + a.Tenant, "template:" + a.Template, "sandbox:" + a.Sandbox} {
		if strings.HasSuffix(sc, ":") {
			continue
		}
		if rs, ok := e.sets[sc]; ok {
			out = append(out, rs)
		}
	}
	return out
}

func (e *Engine) history(id string) *sandboxHistory {
	e.hmu.Lock()
	defer e.hmu.Unlock()
	h := e.hist[id]
	if h == nil {
		h = &sandboxHistory{h: NewHistory(e.cfg.HistoryLen)}
		e.hist[id] = h
	}
	return h
}

// Forget drops a deleted sandbox's history.
func (e *Engine) Forget(sandbox string) {
	e.hmu.Lock()
	delete(e.hist, sandbox)
	e.hmu.Unlock()
}

// Decide decides a (an actions.Decider): the rule sets of the server, the
// action's tenant, template and sandbox are evaluated on it with the
// sandbox's history; "ask" blocks until the approval is answered, expires
// or ctx ends. Every decided action joins the history with its verdict.
func (e *Engine) Decide(ctx context.Context, a actions.Action) actions.Decision {
	if a.Time.IsZero() {
		a.Time = e.cfg.Now()
	}
	if a.Tenant == "" {
		a.Tenant = principal.DefaultTenant
	}
	sets := e.setsFor(&a)
	if a.Sandbox == "" {
		// Nothing to remember it in (a create): rules see an empty history.
		r := Evaluate(ctx, sets, a, NewHistory(1), a.Time)
		if r.Verdict == actions.Ask {
			return e.ask(ctx, a, r)
		}
		return actions.Decision{Verdict: r.Verdict, Reason: r.Reason, Rule: r.Rule}
	}
	sh := e.history(a.Sandbox)
	sh.mu.Lock()
	r := Evaluate(ctx, sets, a, sh.h, a.Time)
	if r.Verdict != actions.Ask {
		sh.h.Append(a, r.Verdict)
		sh.mu.Unlock()
		return actions.Decision{Verdict: r.Verdict, Reason: r.Reason, Rule: r.Rule}
	}
	sh.mu.Unlock()
	d := e.ask(ctx, a, r)
	sh.mu.Lock()
	sh.h.Append(a, d.Verdict)
	sh.mu.Unlock()
	return d
}

func newApprovalID() string {
	var b [10]byte
	rand.Read(b[:])
	return "apr_" + hex.EncodeToString(b[:])
}

// AppliesTo reports whether any rule set applies to a sandbox of tenant
// created from template: the gateway asks about a sandbox's connections
// only when one does.
func (e *Engine) AppliesTo(tenant, template, sandbox string) bool {
	if tenant == "" {
		tenant = principal.DefaultTenant
	}
	return len(e.setsFor(&actions.Action{Tenant: tenant, Template: template, Sandbox: sandbox})) > 0
}
