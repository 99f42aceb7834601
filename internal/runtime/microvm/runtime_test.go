package microvm

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostproc"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
	"github.com/spacehq/space/internal/runtime/runtimetest"
	"github.com/spacehq/space/internal/testenv"
)

var testLogger = func() *slog.Logger {
	level := slog.LevelWarn
	if os.Getenv("SPACE_TEST_DEBUG") == "1" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}()

// requireRuntime gates the runtime's tests: root, QEMU, the guest kernel
// and erofs-utils (skipped locally, failed in CI where setup installs
// them).
func requireRuntime(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := exec.LookPath(DefaultQEMU)
	testenv.Require(t, "qemu", err == nil, "install qemu-system-x86 (scripts/setup.sh)")
	_, err = FindKernel(testenv.CacheDir())
	testenv.Require(t, "microvm-kernel", err == nil, "scripts/setup.sh unpacks the guest kernel: "+errString(err))
	_, err = exec.LookPath(DefaultMkfsErofs)
	testenv.Require(t, "erofs-utils", err == nil, "install erofs-utils (scripts/setup.sh)")
}

// sharedImages keeps the base tree's root image (164 MiB, ~2 s to build)
// for every runtime of the test binary instead of one per DataDir.
var sharedImages struct {
	once sync.Once
	dir  string
}

func imagesDir(t *testing.T) string {
	sharedImages.once.Do(func() {
		d, err := os.MkdirTemp("", "mvm-images-")
		if err != nil {
			t.Fatal(err)
		}
		sharedImages.dir = d
	})
	return sharedImages.dir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedImages.dir != "" {
		os.RemoveAll(sharedImages.dir)
	}
	os.Exit(code)
}

// newTestRuntime is a runtime with a DataDir of its own (short: QEMU's
// unix sockets live below it) and the shared image cache.
func newTestRuntime(t *testing.T, agent string) *Runtime {
	t.Helper()
	dir := shortDir(t)
	rt, err := runtime.New(Name, runtime.Config{DataDir: dir, AgentBinary: agent, JailBinary: testenv.JailBinary(t), Logger: testLogger})
	if err != nil {
		t.Fatal(err)
	}
	r := rt.(*Runtime)
	r.images.Dir = imagesDir(t)
	t.Cleanup(func() {
		// Every sandbox was destroyed: a sweep finds nothing.
		if removed, err := r.Sweep(context.Background(), func(string) bool { return false }); err != nil || len(removed) > 0 {
			t.Errorf("sandboxes left behind: %v (%v)", removed, err)
		}
	})
	return r
}

func harness(t *testing.T) runtimetest.Harness {
	requireRuntime(t)
	root := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	return runtimetest.Harness{
		RootFS:         root,
		TemplateDigest: "sha256:base-bookworm-test",
		New:            func(t *testing.T) runtime.Runtime { return newTestRuntime(t, agent) },
	}
}

// TestConformance runs the shared suite unchanged under TCG. Run it alone
// (go test -p 1 -run TestConformance): every sandbox is a TCG guest.
func TestConformance(t *testing.T) {
	h := harness(t)
	start := time.Now()
	defer func() { t.Logf("conformance suite took %v", time.Since(start).Round(time.Second)) }()
	runtimetest.Run(t, h)
}

// TestProbe: available here, TCG (no usable KVM on these hosts), the
// details space info shows, and a second runtime reuses the result.
func TestProbe(t *testing.T) {
	requireRuntime(t)
	agent := testenv.AgentBinary(t)
	r := newTestRuntime(t, agent)
	c := r.Probe(context.Background())
	if !c.Available {
		t.Fatalf("probe: not available: %s", c.Reason)
	}
	t.Logf("probe: %+v", c)
	for _, k := range []string{"accel", "qemu_version", "kernel_release"} {
		if c.Details[k] == "" {
			t.Errorf("Details[%q] is empty", k)
		}
	}
	switch c.Details["accel"] {
	case AccelTCG:
		if c.Strength != strengthTCG || c.Isolation != "microvm/tcg" || c.Details["kvm_reason"] == "" {
			t.Errorf("tcg probe: strength %d isolation %q kvm_reason %q", c.Strength, c.Isolation, c.Details["kvm_reason"])
		}
		if c.Strength >= 20 {
			t.Errorf("a TCG microvm (strength %d) must rank below gvisor (20)", c.Strength)
		}
	case AccelKVM:
		if c.Strength != strengthKVM || c.Isolation != "microvm/kvm" {
			t.Errorf("kvm probe: strength %d isolation %q", c.Strength, c.Isolation)
		}
	default:
		t.Errorf("accel %q", c.Details["accel"])
	}
	if c.Details["probe_cached"] == "" && c.Details["boot_ms"] == "" {
		t.Error("a measured probe has no boot_ms")
	}
	// The snapshot verbs are offered because the probe's guest really was
	// suspended and restored, not because the type has the methods.
	for _, v := range []string{api.OpSuspend, api.OpRestore, api.OpWake, api.OpFork} {
		if c.Verbs[v] != (c.Details["probe_suspend_restore_ms"] != "") {
			t.Errorf("verb %s = %v, but probe_suspend_restore_ms = %q (snapshot_error %q)", v, c.Verbs[v], c.Details["probe_suspend_restore_ms"], c.Details["snapshot_error"])
		}
	}
	for _, v := range []string{api.OpCreate, api.OpStart, api.OpStop, api.OpPause, api.OpResume} {
		if !c.Verbs[v] {
			t.Errorf("verb %s: %s", v, c.VerbReasons[v])
		}
	}
	r2 := newTestRuntime(t, agent)
	t0 := time.Now()
	c2 := r2.Probe(context.Background())
	if !c2.Available || c2.Details["probe_cached"] != "true" || time.Since(t0) > 2*time.Second {
		t.Errorf("second runtime's probe: available %v cached %q in %v", c2.Available, c2.Details["probe_cached"], time.Since(t0))
	}
}

