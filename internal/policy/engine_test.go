package policy

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
)

type recSink struct {
	mu sync.Mutex
	ev []audit.Event
}

func (s *recSink) Record(_ context.Context, e audit.Event) {
	s.mu.Lock()
	s.ev = append(s.ev, e)
	s.mu.Unlock()
}

func (s *recSink) actions() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, e := range s.ev {
		out = append(out, e.Kind+":"+e.Action)
	}
	return out
}

func newEngine(t *testing.T, dir string, timeout time.Duration, sink audit.Sink) *Engine {
	t.Helper()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	e, err := New(context.Background(), Config{DB: db.SQL(), ApprovalTimeout: timeout, Audit: sink})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// waitPending returns the one pending approval once it exists.
func waitPending(t *testing.T, e *Engine) api.Approval {
	t.Helper()
	for range 500 {
		aps, err := e.Approvals(context.Background(), api.ApprovalPending, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(aps) == 1 {
			return aps[0]
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("no pending approval appeared")
	return api.Approval{}
}

func TestApprovals(t *testing.T) {
	sink := &recSink{}
	e := newEngine(t, t.TempDir(), 2*time.Second, sink)
	ctx := context.Background()
	if _, err := e.SetRules(ctx, "server", api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "curl", Match: curlRule, Verdict: "ask", Reason: "curl needs a human"}}}); err != nil {
		t.Fatal(err)
	}
	curl := actions.Action{Kind: actions.Exec, Sandbox: "sb_1", Argv: []string{"curl", "x"}}

	// Approve: the blocked Decide returns allow.
	follow, stop := context.WithCancel(ctx)
	seen := make(chan api.Approval, 16)
	subscribed := make(chan struct{})
	go e.FollowApprovals(follow, func() error { close(subscribed); return nil }, func(ap api.Approval) error { seen <- ap; return nil })
	<-subscribed
	done := make(chan actions.Decision, 1)
	go func() { done <- e.Decide(ctx, curl) }()
	ap := waitPending(t, e)
	if ap.Sandbox != "sb_1" || ap.Rule != "server/curl" || ap.Reason != "curl needs a human" || ap.Action.Argv[0] != "curl" || ap.Tenant != "default" {
		t.Fatalf("approval %+v", ap)
	}
	select {
	case d := <-done:
		t.Fatalf("decided before an answer: %+v", d)
	case <-time.After(100 * time.Millisecond):
	}
	actx := principal.With(ctx, principal.Principal{KeyID: "key_ops", Tenant: "default"})
	if _, err := e.Answer(actx, ap.ID, true, ""); err != nil {
		t.Fatal(err)
	}
	if d := <-done; !d.Allowed() || d.Approval != ap.ID {
		t.Fatalf("approved: %+v", d)
	}
	got, _ := e.Approval(ctx, ap.ID)
	if got.State != api.ApprovalApproved || got.AnsweredBy != "key_ops" {
		t.Fatalf("stored %+v", got)
	}
	if _, err := e.Answer(ctx, ap.ID, false, ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second answer: %v", err)
	}
	for _, want := range []string{api.ApprovalPending, api.ApprovalApproved} {
		select {
		case f := <-seen:
			if f.ID != ap.ID || f.State != want {
				t.Fatalf("followed %+v, want %s", f, want)
			}
		case <-time.After(time.Second):
			t.Fatalf("follower missed %s", want)
		}
	}
	stop()

	// Deny with a reason: the caller gets it.
	go func() { done <- e.Decide(ctx, curl) }()
	ap = waitPending(t, e)
	if _, err := e.Answer(ctx, ap.ID, false, "not today"); err != nil {
		t.Fatal(err)
	}
	d := <-done
	if d.Allowed() || !strings.Contains(d.Reason, "not today") {
		t.Fatalf("denied: %+v", d)
	}

	// Nobody answers: denied at the timeout.
	start := time.Now()
	d = e.Decide(ctx, curl)
	if d.Allowed() || !strings.Contains(d.Reason, "nobody answered within 2s") {
		t.Fatalf("timeout: %+v", d)
	}
	if el := time.Since(start); el < 2*time.Second || el > 4*time.Second {
		t.Fatalf("timeout took %v", el)
	}
	exp, _ := e.Approvals(ctx, api.ApprovalExpired, nil)
	if len(exp) != 1 {
		t.Fatalf("expired approvals %+v", exp)
	}
	// The history has the three curls with their outcomes.
	h := e.history("sb_1").h
	if n := h.Count(actions.Exec, time.Time{}, &Filter{Verdict: "any"}); n != 3 {
		t.Fatalf("history has %d execs", n)
	}
	if n := h.Count(actions.Exec, time.Time{}, &Filter{}); n != 1 {
		t.Fatalf("history has %d allowed execs", n)
	}
	want := "approval:ask approval:approve approval:ask approval:deny approval:ask approval:expire"
	if got := strings.Join(sink.actions(), " "); got != want {
		t.Fatalf("audit %s, want %s", got, want)
	}
}

func TestScopesAndLiveUpdate(t *testing.T) {
	dir := t.TempDir()
	e := newEngine(t, dir, time.Second, nil)
	ctx := context.Background()
	a := actions.Action{Kind: actions.FileRead, Sandbox: "sb_1", Tenant: "team-a", Template: "base:latest", Path: "/secret/x"}
	deny := func(name, match string) api.PolicyRuleSet {
		return api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: name, Match: match, Verdict: "deny", Reason: name}}}
	}
	if d := e.Decide(ctx, a); !d.Allowed() {
		t.Fatalf("no rules: %+v", d)
	}
	for _, c := range []struct{ scope, other string }{
		{"server", ""}, {"tenant:team-a", "tenant:team-b"}, {"template:base:latest", "template:other"}, {"sandbox:sb_1", "sandbox:sb_2"},
	} {
		if c.other != "" {
			if _, err := e.SetRules(ctx, c.other, deny("other", "true")); err != nil {
				t.Fatal(err)
			}
			if d := e.Decide(ctx, a); !d.Allowed() {
				t.Fatalf("%s applied to another's action: %+v", c.other, d)
			}
			e.DeleteRules(ctx, c.other)
		}
		if _, err := e.SetRules(ctx, c.scope, deny(c.scope, `action.path.startsWith("/secret")`)); err != nil {
			t.Fatal(err)
		}
		if d := e.Decide(ctx, a); d.Allowed() || d.Reason != c.scope {
			t.Fatalf("%s: %+v", c.scope, d)
		}
		if err := e.DeleteRules(ctx, c.scope); err != nil {
			t.Fatal(err)
		}
		if d := e.Decide(ctx, a); !d.Allowed() {
			t.Fatalf("%s removed, still %+v", c.scope, d)
		}
	}
	// Stored: a new engine on the same database has the rule set.
	if _, err := e.SetRules(ctx, "tenant:team-a", deny("stored", "true")); err != nil {
		t.Fatal(err)
	}
	e2 := newEngine(t, dir, time.Second, nil)
	if d := e2.Decide(ctx, a); d.Allowed() || d.Reason != "stored" {
		t.Fatalf("after reopen: %+v", d)
	}
	if len(e2.ListRules()) != 1 {
		t.Fatalf("list %+v", e2.ListRules())
	}
	for _, bad := range []string{"", "servers", "tenant:", "sandbox:a b", "pod:x"} {
		if _, err := e.SetRules(ctx, bad, deny("x", "true")); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("scope %q: %v", bad, err)
		}
	}
}

