package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/template"
)

// newNetHarness is a harness whose manager drives a FakeNetwork, with def
// as the server's default policy.
func newNetHarness(t *testing.T, opts fakeruntime.Options, def api.NetworkPolicy) *harness {
	t.Helper()
	h := newHarnessWith(t, opts)
	h.m.Close()
	h.netw, h.defNet = NewFakeNetwork(), def
	h.m = h.manager()
	return h
}

// methods lists the recorded call methods of id, in order.
func (h *harness) netCalls(id string) []string {
	var out []string
	for _, c := range h.netw.Calls(id) {
		out = append(out, c.Method)
	}
	return out
}

func (h *harness) attachedWith(id string) api.NetworkPolicy {
	h.t.Helper()
	p, ok := h.netw.Policy(id)
	if !ok {
		h.t.Fatalf("sandbox %s is not attached (calls %v)", id, h.netCalls(id))
	}
	return p
}

func hasPhase(op api.Operation, name string) bool {
	return slices.ContainsFunc(op.Phases, func(p api.Phase) bool { return p.Name == name })
}

func TestNetworkPolicyResolvedAtCreate(t *testing.T) {
	def := api.NetworkPolicy{AllowOut: []string{"default.example"}}
	h := newNetHarness(t, fakeruntime.Options{}, def)
	tmplPol := api.NetworkPolicy{AllowOut: []string{"pypi.org:443"}, DenyOut: []string{"10.0.0.0/8"}}
	src := filepath.Join(h.dir, "src2")
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	os.WriteFile(filepath.Join(src, "etc", "other"), []byte("x"), 0o644)
	if _, err := h.tmpl.ImportDir(h.ctx(), src, template.ImportOptions{Tags: []string{"netted:latest"}, Source: "dir",
		Config: api.TemplateConfig{Network: &tmplPol}}); err != nil {
		t.Fatal(err)
	}
	reqPol := api.NetworkPolicy{Internet: true, EgressProxy: "socks5://127.0.0.1:1080"}
	for _, tc := range []struct {
		name string
		req  api.CreateSandboxRequest
		want api.NetworkPolicy
	}{
		{"request wins", api.CreateSandboxRequest{Template: "netted:latest", Network: &reqPol}, reqPol},
		{"template", api.CreateSandboxRequest{Template: "netted:latest"}, tmplPol},
		{"server default", api.CreateSandboxRequest{}, def},
		{"explicit none beats the template", api.CreateSandboxRequest{Template: "netted:latest", Network: &api.NetworkPolicy{}}, api.NetworkPolicy{}},
	} {
		sb, op, err := h.m.creates.Create(h.ctx(), tc.req)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		op = h.wait(op)
		if !hasPhase(op, "network") {
			t.Errorf("%s: no network phase in %+v", tc.name, op.Phases)
		}
		if got := h.attachedWith(sb.ID); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: attached with %+v, want %+v", tc.name, got, tc.want)
		}
		rec, _ := h.m.Get(h.ctx(), sb.ID)
		if rec.Network == nil || !reflect.DeepEqual(*rec.Network, tc.want) {
			t.Errorf("%s: record has %+v, want %+v", tc.name, rec.Network, tc.want)
		}
	}
}