// TestCreateRollbackAndRefusals: a Create that fails leaves nothing, and
// bad specs are refused before anything is made.
func TestCreateRollbackAndRefusals(t *testing.T) {
	requireRuntime(t)
	r := newTestRuntime(t, testenv.AgentBinary(t))
	ctx := context.Background()
	tree := t.TempDir()
	good := runtime.Spec{ID: "sb-rollback", RootFS: tree, TemplateDigest: "sha256:rollback", Limits: runtimetest.DefaultLimits}
	for name, mut := range map[string]func(*runtime.Spec){
		"id":       func(s *runtime.Spec) { s.ID = "../x" },
		"limits":   func(s *runtime.Spec) { s.Limits.DiskMiB = 0 },
		"rootfs":   func(s *runtime.Spec) { s.RootFS = filepath.Join(tree, "missing") },
		"hostname": func(s *runtime.Spec) { s.Hostname = "bad host" },
	} {
		s := good
		mut(&s)
		if _, err := r.Create(ctx, s); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: Create = %v, want invalid argument", name, err)
		}
	}
	// An image that cannot be built (a digest that is no file name):
	// the sandbox directory made before it is gone.
	s := good
	s.TemplateDigest = "../../etc"
	if _, err := r.Create(ctx, s); err == nil {
		t.Fatal("Create with a bad digest succeeded")
	}
	if _, err := os.Stat(filepath.Join(r.sandboxesDir(), s.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed Create left its directory: %v", err)
	}
	// A disk too small for mkfs.ext4 fails after the image was built.
	s = good
	s.Limits.DiskMiB = 1 << 40
	if _, err := r.Create(ctx, s); err == nil {
		t.Fatal("Create with a 1 EiB disk succeeded")
	}
	if ents, _ := os.ReadDir(r.sandboxesDir()); len(ents) != 0 {
		t.Fatalf("failed Creates left %d directories", len(ents))
	}
	inst, err := r.Create(ctx, good)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Create(ctx, good); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("second Create of one id = %v, want conflict", err)
	}
	if err := inst.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestExitReasonAndWatchdog: Open re-adopts a live QEMU by pid and start
