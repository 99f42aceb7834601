package bench

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/store"
)

// policyRules is 100 rules of the shapes the issue names: exec argv
// matches, path rules, "after a read under X, egress only to Y" (seen),
// "at most N POSTs per minute to Z" (count) and asks that do not match.
func policyRules() api.PolicyRuleSet {
	var rs api.PolicyRuleSet
	add := func(name, match, verdict string) {
		rs.Rules = append(rs.Rules, api.PolicyRule{Name: name, Match: match, Verdict: verdict})
	}
	for i := range 30 {
		add(fmt.Sprintf("tool%d", i), fmt.Sprintf(`action.kind == "exec" && action.argv[0] == "tool%d"`, i), "deny")
	}
	for i := range 20 {
		add(fmt.Sprintf("path%d", i), fmt.Sprintf(`action.kind == "file.read" && under(action.path, "/data/p%d")`, i), "deny")
	}
	for i := range 20 {
		add(fmt.Sprintf("pii%d", i), fmt.Sprintf(`action.kind in ["dns", "connect", "http"] && seen("file.read", "/data/pii%d") && action.name != "api.internal"`, i), "deny")
	}
	for i := range 20 {
		add(fmt.Sprintf("rate%d", i), fmt.Sprintf(`action.kind == "http" && action.method == "POST" && action.name == "api%d.example.com" && count("http", duration("1m"), {"method": "POST", "name": "api%d.example.com"}) >= 1000`, i, i), "deny")
	}
	for i := range 10 {
		add(fmt.Sprintf("ask%d", i), fmt.Sprintf(`action.kind == "exec" && action.argv[0].matches("(^|/)(curl%d|wget%d)$")`, i, i), "ask")
	}
	return rs
}

// BenchmarkPolicyEvaluation: one Decide per action (all applicable rule
// sets evaluated, the history appended) with 100 rules and a history of
// 10k actions, over a mix of execs, file reads, DNS queries and POSTs.
// Also the pure evaluation of one worst-case rule that scans the whole
// history (history.exists), which the helpers are there to avoid.
func BenchmarkPolicyEvaluation(b *testing.B) {
	db, err := store.Open(filepath.Join(b.TempDir(), "space.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	e, err := policy.New(ctx, policy.Config{DB: db.SQL()})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := e.SetRules(ctx, "server", policyRules()); err != nil {
		b.Fatal(err)
	}
	t0 := time.Now().Add(-3 * time.Hour)
	mix := func(i int) actions.Action {
		a := actions.Action{Sandbox: "sb_bench", Time: t0.Add(time.Duration(i) * time.Second)}
		switch i % 4 {
		case 0:
			a.Kind, a.Argv = actions.Exec, []string{"python3", "-c", "pass"}
		case 1:
			a.Kind, a.Path = actions.FileRead, fmt.Sprintf("/work/f%d.txt", i%100)
		case 2:
			a.Kind, a.Name = actions.DNS, fmt.Sprintf("host%d.example.com", i%50)
		case 3:
			a.Kind, a.Method, a.Name, a.Path = actions.HTTP, "POST", fmt.Sprintf("api%d.example.com", i%20), "/v1/x"
		}
		return a
	}
	for i := range policy.DefaultHistoryLen {
		e.Decide(ctx, mix(i))
	}
	const n = 4000
	var s samples
	for i := range n {
		a := mix(policy.DefaultHistoryLen + i)
		start := time.Now()
		d := e.Decide(ctx, a)
		s = append(s, time.Since(start))
		if !d.Allowed() {
			b.Fatalf("%+v: %+v", a, d)
		}
	}
	report(b, "policy_decide_100rules_10k", s)

	scan, err := policy.Compile(api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "scan", Match: `history.exists(h, h.path == "/never")`, Verdict: "deny"}}})
	if err != nil {
		b.Fatal(err)
	}
	h := policy.NewHistory(0)
	for i := range policy.DefaultHistoryLen {
		h.Append(mix(i), actions.Allow)
	}
	var ss samples
	for i := range 50 {
		start := time.Now()
		r := policy.Evaluate(ctx, []*policy.RuleSet{scan}, actions.Action{Kind: actions.Exec}, h, t0.Add(time.Duration(i)))
		ss = append(ss, time.Since(start))
		if r.Verdict != actions.Allow {
			b.Fatalf("scan rule: %+v", r)
		}
	}
	report(b, "policy_full_history_scan_rule", ss)
}
