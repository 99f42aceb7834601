package policy

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
)

// The CEL view of an action is the one action type plus its verdict: rules
// see exactly these field names (and not the embedded struct), on action
// and on each history entry.
func TestActFieldNames(t *testing.T) {
	e, err := env()
	if err != nil {
		t.Fatal(err)
	}
	got, ok := e.CELTypeProvider().FindStructFieldNames("policy.Act")
	if !ok {
		t.Fatal("policy.Act is not a CEL type")
	}
	slices.Sort(got)
	want := []string{"argv", "cwd", "exe", "ip", "kind", "method", "name", "path", "port", "sandbox", "secret", "sni",
		"template", "tenant", "time", "user", "verb", "verdict"}
	if !slices.Equal(got, want) {
		t.Fatalf("CEL fields of policy.Act:\n got %v\nwant %v", got, want)
	}
}

func TestActFieldsInRules(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	h := NewHistory(0)
	h.Append(actions.Action{Kind: actions.Exec, Time: t0, Sandbox: "sb_1", Argv: []string{"curl", "x"}, User: "root", Cwd: "/w"}, actions.Deny)
	h.Append(actions.Action{Kind: actions.Connect, Time: t0.Add(time.Second), Name: "pypi.org", IP: "10.0.0.1", Port: 443,
		SNI: "pypi.org", Exe: "/usr/bin/pip"}, actions.Allow)
	a := actions.Action{Kind: actions.HTTP, Time: t0.Add(2 * time.Second), Sandbox: "sb_1", Tenant: "t", Template: "py",
		Name: "api.example.com", Method: "POST", Path: "/v1/x"}
	for match, want := range map[string]bool{
		`action.path == "/v1/x" && action.method == "POST" && action.tenant == "t" && action.template == "py"`:   true,
		`action.verdict == "" && action.sandbox == "sb_1" && action.time == timestamp("2027-01-15T08:00:02Z")`:   true,
		`history.exists(h, h.verdict == "deny" && h.kind == "exec" && h.argv[0] == "curl" && h.user == "root")`:  true,
		`history.exists(h, h.verdict == "allow" && h.port == 443 && h.exe == "/usr/bin/pip" && h.sni == h.name)`: true,
		`history.exists(h, h.verdict == "deny" && h.kind == "connect")`:                                          false,
		`size(history) == 2 && history[0].cwd == "/w" && history[1].ip == "10.0.0.1"`:                            true,
		`count("exec", duration("1h"), {"verdict": "deny", "argv0": "curl"}) == 1 && seen("connect", "pypi")`:    true,
	} {
		rs := mustCompile(t, api.PolicyRule{Name: "r", Match: match, Verdict: "deny"})
		r := Evaluate(context.Background(), []*RuleSet{rs}, a, h, a.Time)
		if got := r.Verdict == actions.Deny; got != want || (want && r.Rule != "r") {
			t.Errorf("%s: %+v, want match=%v", match, r, want)
		}
	}
}

// The one action type's JSON is the wire shape approvals, `space policy
// test` and the gateway's decision stream have always carried.
func TestActionJSON(t *testing.T) {
	full := actions.Action{Kind: "connect", Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Sandbox: "sb", Tenant: "te",
		Template: "tp", Argv: []string{"a", "b"}, User: "u", Cwd: "/c", Path: "/p", Name: "n", IP: "1.2.3.4", Port: 443,
		SNI: "s", Method: "GET", Secret: "k", Verb: "stop", Exe: "/e"}
	for a, want := range map[*actions.Action]string{
		{}:    `{"kind":"","time":"0001-01-01T00:00:00Z"}`,
		&full: `{"kind":"connect","time":"2026-01-02T03:04:05Z","sandbox":"sb","tenant":"te","template":"tp","argv":["a","b"],"user":"u","cwd":"/c","path":"/p","name":"n","ip":"1.2.3.4","port":443,"sni":"s","method":"GET","secret":"k","verb":"stop","exe":"/e"}`,
	} {
		b, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != want {
			t.Errorf("JSON:\n got %s\nwant %s", b, want)
		}
	}
}
