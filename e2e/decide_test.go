package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/server"
)

// e2eDecider is the server's Decider in these tests: rule decides (it may
// block, as an approval does), every action is recorded.
type e2eDecider struct {
	mu    sync.Mutex
	rule  func(ctx context.Context, a actions.Action) actions.Decision
	seen  []actions.Action
	asked chan actions.Action
}

var _ server.ScopedDecider = (*e2eDecider)(nil)

func (d *e2eDecider) Decide(ctx context.Context, a actions.Action) actions.Decision {
	d.mu.Lock()
	d.seen = append(d.seen, a)
	rule := d.rule
	d.mu.Unlock()
	select {
	case d.asked <- a:
	default:
	}
	return rule(ctx, a)
}

// Applies: every sandbox of this server has rules.
func (d *e2eDecider) Applies(string) bool { return true }

func (d *e2eDecider) set(rule func(ctx context.Context, a actions.Action) actions.Decision) {
	d.mu.Lock()
	d.rule = rule
	d.mu.Unlock()
}

// lastConnect is the last connect action to port.
func (d *e2eDecider) lastConnect(port int) (actions.Action, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := len(d.seen) - 1; i >= 0; i-- {
		if a := d.seen[i]; a.Kind == actions.Connect && a.Port == port {
			return a, true
		}
	}
	return actions.Action{}, false
}

func allow(context.Context, actions.Action) actions.Decision {
	return actions.Decision{Verdict: actions.Allow}
}

