package sandbox

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/store"
)

// ruleDecider denies an action when deny names a reason for it, allows the
// rest, and keeps what it was asked.
type ruleDecider struct {
	mu    sync.Mutex
	deny  func(actions.Action) string
	asked []actions.Action
}

func (d *ruleDecider) Decide(_ context.Context, a actions.Action) actions.Decision {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.asked = append(d.asked, a)
	if d.deny != nil {
		if why := d.deny(a); why != "" {
			return actions.Decision{Verdict: actions.Deny, Reason: why, Rule: "test-rule"}
		}
	}
	return actions.Decision{Verdict: actions.Allow}
}

func (d *ruleDecider) set(deny func(actions.Action) string) {
	d.mu.Lock()
	d.deny = deny
	d.mu.Unlock()
}

// count is how often an action of kind (and verb, when set) was asked.
func (d *ruleDecider) count(kind, verb string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, a := range d.asked {
		if a.Kind == kind && (verb == "" || a.Verb == verb) {
			n++
		}
	}
	return n
}

// newPolicyHarness is a harness whose manager asks d and records to rec.
// d allows everything again before the harness's own cleanup deletes.
func newPolicyHarness(t *testing.T, opts fakeruntime.Options) (*harness, *ruleDecider, *audit.Memory) {
	t.Helper()
	h := newHarnessWith(t, opts)
	d, rec := &ruleDecider{}, &audit.Memory{}
	h.m.Close()
	h.dec, h.rec = d, rec
	h.m = h.manager()
	t.Cleanup(func() { d.set(nil) })
	return h, d, rec
}

func denyVerbs(verbs ...string) func(actions.Action) string {
	return func(a actions.Action) string {
		for _, v := range verbs {
			if a.Kind == actions.Lifecycle && a.Verb == v {
				return "no " + v + " today"
			}
		}
		return ""
	}
}

func wantDenied(t *testing.T, what string, err error, reason string) {
	t.Helper()
	if !errors.Is(err, errdefs.ErrPolicyDenied) || !strings.Contains(err.Error(), reason) {
		t.Fatalf("%s: got %v, want a policy denial saying %q", what, err, reason)
	}
}

// TestDeniedExecDoesNotWake: an exec or command start the policy refuses
// leaves a suspended or paused sandbox as it was — the decision comes
// before the wake — and an allowed one still wakes it.
func TestDeniedExecDoesNotWake(t *testing.T) {
	h, d, _ := newPolicyHarness(t, fakeruntime.Options{Suspend: true})
	d.set(func(a actions.Action) string {
		if a.Kind == actions.Exec && len(a.Argv) > 0 && a.Argv[0] == "forbidden" {
			return "not this one"
		}
		return ""
	})
	id := h.create(api.CreateSandboxRequest{}).ID
	forbidden := api.ExecRequest{Cmd: []string{"forbidden"}}
	for _, asleep := range []struct{ verb, state string }{{api.OpSuspend, api.StateSuspended}, {api.OpPause, api.StatePaused}} {
		h.verb(id, asleep.verb)
		_, err := h.m.cmds.Exec(h.ctx(), id, forbidden)
		wantDenied(t, "exec", err, "not this one")
		_, err = h.m.cmds.CreateCommand(h.ctx(), id, api.CreateCommandRequest{ExecRequest: forbidden, Detached: true})
		wantDenied(t, "detached command", err, "not this one")
		cmd, err := h.m.cmds.CreateCommand(h.ctx(), id, api.CreateCommandRequest{ExecRequest: forbidden})
		if err != nil {
			t.Fatal(err)
		}
		_, err = h.m.cmds.AttachCommand(h.ctx(), id, cmd.ID, 0, 0)
		wantDenied(t, "attach that starts the command", err, "not this one")
		if s := h.state(id); s != asleep.state {
			t.Fatalf("after refused execs on a %s sandbox: %s", asleep.state, s)
		}
		h.exec(id) // allowed: wakes it
		if s := h.state(id); s != api.StateRunning {
			t.Fatalf("after an allowed exec: %s", s)
		}
	}
}

// TestLifecycleIsDecidedInTheManager: Lifecycle and Fork — what every
// front door calls — ask the policy once per verb, after the checks that
// refuse the verb anyway; a refusal is ErrPolicyDenied with the reason,
// audited, and changes nothing. The platform's own housekeeping (a
// deadline's delete) is not decided.
func TestLifecycleIsDecidedInTheManager(t *testing.T) {
	h, d, rec := newPolicyHarness(t, fakeruntime.Options{Suspend: true, Fork: true})
	id := h.create(api.CreateSandboxRequest{}).ID
	d.set(denyVerbs(api.OpSuspend, api.OpStop, api.OpDelete, api.OpFork))

	for _, verb := range []string{api.OpSuspend, api.OpStop, api.OpFork} {
		_, err := h.m.verbs.Lifecycle(h.ctx(), id, verb, false)
		wantDenied(t, verb, err, "no "+verb+" today")
	}
	_, err := h.m.verbs.Lifecycle(h.ctx(), id, api.OpDelete, true)
	wantDenied(t, "forced delete", err, "no delete today")
	_, err = h.m.verbs.Fork(h.ctx(), id, api.ForkRequest{Count: 2})
	wantDenied(t, "Fork", err, "no fork today")
	if s := h.state(id); s != api.StateRunning {
		t.Fatalf("after refused verbs: %s", s)
	}
	if sbs, _ := h.db.ListSandboxes(h.ctx(), store.SandboxFilter{}); len(sbs) != 1 {
		t.Fatalf("a refused fork left %d sandboxes", len(sbs))
	}
	// A delete the state refuses anyway is not put to the policy.
	before := d.count(actions.Lifecycle, api.OpDelete)
	if _, err := h.m.verbs.Lifecycle(h.ctx(), id, api.OpDelete, false); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("delete of a running sandbox without force: %v", err)
	}
	if n := d.count(actions.Lifecycle, api.OpDelete); n != before {
		t.Fatalf("a delete refused by state was asked about")
	}
	// Each refusal is audited, naming the verb, the rule and the reason.
	denied := 0
	for _, ev := range rec.Events() {
		if ev.Kind == audit.KindPolicy && ev.Action == string(actions.Deny) && ev.Sandbox == id {
			if !strings.HasPrefix(ev.Target, "lifecycle ") || !strings.HasPrefix(ev.Result, "no ") || ev.Detail["rule"] != "test-rule" {
				t.Fatalf("policy event %+v", ev)
			}
			denied++
		}
	}
	if denied != 5 {
		t.Fatalf("%d denials audited, want 5: %+v", denied, rec.Events())
	}
	// An allowed verb runs, asked exactly once.
	h.verb(id, api.OpPause)
	if n := d.count(actions.Lifecycle, api.OpPause); n != 1 {
		t.Fatalf("pause asked %d times", n)
	}
	h.verb(id, api.OpResume)

	// The deadline deletes the sandbox whatever the tenant's rules say.
	sb, err := h.m.Get(h.ctx(), id)
	if err != nil {
		t.Fatal(err)
	}
	asked := d.count(actions.Lifecycle, "")
	h.m.verbs.expire(h.ctx(), sb)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := h.m.Get(h.ctx(), id); errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the expired sandbox is still there: %s", h.state(id))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := d.count(actions.Lifecycle, ""); n != asked {
		t.Fatal("the deadline's delete was put to the policy")
	}
}