func TestNetworkFollowsTheLifecycle(t *testing.T) {
	h := newNetHarness(t, fakeruntime.Options{Suspend: true, Fork: true}, api.NetworkPolicy{})
	pol := api.NetworkPolicy{AllowOut: []string{"*.example.com"}}
	id := h.create(api.CreateSandboxRequest{Network: &pol}).ID

	h.verb(id, api.OpStop)
	if _, ok := h.netw.Policy(id); ok {
		t.Fatal("stopped sandbox still attached")
	}
	if op := h.verb(id, api.OpStart); !hasPhase(op, "network") {
		t.Fatalf("start phases %+v", op.Phases)
	}
	h.attachedWith(id)

	// Pause keeps the link; suspend drops it and restore brings it back.
	h.verb(id, api.OpPause)
	h.attachedWith(id)
	h.verb(id, api.OpResume)
	h.verb(id, api.OpSuspend)
	if _, ok := h.netw.Policy(id); ok {
		t.Fatal("suspended sandbox still attached")
	}
	if op := h.verb(id, api.OpRestore); !hasPhase(op, "network") {
		t.Fatalf("restore phases %+v", op.Phases)
	}
	if got := h.attachedWith(id); !reflect.DeepEqual(got, pol) {
		t.Fatalf("restored with %+v", got)
	}

	// Fork children inherit the parent's policy and get their own link.
	op, err := h.m.verbs.Fork(h.ctx(), id, api.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	h.wait(op)
	for _, cid := range op.Children {
		if got := h.attachedWith(cid); !reflect.DeepEqual(got, pol) {
			t.Fatalf("child %s attached with %+v", cid, got)
		}
		if sb, _ := h.m.Get(h.ctx(), cid); sb.Network == nil || !reflect.DeepEqual(*sb.Network, pol) {
			t.Fatalf("child record %+v", sb.Network)
		}
	}

	del, err := h.m.verbs.Lifecycle(h.ctx(), id, api.OpDelete, true)
	if err != nil {
		t.Fatal(err)
	}
	h.wait(del)
	if _, ok := h.netw.Policy(id); ok {
		t.Fatal("deleted sandbox still attached")
	}
	if c := h.netCalls(id); c[len(c)-1] != "detach" {
		t.Fatalf("calls %v", c)
	}
}

func TestNetworkAttachFailureFailsCreateAndStart(t *testing.T) {
	h := newNetHarness(t, fakeruntime.Options{}, api.NetworkPolicy{})
	h.netw.FailNext("attach", fmt.Errorf("gateway down: %w", errdefs.ErrUnavailable))
	sb, op, err := h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	op, _ = h.m.verbs.Wait(h.ctx(), op.ID)
	if op.State != api.OpFailed || !strings.Contains(op.Error.Message, "gateway down") {
		t.Fatalf("create %+v %+v", op, op.Error)
	}
	if s := h.state(sb.ID); s != api.StateError {
		t.Fatalf("state %s", s)
	}

	id := h.create(api.CreateSandboxRequest{}).ID
	h.verb(id, api.OpStop)
	h.rt.FailNext("nic", errors.New("no tap"), false)
	op, err = h.m.verbs.Lifecycle(h.ctx(), id, api.OpStart, false)
	if err != nil {
		t.Fatal(err)
	}
	if op, _ = h.m.verbs.Wait(h.ctx(), op.ID); op.State != api.OpFailed {
		t.Fatalf("start %+v", op)
	}
	if s := h.state(id); s != api.StateStopped {
		t.Fatalf("after a failed attach the sandbox is %s", s)
	}
	// The next start works.
	h.verb(id, api.OpStart)
	h.attachedWith(id)
}

func TestSetNetworkUpdatesGatewayAndRecord(t *testing.T) {
	h := newNetHarness(t, fakeruntime.Options{}, api.NetworkPolicy{})
	id := h.create(api.CreateSandboxRequest{}).ID
	pol := api.NetworkPolicy{AllowOut: []string{"api.openai.com:443"}, Rules: []api.HeaderRule{{Domain: "api.openai.com", SetHeaders: map[string]string{"X-A": "b"}}}}
	sb, err := h.m.net.SetNetwork(h.ctx(), id, pol)
	if err != nil || sb.Network == nil || !reflect.DeepEqual(*sb.Network, pol) {
		t.Fatalf("set: %v %+v", err, sb.Network)
	}
	if got := h.attachedWith(id); !reflect.DeepEqual(got, pol) {
		t.Fatalf("gateway has %+v", got)
	}
	if c := h.netCalls(id); c[len(c)-1] != "set_policy" {
		t.Fatalf("calls %v", c)
	}
	rec, _ := h.m.Get(h.ctx(), id)
	if !reflect.DeepEqual(*rec.Network, pol) {
		t.Fatalf("record %+v", rec.Network)
	}
	info, err := h.m.net.NetworkInfo(h.ctx(), id)
	if err != nil || !info.Attached || info.Address != hostnet.SandboxAddr || info.Gateway != hostnet.GatewayAddr || !reflect.DeepEqual(info.Policy, pol) {
		t.Fatalf("info %v %+v", err, info)
	}

	// A stopped sandbox gets its new policy when it next runs.
	h.verb(id, api.OpStop)
	if info, _ := h.m.net.NetworkInfo(h.ctx(), id); info.Attached {
		t.Fatalf("stopped sandbox info %+v", info)
	}
	none := api.NetworkPolicy{Internet: true}
	if _, err := h.m.net.SetNetwork(h.ctx(), id, none); err != nil {
		t.Fatal(err)
	}
	h.verb(id, api.OpStart)
	if got := h.attachedWith(id); !reflect.DeepEqual(got, none) {
		t.Fatalf("started with %+v", got)
	}

	// A gateway that refuses the update loses the link: fail closed.
	h.netw.FailNext("set_policy", errors.New("boom"))
	if _, err := h.m.net.SetNetwork(h.ctx(), id, pol); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("refused update: %v", err)
	}
	if _, ok := h.netw.Policy(id); ok {
		t.Fatal("the old policy stayed in force after a refused update")
	}

	if _, err := h.m.net.SetNetwork(h.ctx(), "sb-nosuchsandbox1", pol); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown id: %v", err)
	}
}

