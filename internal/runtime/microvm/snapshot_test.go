package microvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/runtimetest"
)

// startIncoming starts QEMU for v waiting for a migration stream on state
// (inherited as descriptor 3).
func startIncoming(t *testing.T, v VM, state *os.File) *Process {
	t.Helper()
	v.IncomingFD = 3
	p, err := Launch(v, LaunchOptions{Incoming: state})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func readAll(t *testing.T, c *agentclient.Client, path string) string {
	t.Helper()
	r, err := c.ReadFile(ctxT(t, 20*time.Second), path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestRawSaveRestore is the raw QMP migrate/incoming baseline: a guest
// (initramfs only, the agent is its init) holds a token in tmpfs and a
// second agent process running; its state is saved through SaveState, its
// QEMU killed, and a new QEMU continues from the file: the token and the
// very same process are there. Sizes and times are logged.
func TestRawSaveRestore(t *testing.T) {
	k, initrd := requireBoot(t)
	dir := shortDir(t)
	vm := VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG, CPUs: 1, MemoryMiB: 256,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"),
		QMPSocket: filepath.Join(dir, "qmp.sock")}
	p, err := Start(vm)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	c, _, err := p.WaitHealthy(ctxT(t, 90*time.Second))
	if err != nil {
		t.Fatalf("health: %v", err)
	}
	tokenBytes := make([]byte, 16)
	rand.Read(tokenBytes)
	token := hex.EncodeToString(tokenBytes)
	ctx := ctxT(t, 3*time.Minute)
	if _, err := c.WriteFile(ctx, "/dev/shm/token", 0o600, strings.NewReader(token)); err != nil {
		t.Fatal(err)
	}
	inner, err := c.StartProc(ctx, agentproto.ProcStart{ID: "inner", Cmd: []string{"/init", "--socket", "/dev/shm/inner.sock"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Quiesce(ctx); err != nil {
		t.Fatal(err)
	}
	c.Close()

	q, err := DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	tq := time.Now()
	if ok, err := WaitAgentPortReleased(ctx, q, 5*time.Second); err != nil || !ok {
		t.Fatalf("the quiesced agent did not release its port: %v %v", ok, err)
	}
	t.Logf("agent port released %v after the host's close", time.Since(tq).Round(time.Millisecond))

	// A save whose file QEMU cannot write fails, and the guest runs on.
	ro, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := SaveState(ctx, q, ro); err == nil {
		t.Fatal("a save into a read-only descriptor succeeded")
	} else {
		t.Logf("failed save (expected): %v", err)
	}
	ro.Close()
	if st, err := q.Status(ctx); err != nil || st != "running" {
		t.Fatalf("after a failed save the guest is %q (%v), want running", st, err)
	}

	statePath := filepath.Join(dir, "vm.state")
	f, err := os.OpenFile(statePath, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	info, err := SaveState(ctx, q, f)
	if err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	f.Close()
	t.Logf("raw save: %.1f MiB in %v (pause %v, migrate %v, fsync %v) of a %d MiB guest",
		float64(info.Bytes)/(1<<20), time.Since(t0).Round(time.Millisecond), info.Pause.Round(time.Microsecond),
		info.Migrate.Round(time.Millisecond), info.Sync.Round(time.Millisecond), vm.MemoryMiB)
	if st, err := q.Status(ctx); err != nil || st != "postmigrate" {
		t.Fatalf("after the save the guest is %q (%v), want postmigrate", st, err)
	}
	q.Close()
	p.Kill()

	state, err := os.Open(statePath)
	if err != nil {
		t.Fatal(err)
	}
	defer state.Close()
	t1 := time.Now()
	p2 := startIncoming(t, vm, state)
	defer p2.Kill()
	q2, err := DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q2.Close()
	if err := WaitIncoming(ctx, q2, p2.Done()); err != nil {
		t.Fatalf("WaitIncoming: %v\n%s", err, p2.ConsoleTail(2048))
	}
	tLoaded := time.Since(t1)
	c2, h, err := p2.WaitHealthy(ctx)
	if err != nil {
		t.Fatalf("restored agent: %v", err)
	}
	defer c2.Close()
	t.Logf("raw restore: QEMU start→running %v, →agent health %v", tLoaded.Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
	if h.Pid != 1 {
		t.Errorf("restored agent pid %d", h.Pid)
	}
	if time.Since(t1) > 20*time.Second {
		t.Errorf("the restored agent took %v to answer (a stale session?)", time.Since(t1))
	}
	if got := readAll(t, c2, "/dev/shm/token"); got != token {
		t.Fatalf("tmpfs token after restore = %q, want %q", got, token)
	}
	pi, err := c2.Proc(ctx, "inner")
	if err != nil || !pi.Running || pi.Pid != inner.Pid {
		t.Fatalf("inner process after restore: %+v %v (was pid %d)", pi, err, inner.Pid)
	}
	// The guest goes on: a new process runs.
	if _, err := c2.StartProc(ctx, agentproto.ProcStart{ID: "after", Cmd: []string{"/init", "--socket", "/dev/shm/after.sock"}}); err != nil {
		t.Fatal(err)
	}
}

// TestRestoreOfBrokenState: a QEMU given a stream it cannot load ends, and
// WaitIncoming says so instead of waiting for its deadline.
func TestRestoreOfBrokenState(t *testing.T) {
	k, initrd := requireBoot(t)
	dir := shortDir(t)
	vm := VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG, CPUs: 1, MemoryMiB: 256,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"),
		QMPSocket: filepath.Join(dir, "qmp.sock")}
	bad := filepath.Join(dir, "bad.state")
	if err := os.WriteFile(bad, []byte("QEVM\x00\x00\x00\x03 not a migration stream"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := startIncoming(t, vm, f)
	defer p.Kill()
	ctx := ctxT(t, time.Minute)
	q, err := DialQMP(ctx, vm.QMPSocket)
	if err == nil {
		defer q.Close()
		err = WaitIncoming(ctx, q, p.Done())
	}
	if err == nil {
		t.Fatal("a broken state restored")
	}
	if ctx.Err() != nil {
		t.Fatalf("ran into the deadline: %v", err)
	}
	<-p.Done()
	t.Logf("broken state: %v; QEMU: %v", err, p.Err())
}

// startNamed creates and starts a sandbox of h's template with its own id
// and hostname, and connects to its agent.
func startNamed(t *testing.T, h runtimetest.Harness, r *Runtime, id string) (*runtimetest.Sandbox, time.Duration) {
	t.Helper()
	spec := runtime.Spec{ID: id, RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits, Hostname: id}
	ctx := ctxT(t, 3*time.Minute)
	inst, err := r.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create %s: %v", id, err)
	}
	t.Cleanup(func() {
		if err := inst.Destroy(context.Background()); err != nil {
			t.Errorf("Destroy %s: %v", id, err)
		}
	})
	t0 := time.Now()
	if err := inst.Start(ctx); err != nil {
		t.Fatalf("Start %s: %v", id, err)
	}
	took := time.Since(t0)
	sb := &runtimetest.Sandbox{RT: r, Inst: inst, Spec: spec}
	sb.Connect(t)
	return sb, took
}

func urandom(t *testing.T, sb *runtimetest.Sandbox) string {
	t.Helper()
	return strings.TrimSpace(sb.MustSh(t, "head -c16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
}

// guestClockSkew is the guest's clock minus the host's.
func guestClockSkew(t *testing.T, sb *runtimetest.Sandbox) time.Duration {
	t.Helper()
	before := time.Now()
	out := strings.TrimSpace(sb.MustSh(t, "date +%s%N"))
	after := time.Now()
	ns, err := strconv.ParseInt(out, 10, 64)
	if err != nil {
		t.Fatalf("date: %q", out)
	}
	mid := before.Add(after.Sub(before) / 2)
	return time.Unix(0, ns).Sub(mid)
}

type warmCounts struct{ builds, starts, broken int64 }

func readWarmStats() warmCounts {
	return warmCounts{WarmStats.Builds.Load(), WarmStats.Starts.Load(), WarmStats.Broken.Load()}
}

// TestWarmTemplate: the first sandbox of a kind boots cold and leaves a
// warm snapshot; the next ones start from it — each with its own
// hostname, entropy, disk and a current clock; a sandbox that ran boots
// cold on its next Start and keeps its disk; a broken snapshot is deleted
// and the create boots cold (and takes a new one); ForgetWarm removes a
// tree's snapshots.
func TestWarmTemplate(t *testing.T) {
	h := harness(t)
	r := h.New(t).(*Runtime)
	w0 := readWarmStats()

	one, coldTook := startNamed(t, h, r, "warm-one")
	if got := readWarmStats(); got.builds != w0.builds+1 || got.starts != w0.starts {
		t.Fatalf("after the first sandbox: %+v (before %+v), want one build and no warm start", got, w0)
	}
	treeDir, err := r.warmTreeDir(h.TemplateDigest)
	if err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(treeDir)
	if err != nil {
		t.Fatal(err)
	}
	var snaps []string
	for _, e := range ents {
		if e.IsDir() && !strings.HasPrefix(e.Name(), ".") {
			snaps = append(snaps, filepath.Join(treeDir, e.Name()))
		}
	}
	if len(snaps) != 1 || !warmComplete(snaps[0]) {
		t.Fatalf("warm snapshots: %v", snaps)
	}
	one.MustSh(t, "echo one > /root/one-file")
	// Long enough that a restored guest whose clock was not set would be
	// visibly behind.
	time.Sleep(4 * time.Second)

	two, warmTook := startNamed(t, h, r, "warm-two")
	three, _ := startNamed(t, h, r, "warm-three")
	if got := readWarmStats(); got.starts != w0.starts+2 || got.builds != w0.builds+1 {
		t.Fatalf("after three sandboxes: %+v (before %+v), want two warm starts", got, w0)
	}
	t.Logf("Start: cold %v, warm %v", coldTook.Round(time.Millisecond), warmTook.Round(time.Millisecond))
	for _, sb := range []*runtimetest.Sandbox{two, three} {
		id := sb.Spec.ID
		if got := strings.TrimSpace(sb.MustSh(t, "hostname; cat /etc/hostname")); got != id+"\n"+id {
			t.Errorf("%s: hostname and /etc/hostname %q", id, got)
		}
		// Nothing of the sandbox the snapshot was taken from.
		if got := sb.MustSh(t, "cat /proc/cmdline /etc/hosts"); strings.Contains(got, one.Spec.ID) {
			t.Errorf("%s: the warm snapshot's source sandbox shows through: %q", id, got)
		}
		if res := sb.Sh(t, "cat /root/one-file"); res.ExitCode == 0 {
			t.Errorf("%s sees a file written in warm-one: %q", id, res.Stdout)
		}
		if skew := guestClockSkew(t, sb); skew < -2*time.Second || skew > 2*time.Second {
			t.Errorf("%s: guest clock off by %v after a warm start", id, skew)
		}
		sb.MustSh(t, "echo "+id+" > /root/own")
	}
	if got := two.MustSh(t, "cat /root/own"); got != "warm-two\n" {
		t.Errorf("warm-two's own file: %q", got)
	}
	r1, r2, r3 := urandom(t, one), urandom(t, two), urandom(t, three)
	if r1 == r2 || r2 == r3 || r1 == r3 {
		t.Fatalf("/dev/urandom repeats across sandboxes: %s %s %s", r1, r2, r3)
	}
	if got := one.MustSh(t, "cat /root/one-file; cat /root/own 2>/dev/null || echo none"); got != "one\nnone\n" {
		t.Errorf("warm-one's disk after the warm starts: %q", got)
	}

	// A sandbox that ran boots cold again, on its own disk.
	ctx := ctxT(t, 3*time.Minute)
	two.MustSh(t, "sync")
	two.Client.Close()
	if err := two.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	before := readWarmStats()
	if err := two.Inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	two.Connect(t)
	if got := readWarmStats(); got != before {
		t.Errorf("restart of a sandbox that ran touched warm snapshots: %+v → %+v", before, got)
	}
	if got := two.MustSh(t, "cat /root/own"); got != "warm-two\n" {
		t.Errorf("warm-two after a restart: %q", got)
	}

	// A broken snapshot: deleted, the create boots cold and takes a new one.
	if err := os.Truncate(filepath.Join(snaps[0], stateName), 4096); err != nil {
		t.Fatal(err)
	}
	before = readWarmStats()
	four, _ := startNamed(t, h, r, "warm-four")
	got := readWarmStats()
	if got.broken != before.broken+1 || got.starts != before.starts || got.builds != before.builds+1 {
		t.Fatalf("create over a broken snapshot: %+v → %+v, want broken+1, no warm start, a new build", before, got)
	}
	if !warmComplete(snaps[0]) {
		t.Fatal("no new warm snapshot after the broken one")
	}
	if got := strings.TrimSpace(four.MustSh(t, "hostname")); got != "warm-four" {
		t.Errorf("cold fallback's hostname %q", got)
	}

	if err := r.ForgetWarm(h.TemplateDigest); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(treeDir); !os.IsNotExist(err) {
		t.Fatalf("ForgetWarm left %s: %v", treeDir, err)
	}
	if err := r.ForgetWarm("../x"); err == nil {
		t.Error("ForgetWarm of a bad digest succeeded")
	}
}

// TestSuspendClockAndForkRefusals: a sandbox restored after a while has
// the current time, not the time it was suspended at; a restore whose
// image QEMU refuses fails, leaves no QEMU and keeps the image; a fork
// refused for one child (duplicate or existing id) leaves no child behind
// and the parent running.
func TestSuspendClockAndForkRefusals(t *testing.T) {
	h := harness(t)
	r := h.New(t).(*Runtime)
	sb, _ := startNamed(t, h, r, "susp-clock")
	inst := sb.Inst.(*instance)
	ctx := ctxT(t, 3*time.Minute)

	// Fork refusals first, while it runs.
	other, _ := startNamed(t, h, r, "susp-other")
	other.Client.Close()
	sb.Client.Close()
	for name, kids := range map[string][]runtime.Spec{
		"duplicate": {{ID: "kid-a", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}, {ID: "kid-a", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}},
		"existing":  {{ID: "kid-b", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}, {ID: "susp-other", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}},
		"bad-host":  {{ID: "kid-c", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits, Hostname: "bad host"}},
	} {
		if _, err := inst.Fork(ctx, kids); err == nil {
			t.Fatalf("%s: Fork succeeded", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
		for _, k := range kids {
			if k.ID == "susp-other" {
				continue
			}
			if _, err := os.Stat(filepath.Join(r.sandboxesDir(), k.ID)); !os.IsNotExist(err) {
				t.Fatalf("%s: refused fork left child %s: %v", name, k.ID, err)
			}
		}
	}
	if !sb.Inst.Alive() || !other.Inst.Alive() {
		t.Fatal("a refused fork stopped a sandbox")
	}
	sb.Connect(t)

	// Suspend, wait, restore: the clock is set to now.
	if err := sb.Client.Quiesce(ctx); err != nil {
		t.Fatal(err)
	}
	sb.Client.Close()
	if err := inst.Suspend(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Second)

	// An image QEMU cannot load: Restore fails, nothing runs, the image
	// stays for another try.
	good, err := os.ReadFile(inst.files.stateFile())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(inst.files.stateFile(), good[:4096], 0o600); err != nil {
		t.Fatal(err)
	}
	if err := inst.Restore(ctx); err == nil {
		t.Fatal("Restore of a truncated image succeeded")
	} else {
		t.Logf("restore of a truncated image: %s", oneLine(err.Error(), 300))
	}
	if inst.Alive() || !inst.Suspended() {
		t.Fatalf("after a failed restore: alive %v suspended %v", inst.Alive(), inst.Suspended())
	}
	if err := os.WriteFile(inst.files.stateFile(), good, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := inst.Restore(ctx); err != nil {
		t.Fatal(err)
	}
	sb.Connect(t)
	if skew := guestClockSkew(t, sb); skew < -2*time.Second || skew > 2*time.Second {
		t.Errorf("guest clock off by %v after a restore 5 s later", skew)
	}
	if got := strings.TrimSpace(sb.MustSh(t, "hostname")); got != "susp-clock" {
		t.Errorf("hostname after restore %q", got)
	}
}

// TestWarmWaitsForABuild: a fresh sandbox whose kind's snapshot is being
// built by another (its lock held) waits for it, at most warmWait, and
// boots cold (errNoWarm) when none appears; with no build under way it
// does not wait at all. A sandbox that ran never starts warm.
func TestWarmWaitsForABuild(t *testing.T) {
	h := harness(t)
	r := h.New(t).(*Runtime)
	ctx := ctxT(t, 3*time.Minute)
	spec := runtime.Spec{ID: "warm-wait", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}
	inst, err := r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	i := inst.(*instance)
	_, treeDir, key, err := i.warm.target(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if err := i.warm.start(ctx); !errors.Is(err, errNoWarm) || time.Since(t0) > time.Second {
		t.Fatalf("no snapshot, no build: warm.start = %v after %v, want errNoWarm at once", err, time.Since(t0))
	}
	if err := os.MkdirAll(treeDir, 0o700); err != nil {
		t.Fatal(err)
	}
	lf, err := os.OpenFile(filepath.Join(treeDir, "."+key+".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if !lockBusy(lf.Name()) {
		t.Fatal("lockBusy does not see a held lock")
	}
	t0 = time.Now()
	if err := i.warm.start(ctx); !errors.Is(err, errNoWarm) {
		t.Fatalf("build under way that never finishes: warm.start = %v", err)
	}
	if d := time.Since(t0); d < warmWait || d > warmWait+3*time.Second {
		t.Fatalf("waited %v for a build, want about %v", d, warmWait)
	}
	// The build ends without a snapshot half-way through the wait.
	go func() {
		time.Sleep(warmWait / 4)
		unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	}()
	t0 = time.Now()
	if err := i.warm.start(ctx); !errors.Is(err, errNoWarm) || time.Since(t0) > warmWait*3/4 {
		t.Fatalf("build that ended: warm.start = %v after %v", err, time.Since(t0))
	}
	if err := i.warm.markBooted(); err != nil {
		t.Fatal(err)
	}
	if err := i.warm.start(ctx); !errors.Is(err, errNoWarm) {
		t.Fatalf("a sandbox that ran: warm.start = %v", err)
	}
	if i.Alive() {
		t.Fatal("warm.start left a QEMU")
	}
}
