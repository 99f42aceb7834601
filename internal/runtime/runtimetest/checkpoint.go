package runtimetest

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// The optional checkpoint subtests: they run when the instance implements
// runtime.Suspender / runtime.Forker and the probe says the verb works,
// and skip otherwise.

// memProc keeps a random value and a counter in a shell's memory and
// writes both to /tmp/mem ten times a second: after a restore the value
// must be the same and the counter must go on from where it was.
const memProc = `x=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n'); i=0; ` +
	`while :; do i=$((i+1)); echo "$x $i" > /tmp/mem.tmp; mv /tmp/mem.tmp /tmp/mem; sleep 0.1; done`

// memState reads /tmp/mem: the value and the counter.
func (sb *Sandbox) memState(t *testing.T) (string, int) {
	t.Helper()
	var out string
	for try := 0; try < 50; try++ {
		out = strings.TrimSpace(sb.Exec(t, "cat", "/tmp/mem").Stdout)
		if f := strings.Fields(out); len(f) == 2 {
			n, err := strconv.Atoi(f[1])
			if err == nil {
				return f[0], n
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("/tmp/mem = %q", out)
	return "", 0
}

// startMemProc starts memProc and waits for its first line.
func (sb *Sandbox) startMemProc(t *testing.T) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	if _, err := sb.Client.StartProc(ctx, agentproto.ProcStart{ID: "mem", Cmd: []string{"sh", "-c", memProc}}); err != nil {
		t.Fatal(err)
	}
	sb.memState(t)
}

// quiesce asks the agent to let go of the host and closes the client, as
// the manager does before a suspend or fork.
func (sb *Sandbox) quiesce(t *testing.T) {
	t.Helper()
	if err := sb.Client.Quiesce(ctxFor(t, 10*time.Second)); err != nil {
		t.Fatalf("Quiesce: %v", err)
	}
	sb.Client.Close()
	sb.Client = nil
}

// restored connects to the agent and tells it it was restored.
func (sb *Sandbox) restored(t *testing.T, hostname string) {
	t.Helper()
	sb.Connect(t)
	seed := make([]byte, 64)
	rand.Read(seed)
	if err := sb.Client.Restored(ctxFor(t, 10*time.Second), agentproto.Restored{Seed: seed, Hostname: hostname, TimeUnixNano: time.Now().UnixNano()}); err != nil {
		t.Fatalf("Restored: %v", err)
	}
}

func verbWorks(t *testing.T, rt runtime.Runtime, verb string) {
	t.Helper()
	c := rt.Probe(ctxFor(t, 2*time.Minute))
	if !c.Verbs[verb] {
		t.Skipf("%s does not work here: %s", verb, c.VerbReasons[verb])
	}
}

func testSuspend(t *testing.T, h Harness) {
	rt := h.New(t)
	sb := Start(t, h, rt, DefaultLimits)
	sus, ok := sb.Inst.(runtime.Suspender)
	if !ok {
		t.Skip("instances do not implement runtime.Suspender")
	}
	verbWorks(t, rt, api.OpSuspend)
	ctx := ctxFor(t, 3*time.Minute)
	if sus.Suspended() {
		t.Fatal("a fresh sandbox reports Suspended")
	}
	sb.MustSh(t, "echo on-disk > /root/before")
	sb.startMemProc(t)
	x0, n0 := sb.memState(t)
	// The sandbox has learnt the gateway's MAC before it is saved.
	sb.nicWorks(t, "before-suspend")

	// Without a quiesce the suspend must fail (or succeed, for a runtime
	// that needs none) and the sandbox keep serving.
	sb.quiesce(t)
	t0 := time.Now()
	if err := sus.Suspend(ctx); err != nil {
		t.Fatalf("Suspend: %v", err)
	}
	t.Logf("suspend %v", time.Since(t0).Round(time.Millisecond))
	if !sus.Suspended() || sb.Inst.Alive() {
		t.Fatalf("after Suspend: Suspended %v Alive %v", sus.Suspended(), sb.Inst.Alive())
	}
	if hp, ok := sb.Inst.(HostPider); ok && hp.Pid() != 0 {
		t.Fatalf("suspended sandbox has host pid %d", hp.Pid())
	}
	if st, err := sb.Inst.Stats(ctx); err != nil || st.Pids != 0 || st.MemoryBytes != 0 {
		t.Fatalf("suspended sandbox stats %+v %v", st, err)
	}
	if _, err := sb.Inst.DialAgent(ctx); err == nil {
		t.Fatal("DialAgent works on a suspended sandbox")
	}
	if err := sb.Inst.Start(ctx); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("Start of a suspended sandbox = %v, want conflict", err)
	}

	// A server restart: a new instance from Open sees the image.
	inst2, err := rt.Open(ctx, sb.Spec)
	if err != nil {
		t.Fatal(err)
	}
	sus2 := inst2.(runtime.Suspender)
	if !sus2.Suspended() || inst2.Alive() {
		t.Fatalf("reopened: Suspended %v Alive %v", sus2.Suspended(), inst2.Alive())
	}
	t0 = time.Now()
	if err := sus2.Restore(ctx); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	sb2 := &Sandbox{RT: rt, Inst: inst2, Spec: sb.Spec}
	sb2.restored(t, "")
	t.Logf("restore→agent healthy %v", time.Since(t0).Round(time.Millisecond))
	sb2.nicWorks(t, "after-restore")
	if sus2.Suspended() {
		t.Fatal("still Suspended after Restore")
	}
	if got := sb2.MustSh(t, "cat /root/before"); got != "on-disk\n" {
		t.Fatalf("file written before suspend: %q", got)
	}
	x1, n1 := sb2.memState(t)
	if x1 != x0 || n1 < n0 {
		t.Fatalf("memory state after restore %s %d, before %s %d", x1, n1, x0, n0)
	}
	time.Sleep(500 * time.Millisecond)
	if x2, n2 := sb2.memState(t); x2 != x0 || n2 <= n1 {
		t.Fatalf("the process does not go on after restore: %s %d then %s %d", x1, n1, x2, n2)
	}
	info, err := sb2.Client.Proc(ctx, "mem")
	if err != nil || !info.Running {
		t.Fatalf("agent's process record after restore: %+v %v", info, err)
	}
	// And once more, to show a restored sandbox suspends again.
	sb2.quiesce(t)
	if err := sus2.Suspend(ctx); err != nil {
		t.Fatalf("second Suspend: %v", err)
	}
	if err := sus2.Restore(ctx); err != nil {
		t.Fatalf("second Restore: %v", err)
	}
	sb2.restored(t, "")
	if x3, _ := sb2.memState(t); x3 != x0 {
		t.Fatalf("memory after a second restore: %s, want %s", x3, x0)
	}
	// Stop of a suspended sandbox discards its memory and keeps its disk.
	sb2.quiesce(t)
	if err := sus2.Suspend(ctx); err != nil {
		t.Fatalf("third Suspend: %v", err)
	}
	if err := inst2.Stop(ctx); err != nil {
		t.Fatalf("Stop of a suspended sandbox: %v", err)
	}
	if sus2.Suspended() {
		t.Fatal("Stop kept the memory image")
	}
	if err := inst2.Start(ctx); err != nil {
		t.Fatalf("Start after Stop of a suspended sandbox: %v", err)
	}
	sb2.Connect(t)
	if got := sb2.MustSh(t, "cat /root/before; cat /tmp/mem 2>/dev/null || echo no-mem"); got != "on-disk\nno-mem\n" {
		t.Fatalf("after Stop+Start: %q (want the disk, not the memory)", got)
	}
}

func testFork(t *testing.T, h Harness) {
	rt := h.New(t)
	parent := Start(t, h, rt, DefaultLimits)
	fk, ok := parent.Inst.(runtime.Forker)
	if !ok {
		t.Skip("instances do not implement runtime.Forker")
	}
	verbWorks(t, rt, api.OpFork)
	ctx := ctxFor(t, 3*time.Minute)
	parent.MustSh(t, "echo from-parent > /root/parent")
	parent.startMemProc(t)
	x0, _ := parent.memState(t)

	specs := []runtime.Spec{
		{ID: newID(), RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: DefaultLimits},
		{ID: newID(), RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: DefaultLimits},
	}
	for i := range specs {
		specs[i].Hostname = specs[i].ID
	}
	parent.quiesce(t)
	t0 := time.Now()
	kids, err := fk.Fork(ctx, specs)
	if err != nil {
		t.Fatalf("Fork: %v", err)
	}
	t.Logf("fork of %d: %v", len(kids), time.Since(t0).Round(time.Millisecond))
	for _, k := range kids {
		t.Cleanup(func() {
			if err := k.Destroy(context.Background()); err != nil {
				t.Errorf("Destroy child: %v", err)
			}
		})
	}
	if len(kids) != len(specs) {
		t.Fatalf("Fork made %d children, want %d", len(kids), len(specs))
	}
	if !parent.Inst.Alive() {
		t.Fatal("parent stopped by the fork")
	}
	parent.restored(t, "")
	sbs := []*Sandbox{parent}
	for i, k := range kids {
		if k.ID() != specs[i].ID {
			t.Fatalf("child %d has id %q, want %q", i, k.ID(), specs[i].ID)
		}
		sb := &Sandbox{RT: rt, Inst: k, Spec: specs[i]}
		sb.restored(t, specs[i].ID)
		sbs = append(sbs, sb)
	}
	for i, sb := range sbs {
		if got := sb.MustSh(t, "cat /root/parent"); got != "from-parent\n" {
			t.Fatalf("sandbox %d: parent's file = %q", i, got)
		}
		if x, _ := sb.memState(t); x != x0 {
			t.Fatalf("sandbox %d: in-memory value %s, parent had %s", i, x, x0)
		}
		if info, err := sb.Client.Proc(ctx, "mem"); err != nil || !info.Running {
			t.Fatalf("sandbox %d: process record %+v %v", i, info, err)
		}
		sb.MustSh(t, fmt.Sprintf("echo %d > /root/mine", i))
		// Each has a NIC of its own.
		sb.nicWorks(t, fmt.Sprintf("fork-%d", i))
	}
	randoms := map[string]int{}
	for i, sb := range sbs {
		if got := sb.MustSh(t, "cat /root/mine"); got != fmt.Sprintf("%d\n", i) {
			t.Fatalf("sandbox %d: its own file = %q: writes leak between forks", i, got)
		}
		r := strings.TrimSpace(sb.MustSh(t, "head -c16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
		if j, dup := randoms[r]; dup {
			t.Fatalf("sandboxes %d and %d read the same /dev/urandom bytes %s", j, i, r)
		}
		randoms[r] = i
	}
	for i, sb := range sbs[1:] {
		if got := strings.TrimSpace(sb.MustSh(t, "cat /etc/hostname")); got != specs[i].ID {
			t.Errorf("child %d: /etc/hostname = %q, want %q", i, got, specs[i].ID)
		}
	}
}
