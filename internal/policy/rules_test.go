package policy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
)

// The three examples, as rules.
const (
	piiRule  = `action.kind in ["dns", "connect", "http"] && seen("file.read", "/data/pii") && action.name != "api.internal"`
	postRule = `action.kind == "http" && action.method == "POST" && action.name == "api.example.com" &&
  count("http", duration("1m"), {"method": "POST", "name": "api.example.com"}) >= 20`
	curlRule = `action.kind == "exec" && size(action.argv) > 0 && action.argv[0].matches("(^|/)(curl|wget)$")`
)

func mustCompile(t testing.TB, rules ...api.PolicyRule) *RuleSet {
	t.Helper()
	rs, err := Compile(api.PolicyRuleSet{Rules: rules})
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// decideSeq decides each action in turn with the ones before as history,
// as the engine does, and returns the verdicts.
func decideSeq(t testing.TB, rs *RuleSet, acts []actions.Action) []Result {
	h := NewHistory(0)
	var out []Result
	for _, a := range acts {
		r := Evaluate(context.Background(), []*RuleSet{rs}, a, h, a.Time)
		v := r.Verdict
		if v == actions.Ask {
			v = actions.Deny
		}
		h.Append(a, v)
		out = append(out, r)
	}
	return out
}

func TestPIIThenEgressOnlyToInternal(t *testing.T) {
	rs := mustCompile(t, api.PolicyRule{Name: "pii-egress", Match: piiRule, Verdict: "deny", Reason: "after reading PII, egress only to api.internal"})
	t0 := time.Unix(1_800_000_000, 0)
	acts := []actions.Action{
		{Kind: "dns", Name: "pypi.org", Time: t0},                            // before: allowed
		{Kind: "file.read", Path: "/data/piix/a", Time: t0.Add(time.Second)}, // not under /data/pii
		{Kind: "connect", Name: "pypi.org", Port: 443, Time: t0.Add(2 * time.Second)},
		{Kind: "file.read", Path: "/data/pii/users.csv", Time: t0.Add(3 * time.Second)},
		{Kind: "connect", Name: "pypi.org", Port: 443, Time: t0.Add(4 * time.Second)},     // denied
		{Kind: "connect", Name: "api.internal", Port: 443, Time: t0.Add(5 * time.Second)}, // allowed
		{Kind: "dns", Name: "evil.example", Time: t0.Add(6 * time.Second)},                // denied
	}
	got := decideSeq(t, rs, acts)
	want := []actions.Verdict{"allow", "allow", "allow", "allow", "deny", "allow", "deny"}
	for i, r := range got {
		if r.Verdict != want[i] {
			t.Errorf("action %d (%s %s%s): %s, want %s", i, acts[i].Kind, acts[i].Name, acts[i].Path, r.Verdict, want[i])
		}
	}
	if got[4].Reason != "after reading PII, egress only to api.internal" || got[4].Rule != "pii-egress" {
		t.Errorf("deny result %+v", got[4])
	}
}

func TestPIIMemoryOutlivesEviction(t *testing.T) {
	rs := mustCompile(t, api.PolicyRule{Name: "pii-egress", Match: piiRule, Verdict: "deny"})
	h := NewHistory(100)
	t0 := time.Unix(1_800_000_000, 0)
	h.Append(actions.Action{Kind: "file.read", Path: "/data/pii/x", Time: t0}, actions.Allow)
	for i := range 500 {
		h.Append(actions.Action{Kind: "exec", Argv: []string{"true"}, Time: t0.Add(time.Duration(i) * time.Millisecond)}, actions.Allow)
	}
	if h.Len() != 100 {
		t.Fatalf("history len %d, want 100", h.Len())
	}
	r := Evaluate(context.Background(), []*RuleSet{rs}, actions.Action{Kind: "dns", Name: "x.example", Time: t0.Add(time.Hour)}, h, t0.Add(time.Hour))
	if r.Verdict != actions.Deny {
		t.Fatalf("PII read forgotten after eviction: %+v", r)
	}
}

func TestAtMost20PostsPerMinute(t *testing.T) {
	rs := mustCompile(t, api.PolicyRule{Name: "post-rate", Match: postRule, Verdict: "deny", Reason: "at most 20 POSTs per minute to api.example.com"})
	t0 := time.Unix(1_800_000_000, 0)
	var acts []actions.Action
	for i := range 25 { // 25 POSTs in 25 s: the 21st..25th are denied
		acts = append(acts, actions.Action{Kind: "http", Method: "POST", Name: "api.example.com", Path: "/v1/x", Time: t0.Add(time.Duration(i) * time.Second)})
		// GETs and POSTs elsewhere do not count.
		acts = append(acts, actions.Action{Kind: "http", Method: "GET", Name: "api.example.com", Time: t0.Add(time.Duration(i) * time.Second)})
		acts = append(acts, actions.Action{Kind: "http", Method: "POST", Name: "other.example.com", Time: t0.Add(time.Duration(i) * time.Second)})
	}
	// A minute after the first POST, the window has room again: the POSTs
	// of seconds 0..1 left it, and denied ones never counted.
	acts = append(acts, actions.Action{Kind: "http", Method: "POST", Name: "api.example.com", Time: t0.Add(61500 * time.Millisecond)})
	got := decideSeq(t, rs, acts)
	for i, r := range got {
		a := acts[i]
		want := actions.Allow
		if a.Method == "POST" && a.Name == "api.example.com" && i/3 >= 20 && i < 75 {
			want = actions.Deny
		}
		if r.Verdict != want {
			t.Errorf("action %d (%s %s at %v): %s, want %s", i, a.Method, a.Name, a.Time.Sub(t0), r.Verdict, want)
		}
	}
}

func TestCurlNeedsApproval(t *testing.T) {
	rs := mustCompile(t, api.PolicyRule{Name: "curl-ask", Match: curlRule, Verdict: "ask", Reason: "network tools need a human"})
	for argv, want := range map[string]actions.Verdict{
		"curl https://x": actions.Ask, "/usr/bin/wget x": actions.Ask, "ls -l": actions.Allow, "mycurl": actions.Allow, "echo curl": actions.Allow,
	} {
		r := Evaluate(context.Background(), []*RuleSet{rs}, actions.Action{Kind: "exec", Argv: strings.Fields(argv)}, NewHistory(0), time.Now())
		if r.Verdict != want {
			t.Errorf("%q: %s, want %s", argv, r.Verdict, want)
		}
	}
}

func TestPrecedence(t *testing.T) {
	allow := api.PolicyRule{Name: "a", Match: "true", Verdict: "allow"}
	ask := api.PolicyRule{Name: "q", Match: `action.kind == "exec"`, Verdict: "ask"}
	deny := api.PolicyRule{Name: "d", Match: `action.kind == "exec" && action.user == "root"`, Verdict: "deny", Reason: "no root"}
	server := mustCompile(t, allow, ask)
	server.Scope = "server"
	sbx := mustCompile(t, deny)
	sbx.Scope = "sandbox:sb_1"
	for _, c := range []struct {
		act  actions.Action
		want actions.Verdict
		rule string
	}{
		{actions.Action{Kind: "exec", User: "root"}, actions.Deny, "sandbox:sb_1/d"},
		{actions.Action{Kind: "exec", User: "user"}, actions.Ask, "server/q"},
		{actions.Action{Kind: "file.read", Path: "/x"}, actions.Allow, "server/a"},
	} {
		r := Evaluate(context.Background(), []*RuleSet{server, sbx}, c.act, NewHistory(0), time.Now())
		if r.Verdict != c.want || r.Rule != c.rule {
			t.Errorf("%+v: %+v, want %s by %s", c.act, r, c.want, c.rule)
		}
	}
	// No rule sets, or none matching: allow.
	if r := Evaluate(context.Background(), nil, actions.Action{Kind: "exec"}, NewHistory(0), time.Now()); r.Verdict != actions.Allow {
		t.Errorf("no rules: %+v", r)
	}
}

func TestCostLimitDenies(t *testing.T) {
	rs := mustCompile(t, api.PolicyRule{Name: "quadratic", Match: `history.all(a, history.all(b, a.kind == b.kind || true))`, Verdict: "allow"})
	h := NewHistory(0)
	for i := range 10000 {
		h.Append(actions.Action{Kind: "exec", Time: time.Unix(int64(i), 0)}, actions.Allow)
	}
	start := time.Now()
	r := Evaluate(context.Background(), []*RuleSet{rs}, actions.Action{Kind: "exec"}, h, time.Now())
	if r.Verdict != actions.Deny || !strings.Contains(r.Reason, "cost limit") || !strings.Contains(r.Reason, "failing closed") {
		t.Fatalf("over-cost rule: %+v", r)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("over-cost rule took %v", d)
	}
	// A single scan of the full history is within the limit.
	rs = mustCompile(t, api.PolicyRule{Name: "scan", Match: `history.exists(a, a.path == "/nope")`, Verdict: "deny"})
	if r := Evaluate(context.Background(), []*RuleSet{rs}, actions.Action{Kind: "exec"}, h, time.Now()); r.Verdict != actions.Allow {
		t.Fatalf("full scan: %+v", r)
	}
}

func TestCompileErrors(t *testing.T) {
	for _, c := range []struct {
		rule api.PolicyRule
		want []string
	}{
		{api.PolicyRule{Name: "r", Match: `action.kind == "exec" && action.nope == 1`, Verdict: "deny"}, []string{`rules[0] ("r")`, "1:32", "undefined field 'nope'", "^"}},
		{api.PolicyRule{Name: "r", Match: "action.kind ==", Verdict: "deny"}, []string{"1:15", "Syntax error"}},
		{api.PolicyRule{Name: "r", Match: "frobnicate(1)", Verdict: "deny"}, []string{"1:11", "undeclared reference to 'frobnicate'"}},
		{api.PolicyRule{Name: "r", Match: "action.kind", Verdict: "deny"}, []string{"must be a bool expression", "string"}},
		{api.PolicyRule{Name: "r", Match: "true", Verdict: "maybe"}, []string{"verdict must be allow, deny or ask"}},
		{api.PolicyRule{Match: "true", Verdict: "deny"}, []string{"name is required"}},
		{api.PolicyRule{Name: "r", Match: `count("http", duration("1m"), {"methdo": "POST"}) > 1`, Verdict: "deny"}, []string{`filter key methdo at 1:32`}},
	} {
		_, err := Compile(api.PolicyRuleSet{Rules: []api.PolicyRule{c.rule}})
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: %v, want invalid argument", c.rule.Match, err)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%q: error %q does not contain %q", c.rule.Match, err, w)
			}
		}
	}
	_, err := Compile(api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "a", Match: "true", Verdict: "deny"}, {Name: "a", Match: "true", Verdict: "deny"}}})
	if err == nil || !strings.Contains(err.Error(), "used twice") {
		t.Errorf("duplicate names: %v", err)
	}
}

func TestParse(t *testing.T) {
	rs, err := Parse([]byte("rules:\n  - name: curl\n    match: " + fmt.Sprintf("%q", curlRule) + "\n    verdict: ask\n"))
	if err != nil || len(rs.Rules) != 1 || rs.Rules[0].Verdict != "ask" {
		t.Fatalf("yaml: %+v %v", rs, err)
	}
	if _, err := Parse([]byte(`{"rules":[{"name":"x","match":"true","verdict":"deny","extra":1}]}`)); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("unknown field: %v", err)
	}
}