func TestNetworkReconcile(t *testing.T) {
	h := newNetHarness(t, fakeruntime.Options{}, api.NetworkPolicy{Internet: true})
	id := h.create(api.CreateSandboxRequest{}).ID
	stopped := h.create(api.CreateSandboxRequest{}).ID
	h.verb(stopped, api.OpStop)

	// A restarted gateway lost the link; a stale link and one no record
	// owns are still there.
	h.netw.Forget(id)
	f, _ := os.Open(os.DevNull)
	defer f.Close()
	h.netw.Attach(h.ctx(), stopped, f, api.NetworkPolicy{})
	h.netw.Attach(h.ctx(), "sb-ghostghostghost", f, api.NetworkPolicy{})

	h.m.net.reconcileNetwork(h.ctx())
	if got := h.attachedWith(id); !got.Internet {
		t.Fatalf("re-attached with %+v", got)
	}
	ids, _ := h.netw.Attached(h.ctx())
	if !reflect.DeepEqual(ids, []string{id}) {
		t.Fatalf("attached after reconcile: %v", ids)
	}

	// And on a server start.
	h.netw.Forget(id)
	h.m.Close()
	h.m = h.manager()
	if err := h.m.recon.Reconcile(h.ctx()); err != nil {
		t.Fatal(err)
	}
	h.attachedWith(id)
}