func TestPendingExpiredAtRestart(t *testing.T) {
	dir := t.TempDir()
	e := newEngine(t, dir, time.Minute, nil)
	ctx, cancel := context.WithCancel(context.Background())
	e.SetRules(ctx, "server", api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "all", Match: "true", Verdict: "ask"}}})
	go e.Decide(ctx, actions.Action{Kind: actions.Exec, Sandbox: "sb_1", Argv: []string{"x"}})
	ap := waitPending(t, e)
	// A second engine on the same database is what a restart looks like.
	e2 := newEngine(t, dir, time.Minute, nil)
	got, _ := e2.Approval(context.Background(), ap.ID)
	if got.State != api.ApprovalExpired || !strings.Contains(got.AnswerReason, "restarted") {
		t.Fatalf("after restart: %+v", got)
	}
	cancel()
}

func TestOfflineTest(t *testing.T) {
	hist, err := ReadActions(strings.NewReader(`{"kind":"file.read","path":"/data/pii/a","time":"2026-01-01T00:00:00Z"}

{"kind":"dns","name":"api.internal","time":"2026-01-01T00:00:01Z"}
{"kind":"dns","name":"pypi.org","time":"2026-01-01T00:00:02Z"}
{"kind":"exec","argv":["curl","x"]}
`), 100)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Test(api.PolicyRuleSet{Rules: []api.PolicyRule{
		{Name: "pii", Match: piiRule, Verdict: "deny"}, {Name: "curl", Match: curlRule, Verdict: "ask"}}}, hist,
		&api.PolicyAction{Kind: "dns", Name: "api.internal"})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range res {
		got = append(got, r.Verdict)
	}
	if strings.Join(got, ",") != "allow,allow,deny,ask,allow" || res[3].Action.Time.IsZero() || res[4].Line != 0 {
		t.Fatalf("results %v %+v", got, res)
	}
	if _, err := ReadActions(strings.NewReader(`{"kind":"dns","nmae":"x"}`), 10); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("bad line: %v", err)
	}
}