// TestNetworkDecider: a real native sandbox's curl, through the real
// gateway process, is decided by the server's Decider over the decisions
// stream: denied (reset, event with the rule's reason), allowed, asked
// (curl waits until the answer), a DNS query denied (NXDOMAIN); the
// executable that connected is the one the host sees in the sandbox's
// /proc (curl, then python3), in the action and the event; a gvisor
// sandbox's connections carry none; after kill -9 of the gateway the
// stream is back and decides again.
func TestNetworkDecider(t *testing.T) {
	dec := &e2eDecider{rule: allow, asked: make(chan actions.Action, 1000)}
	e := setup(t)
	defer e.srv.SetDecider(dec)()
	fi := e.internet
	hp := fi.httpPort
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test", "other.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	curl := fmt.Sprintf("curl -sS --max-time 20 http://allowed.test:%d/", hp)

	// Where curl and python3 really are (readlink -f: /usr/bin/python3 is
	// a symlink; /proc/<pid>/exe names the file).
	out, code := sh(t, e, sb.ID, "readlink -f $(command -v curl) $(command -v python3)")
	paths := strings.Fields(out)
	if code != 0 || len(paths) != 2 {
		t.Fatalf("paths: %d %q", code, out)
	}
	curlExe, pyExe := paths[0], paths[1]

	// Denied.
	dec.set(func(_ context.Context, a actions.Action) actions.Decision {
		if a.Kind == actions.Connect {
			return actions.Decision{Verdict: actions.Deny, Reason: "e2e says no", Rule: "no-http"}
		}
		return actions.Decision{Verdict: actions.Allow}
	})
	if out, code := sh(t, e, sb.ID, curl); code == 0 {
		t.Fatalf("a connection the Decider denied went through: %q", out)
	}
	a, ok := dec.lastConnect(hp)
	if !ok || a.Sandbox != sb.ID || a.Name != "allowed.test" || a.IP != "127.0.0.2" || a.Exe != curlExe || a.Tenant != "default" || a.Template == "" {
		t.Fatalf("connect action: %+v (want exe %s)", a, curlExe)
	}
	ev := findEvent(t, e, sb.ID, func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.VerdictDeny && ev.Port == hp && strings.Contains(ev.Reason, "e2e says no")
	})
	if ev.Exe != curlExe || !strings.Contains(ev.Reason, "no-http") {
		t.Fatalf("deny event: %+v", ev)
	}

	// Allowed: curl, and python3 named as itself.
	dec.set(allow)
	if out, code := sh(t, e, sb.ID, curl); code != 0 || !strings.Contains(out, "127.0.0.2:") {
		t.Fatalf("allowed: %d %q", code, out)
	}
	py := fmt.Sprintf(`python3 -c "import urllib.request;print(urllib.request.urlopen('http://allowed.test:%d/py',timeout=20).read().decode())"`, hp)
	if out, code := sh(t, e, sb.ID, py); code != 0 || !strings.Contains(out, "host=allowed.test") {
		t.Fatalf("python: %d %q", code, out)
	}
	if a, _ := dec.lastConnect(hp); a.Exe != pyExe {
		t.Fatalf("python's connection: exe %q, want %q", a.Exe, pyExe)
	}
	findEvent(t, e, sb.ID, func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.VerdictAllow && ev.Port == hp && ev.Exe == pyExe
	})

	// Asked: curl waits until the answer comes.
	release := make(chan actions.Decision)
	dec.set(func(ctx context.Context, a actions.Action) actions.Decision {
		if a.Kind != actions.Connect {
			return actions.Decision{Verdict: actions.Allow}
		}
		select {
		case d := <-release:
			return d
		case <-ctx.Done():
			return actions.Decision{Verdict: actions.Deny, Reason: "gone"}
		}
	})
	drain(dec.asked)
	type result struct {
		out  string
		code int
	}
	held := make(chan result, 1)
	t0 := time.Now()
	go func() {
		res, err := e.client.Exec(ctxT(t, time.Minute), sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", curl}})
		if err != nil {
			held <- result{err.Error(), -1}
			return
		}
		held <- result{res.Stdout + res.Stderr, res.ExitCode}
	}()
	for a := range dec.asked {
		if a.Kind == actions.Connect {
			break
		}
	}
	select {
	case r := <-held:
		t.Fatalf("curl did not wait for the decision: %+v", r)
	case <-time.After(time.Second):
	}
	release <- actions.Decision{Verdict: actions.Allow, Approval: "ap-e2e"}
	r := <-held
	if r.code != 0 || !strings.Contains(r.out, "127.0.0.2:") || time.Since(t0) < time.Second {
		t.Fatalf("the approved connection: %+v after %v", r, time.Since(t0))
	}

	// A DNS query denied: NXDOMAIN, never forwarded.
	fi.dns.ForgetAsked()
	dec.set(func(_ context.Context, a actions.Action) actions.Decision {
		if a.Kind == actions.DNS && a.Name == "other.test" {
			return actions.Decision{Verdict: actions.Deny, Reason: "not that one"}
		}
		return actions.Decision{Verdict: actions.Allow}
	})
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 20 http://other.test:%d/", hp)); code == 0 || !strings.Contains(out, "resolve") {
		t.Fatalf("a denied name: %d %q", code, out)
	}
	if fi.dns.WasAsked("other.test") {
		t.Fatal("a name the Decider denied reached the upstream")
	}
	findEvent(t, e, sb.ID, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "dns" && ev.Name == "other.test" && ev.Verdict == api.VerdictDeny && strings.Contains(ev.Reason, "not that one")
	})

	// gvisor: the host cannot see inside, so no executable.
	dec.set(allow)
	gsb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "gvisor", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	if out, code := sh(t, e, gsb.ID, curl); code != 0 || !strings.Contains(out, "127.0.0.2:") {
		t.Fatalf("gvisor allowed: %d %q", code, out)
	}
	dec.mu.Lock()
	var gconn *actions.Action
	for i := range dec.seen {
		if a := dec.seen[i]; a.Sandbox == gsb.ID && a.Kind == actions.Connect {
			gconn = &a
		}
	}
	dec.mu.Unlock()
	if gconn == nil || gconn.Exe != "" {
		t.Fatalf("gvisor connect action: %+v", gconn)
	}

	// kill -9 of the gateway: the supervisor starts another, the manager
	// re-attaches, the server re-opens the stream, decisions go on.
	b, err := os.ReadFile(filepath.Join(e.data, "network", "gateway.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := strconv.Atoi(strings.Fields(string(b))[0])
	if pid <= 1 {
		t.Fatalf("gateway pid %q", b)
	}
	dec.set(func(_ context.Context, a actions.Action) actions.Decision {
		if a.Kind == actions.Connect {
			return actions.Decision{Verdict: actions.Deny, Reason: "after the restart"}
		}
		return actions.Decision{Verdict: actions.Allow}
	})
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	for {
		time.Sleep(100 * time.Millisecond)
		if _, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 3 http://allowed.test:%d/", hp)); code == 0 {
			t.Fatal("after the gateway restart, a denied connection went through")
		}
		evs, err := eventsOf(e, sb.ID)
		if err == nil && hasEvent(evs, func(ev api.NetworkEvent) bool {
			return strings.Contains(ev.Reason, "after the restart") && ev.Exe == curlExe
		}) {
			t.Logf("decided again %v after kill -9 of the gateway (curls of 3 s at most)", time.Since(t0).Round(time.Millisecond))
			break
		}
		if time.Since(t0) > 30*time.Second {
			t.Fatalf("no decision after the gateway restart; events %+v", evs)
		}
	}
}

func drain(ch chan actions.Action) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

func eventsOf(e *env, id string) ([]api.NetworkEvent, error) {
	var evs []api.NetworkEvent
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := e.client.NetworkEvents(ctx, id, 0, false, func(ev api.NetworkEvent) error {
		evs = append(evs, ev)
		return nil
	})
	return evs, err
}

func hasEvent(evs []api.NetworkEvent, match func(api.NetworkEvent) bool) bool {
	for _, ev := range evs {
		if match(ev) {
			return true
		}
	}
	return false
}

// findEvent waits (briefly: a connection's event comes when it ends) for an
// event matching match and returns it.
func findEvent(t *testing.T, e *env, id string, match func(api.NetworkEvent) bool) api.NetworkEvent {
	t.Helper()
	var evs []api.NetworkEvent
	for range 50 {
		evs = networkEvents(t, e, id)
		for _, ev := range evs {
			if match(ev) {
				return ev
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("no such event among %+v", evs)
	return api.NetworkEvent{}
}