func TestNetworkEventsAndInfo(t *testing.T) {
	h := newNetHarness(t, fakeruntime.Options{}, api.NetworkPolicy{})
	id := h.create(api.CreateSandboxRequest{}).ID
	h.netw.Push(id, api.NetworkEvent{Protocol: "dns", Name: "a.example", Verdict: api.VerdictDeny})
	second := h.netw.Push(id, api.NetworkEvent{Protocol: "tcp", IP: "1.2.3.4", Port: 443, Verdict: api.VerdictAllow, BytesOut: 10})
	var got []api.NetworkEvent
	collect := func(ev api.NetworkEvent) error { got = append(got, ev); return nil }
	if err := h.m.net.NetworkEvents(h.ctx(), id, 0, false, collect); err != nil || len(got) != 2 {
		t.Fatalf("events: %v %+v", err, got)
	}
	got = nil
	if err := h.m.net.NetworkEvents(h.ctx(), id, second.Seq-1, false, collect); err != nil || len(got) != 1 || got[0].Seq != second.Seq {
		t.Fatalf("events after: %v %+v", err, got)
	}
	// follow returns when ctx ends.
	ctx, cancel := context.WithCancel(h.ctx())
	got = nil
	done := make(chan error, 1)
	go func() {
		done <- h.m.net.NetworkEvents(ctx, id, second.Seq, true, func(ev api.NetworkEvent) error {
			got = append(got, ev)
			cancel()
			return nil
		})
	}()
	h.netw.Push(id, api.NetworkEvent{Protocol: "tcp", Verdict: api.VerdictDrop})
	if err := <-done; err != nil || len(got) != 1 || got[0].Verdict != api.VerdictDrop {
		t.Fatalf("follow: %v %+v", err, got)
	}
	info, err := h.m.net.NetworkInfo(h.ctx(), id)
	if err != nil || info.Stats.Verdicts[api.VerdictAllow] != 1 || info.Stats.BytesOut != 10 {
		t.Fatalf("info %v %+v", err, info)
	}
	if _, err := h.m.net.NetworkInfo(h.ctx(), "sb-nosuchsandbox1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown id: %v", err)
	}
	if err := h.m.net.NetworkEvents(h.ctx(), "sb-nosuchsandbox1", 0, false, collect); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown id events: %v", err)
	}
}

func TestBadNetworkPolicyIsInvalid(t *testing.T) {
	h := newNetHarness(t, fakeruntime.Options{}, api.NetworkPolicy{})
	defer func(v func(api.NetworkPolicy) error) { validateNetwork = v }(validateNetwork)
	validateNetwork = func(p api.NetworkPolicy) error {
		if len(p.AllowOut) > 0 && p.AllowOut[0] == "*" {
			return fmt.Errorf("network.allow_out[0]: a bare * is not a pattern: %w", errdefs.ErrInvalidArgument)
		}
		return nil
	}
	bad := api.NetworkPolicy{AllowOut: []string{"*"}}
	if _, _, err := h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{Network: &bad}); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "network.allow_out[0]") {
		t.Fatalf("create: %v", err)
	}
	id := h.create(api.CreateSandboxRequest{}).ID
	if _, err := h.m.net.SetNetwork(h.ctx(), id, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("set: %v", err)
	}
	if got := h.attachedWith(id); !reflect.DeepEqual(got, api.NetworkPolicy{}) {
		t.Fatalf("a refused policy reached the gateway: %+v", got)
	}
}

// TestRealValidatorRefusesBareStar: a bare "*" in allow_out is refused,
// naming the entry, by netpolicy.Validate and by the manager's check (a
// validator that lets it through is broken: the test fails, it does not
// skip).
func TestRealValidatorRefusesBareStar(t *testing.T) {
	bad := api.NetworkPolicy{AllowOut: []string{"pypi.org", "*"}}
	if err := netpolicy.Validate(bad); err == nil {
		t.Fatal(`netpolicy.Validate accepted allow_out "*"`)
	}
	err := validatePolicy(bad)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "allow_out[1]") {
		t.Fatalf("%v", err)
	}
}

func TestNoNetworkMeansNoLink(t *testing.T) {
	h := newHarness(t)
	id := h.create(api.CreateSandboxRequest{Network: &api.NetworkPolicy{Internet: true}}).ID
	info, err := h.m.net.NetworkInfo(h.ctx(), id)
	if err != nil || info.Attached || info.Address != "" || !info.Policy.Internet {
		t.Fatalf("info without a gateway: %v %+v", err, info)
	}
	if _, err := h.m.net.SetNetwork(h.ctx(), id, api.NetworkPolicy{}); err != nil {
		t.Fatal(err)
	}
}