// time only; Stop keeps unsynced writes; a guest that stops answering is
// killed by the watchdog and reported hung, and a dead VM's DialAgent says
// why, with the console's tail.
func TestExitReasonAndWatchdog(t *testing.T) {
	h := harness(t)
	r := h.New(t).(*Runtime)
	sb := runtimetest.Start(t, h, r, runtimetest.DefaultLimits)
	i := sb.Inst.(*instance)
	ctx := context.Background()

	// Re-adoption: a second instance value finds the same QEMU.
	inst2, err := r.Open(ctx, sb.Spec)
	if err != nil {
		t.Fatal(err)
	}
	if p := inst2.(*instance).Pid(); p == 0 || p != i.Pid() {
		t.Fatalf("Open adopted pid %d, running %d", p, i.Pid())
	}
	// A recycled pid is not adopted: the start time must match.
	rec, err := hostproc.ReadPidFile(i.files.pidFile())
	if err != nil {
		t.Fatal(err)
	}
	if err := hostproc.WritePidFile(i.files.pidFile(), hostproc.Record{Pid: rec.Pid, StartTime: rec.StartTime + 1}); err != nil {
		t.Fatal(err)
	}
	if inst3, err := r.Open(ctx, sb.Spec); err != nil || inst3.Alive() {
		t.Fatalf("Open with a wrong start time: alive %v, %v", inst3 != nil && inst3.Alive(), err)
	}
	if err := hostproc.WritePidFile(i.files.pidFile(), rec); err != nil {
		t.Fatal(err)
	}

	// Stop keeps what the sandbox wrote without syncing, also when paused
	// (the guest flushes its page cache before QEMU is killed).
	sb.MustSh(t, "echo unsynced > /root/unsynced")
	if _, err := sb.Inst.Stats(ctx); err != nil {
		t.Fatal(err)
	}
	if err := i.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	// A paused guest cannot answer; Stats does not wait for it.
	sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	pst, err := sb.Inst.Stats(sctx)
	cancel()
	if err != nil || pst.Pids < 1 || pst.CPUNanos <= 0 {
		t.Fatalf("Stats of a paused sandbox: %+v %v", pst, err)
	}
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	sb.Connect(t)
	if got := sb.MustSh(t, "cat /root/unsynced"); got != "unsynced\n" {
		t.Fatalf("a write before Stop reads %q after Start", got)
	}
	if st, err := sb.Inst.Stats(ctx); err != nil || st.CPUNanos <= 0 || st.Pids < 1 {
		t.Fatalf("Stats: %+v %v", st, err)
	}

	// Freeze QEMU itself (not a pause the runtime made): the guest stops
	// answering and the watchdog must end it.
	if err := unix.Kill(i.Pid(), unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	deadline := watchdogHang + (watchdogInterval+watchdogTimeout)*time.Duration(watchdogMisses) + 10*time.Second
	select {
	case <-sb.Inst.Exited():
	case <-time.After(deadline):
		t.Fatalf("watchdog did not end a frozen guest within %v", deadline)
	}
	why := i.ExitReason()
	if !strings.Contains(why, "hung") || !strings.Contains(why, "console:") {
		t.Fatalf("ExitReason %q", why)
	}
	if _, err := sb.Inst.DialAgent(ctx); err == nil || !strings.Contains(err.Error(), "hung") {
		t.Fatalf("DialAgent of the dead VM: %v", err)
	}
	t.Logf("exit reason: %s", oneLine(why, 300))

	// A QEMU that dies (the host's OOM killer; QEMU is PID 1 of its pid
	// namespace, so only SIGKILL reaches it from outside) is reported so.
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if i.ExitReason() != "" {
		t.Errorf("a running sandbox has an exit reason: %q", i.ExitReason())
	}
	if err := unix.Kill(i.Pid(), unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sb.Inst.Exited():
	case <-time.After(30 * time.Second):
		t.Fatal("Exited did not fire after QEMU crashed")
	}
	if why := i.ExitReason(); !strings.Contains(why, "QEMU failed") || !strings.Contains(why, "killed") {
		t.Fatalf("ExitReason after a QEMU crash: %q", why)
	}
}

// TestSweepOrphanQEMU: a QEMU the pid file does not name (a server killed
// between QEMU's start and the pid file) is found by its command line and
// killed with its jail's cgroup when Sweep removes the sandbox.
func TestSweepOrphanQEMU(t *testing.T) {
	h := harness(t)
	r := h.New(t).(*Runtime)
	ctx := context.Background()
	spec := runtime.Spec{ID: "sb-orphan-" + strconv.FormatInt(time.Now().UnixNano()%1e6, 36), RootFS: h.RootFS,
		TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits, Hostname: "orphan"}
	inst, err := r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.Start(ctx); err != nil {
		inst.Destroy(ctx)
		t.Fatal(err)
	}
	pid := inst.(*instance).Pid()
	if err := os.Remove(inst.(*instance).files.pidFile()); err != nil {
		t.Fatal(err)
	}
	if reopened, err := r.Open(ctx, spec); err != nil || reopened.Alive() {
		t.Fatalf("Open without a pid file: alive %v, %v", reopened != nil && reopened.Alive(), err)
	}
	removed, err := r.Sweep(ctx, func(string) bool { return false })
	if err != nil || len(removed) != 1 || removed[0] != spec.ID {
		t.Fatalf("Sweep removed %v (%v)", removed, err)
	}
	select {
	case <-inst.Exited():
	case <-time.After(10 * time.Second):
		t.Fatalf("orphan QEMU %d still runs after Sweep", pid)
	}
	for _, id := range jail.CgroupIDs() {
		if id == spec.ID {
			t.Errorf("the jail's cgroup %s is left", id)
		}
	}
	if _, err := os.Stat(filepath.Join(r.sandboxesDir(), spec.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sandbox directory left: %v", err)
	}
}
