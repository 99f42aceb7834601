package native_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/runtime/native/nsinit"
	"github.com/spacehq/space/internal/runtime/runtimetest"
	"github.com/spacehq/space/internal/testenv"
)

// shortTempDir keeps DataDir short: the agent socket path must fit in
// sockaddr_un, and t.TempDir paths include the (long) test name.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nt-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// testLogger shows the runtime's debug logs (phase timings) with -v and
// SPACE_TEST_DEBUG=1.
var testLogger = func() *slog.Logger {
	level := slog.LevelWarn
	if os.Getenv("SPACE_TEST_DEBUG") == "1" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}()

// sharedRootfs is one DataDir/rootfs cache for every subtest, so the
// template is uid-shifted once per test binary rather than once per runtime.
var sharedRootfs string

func harness(t *testing.T) runtimetest.Harness {
	testenv.RequireRoot(t)
	root := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	if sharedRootfs == "" {
		dir, err := os.MkdirTemp("", "nt-rootfs-")
		if err != nil {
			t.Fatal(err)
		}
		sharedRootfs = dir
	}
	return runtimetest.Harness{
		RootFS:         root,
		TemplateDigest: "sha256:base-bookworm-test",
		New: func(t *testing.T) runtime.Runtime {
			dir := shortTempDir(t)
			// Share the shifted rootfs across subtests through a symlink.
			if err := os.Symlink(sharedRootfs, filepath.Join(dir, "rootfs")); err != nil {
				t.Fatal(err)
			}
			rt, err := runtime.New(native.Name, runtime.Config{DataDir: dir, AgentBinary: agent, Logger: testLogger})
			if err != nil {
				t.Fatal(err)
			}
			// Release its spare disks (loop devices) with the test.
			t.Cleanup(func() { rt.(*native.Runtime).Close() })
			return rt
		},
	}
}

func TestMain(m *testing.M) {
	if os.Getenv("NATIVE_TEST_SERVER") == "1" {
		fakeServer()
		return
	}
	code := m.Run()
	if sharedRootfs != "" {
		os.RemoveAll(sharedRootfs)
	}
	os.Exit(code)
}

func TestConformance(t *testing.T) {
	runtimetest.Run(t, harness(t))
}

func TestProbe(t *testing.T) {
	h := harness(t)
	caps := h.New(t).Probe(context.Background())
	if !caps.Available {
		t.Fatalf("native unavailable: %s", caps.Reason)
	}
	if caps.Isolation != native.Isolation || caps.Strength <= 0 {
		t.Fatalf("caps %+v", caps)
	}
	for _, v := range []string{api.OpCreate, api.OpDelete, api.OpStop, api.OpStart, api.OpPause, api.OpResume, api.OpWake} {
		if !caps.Verbs[v] {
			t.Errorf("verb %s not offered", v)
		}
	}
	for _, v := range []string{api.OpSuspend, api.OpRestore, api.OpFork} {
		if caps.Verbs[v] || caps.VerbReasons[v] == "" {
			t.Errorf("verb %s: offered=%v reason=%q", v, caps.Verbs[v], caps.VerbReasons[v])
		}
	}
	if caps.Details["landlock_abi"] == "" || caps.Details["cgroup_version"] == "" || caps.Details["disk_prepare_ms"] == "" {
		t.Errorf("details %v", caps.Details)
	}
	t.Logf("probe: %+v", caps)
}

// TestReadopt is a server restart: a new Runtime on the same DataDir finds
// the running sandbox, can stop it, and refuses a pid file whose start time
// does not match (pid reuse).
func TestReadopt(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
	ctx := context.Background()
	hostPid := sb.Inst.(runtimetest.HostPider).Pid()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", hostPid))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(status), fmt.Sprintf("Uid:\t%d\t", confine.IDBase)) {
		t.Fatalf("sandbox root is not host uid %d:\n%s", confine.IDBase, status)
	}
	dataDir := filepath.Dir(filepath.Dir(sb.Inst.(interface{ Dir() string }).Dir()))
	rt2, err := runtime.New(native.Name, runtime.Config{DataDir: dataDir, AgentBinary: testenv.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	inst, err := rt2.Open(ctx, sb.Spec)
	if err != nil || !inst.Alive() || inst.(runtimetest.HostPider).Pid() != hostPid {
		t.Fatalf("re-adopt: %v alive=%v", err, inst != nil && inst.Alive())
	}
	re := &runtimetest.Sandbox{RT: rt2, Inst: inst, Spec: sb.Spec}
	re.Connect(t)
	re.MustSh(t, "true")
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sb.Inst.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("original handle's Exited did not fire when the re-adopted handle stopped it")
	}
	// A pid file naming a live but different process (our own pid, wrong
	// start time) must not be adopted.
	pidFile := filepath.Join(dataDir, "sandboxes", sb.Spec.ID, "init.pid")
	if err := os.WriteFile(pidFile, []byte(fmt.Sprintf("%d 1\n", os.Getpid())), 0o600); err != nil {
		t.Fatal(err)
	}
	inst, err = rt2.Open(ctx, sb.Spec)
	if err != nil || inst.Alive() {
		t.Fatalf("adopted a reused pid: %v alive=%v", err, inst.Alive())
	}
	if _, err := rt2.Open(ctx, runtime.Spec{ID: "sb-missing"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Open of a missing sandbox: %v", err)
	}
}

// TestSetupFailureReported: an error inside the sandbox init reaches Start
// as a clear error, quickly, and leaves nothing running.
func TestSetupFailureReported(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	spec := runtime.Spec{ID: "sb-badhost", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest,
		Limits: runtimetest.DefaultLimits, Hostname: strings.Repeat("h", 100)}
	ctx := context.Background()
	inst, err := rt.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(ctx)
	t0 := time.Now()
	err = inst.Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "sethostname") {
		t.Fatalf("Start with an invalid hostname: %v", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("failure took %v to report", d)
	}
	if inst.Alive() {
		t.Fatal("Alive after a failed Start")
	}
	for _, cg := range []string{"/sys/fs/cgroup/pids/space/" + spec.ID, "/sys/fs/cgroup/space/" + spec.ID} {
		if _, err := os.Stat(cg); err == nil {
			t.Errorf("cgroup %s left after a failed Start", cg)
		}
	}
	t.Logf("reported: %v", err)
}

// TestInsideView checks the native-specific parts of the sandbox's view.
func TestInsideView(t *testing.T) {
	h := harness(t)
	sb := runtimetest.Start(t, h, nil, runtimetest.DefaultLimits)
	// The cgroup namespace is rooted at the sandbox's own cgroup.
	for _, line := range strings.Split(strings.TrimSpace(sb.MustSh(t, "cat /proc/self/cgroup")), "\n") {
		if !strings.HasSuffix(line, ":/") {
			t.Errorf("cgroup path visible: %q", line)
		}
	}
	// The init confirmed the Landlock ABI it enforced (the host's log,
	// outside the sandbox).
	initLog, err := os.ReadFile(filepath.Join(sb.Inst.(interface{ Dir() string }).Dir(), "rw", "init.log"))
	if want := fmt.Sprintf("landlock ABI %d,", nsinit.LandlockABI()); err != nil || !strings.Contains(string(initLog), want) {
		t.Errorf("init.log %q (%v), want %q", initLog, err, want)
	}
	mounts := sb.MustSh(t, "cat /proc/mounts")
	// The layers are passed as descriptors: no host path shows, and the
	// data directory stays private to the host.
	dataDir := sb.RT.(interface{ DataDir() string }).DataDir()
	if strings.Contains(mounts, dataDir) {
		t.Errorf("host data dir %s visible in /proc/mounts", dataDir)
	}
	if fi, err := os.Stat(dataDir); err != nil || fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("data dir mode %v (%v), want private", fi.Mode().Perm(), err)
	}
	for _, want := range []string{"overlay / overlay", "proc /proc proc", "devpts /dev/pts devpts", " /sys "} {
		if !strings.Contains(mounts, want) {
			t.Errorf("mount %q missing:\n%s", want, mounts)
		}
	}
	for _, line := range strings.Split(mounts, "\n") {
		if f := strings.Fields(line); len(f) > 3 && (f[1] == "/sys" || f[1] == "/proc/sys") && !strings.HasPrefix(f[3], "ro") {
			t.Errorf("%s is not read-only: %s", f[1], line)
		}
	}
	if out := sb.MustSh(t, "ls /dev | tr '\\n' ' '"); !strings.Contains(out, "null") || strings.Contains(out, "sda") || strings.Contains(out, "vda") || strings.Contains(out, "kmsg") {
		t.Errorf("/dev has %q", out)
	}
	// Seccomp filter, no_new_privs and the reduced bounding set hold for
	// every process, the agent (pid 1) included.
	for _, pid := range []string{"self", "1"} {
		st := sb.MustSh(t, "grep -E '^(Seccomp|NoNewPrivs|CapBnd):' /proc/"+pid+"/status")
		if !strings.Contains(st, "Seccomp:\t2") || !strings.Contains(st, "NoNewPrivs:\t1") || !strings.Contains(st, fmt.Sprintf("CapBnd:\t%016x", confine.CapabilityMask())) {
			t.Errorf("/proc/%s/status: %q", pid, st)
		}
	}
	// The agent's listening socket does not leak into the processes it runs.
	if out := sb.MustSh(t, "ls -l /proc/self/fd/ | grep -c socket: || true"); strings.TrimSpace(out) != "0" {
		t.Errorf("a sandbox process holds %s sockets it did not open:\n%s", out, sb.MustSh(t, "ls -l /proc/self/fd/"))
	}
	// clone3 is ENOSYS so libc falls back to clone, whose flags are checked;
	// AF_NETLINK other than NETLINK_ROUTE is refused.
	res0 := sb.Exec(t, "python3", "-c", `
import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(435, None, 0); print("clone3", ctypes.get_errno())
socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close(); print("route ok")
try:
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)
except OSError as e:
    print("audit", e.errno)
`)
	if !strings.Contains(res0.Stdout, "clone3 38") || !strings.Contains(res0.Stdout, "route ok") || !strings.Contains(res0.Stdout, "audit 97") {
		t.Errorf("seccomp argument checks: %+v", res0)
	}
	// Everyday tools work under the filter and the dropped capabilities.
	sb.MustSh(t, `set -e
cd /tmp && git init -q repo && cd repo && git config user.email a@b && git config user.name a
echo hi > f && git add f && git commit -qm one && git log --oneline | grep -q one
python3 -m http.server 8080 --bind 127.0.0.1 >/dev/null 2>&1 & pid=$!
for i in $(seq 50); do curl -fsS http://127.0.0.1:8080/ >/dev/null 2>&1 && break; sleep 0.1; done
curl -fsS http://127.0.0.1:8080/ | grep -q f
kill $pid
top -bn1 >/dev/null && ps aux >/dev/null
tar czf /tmp/r.tgz -C /tmp repo && tar tzf /tmp/r.tgz | grep -q repo/f
useradd -m tester && su tester -c 'id -u' | grep -qv '^0$'
chown tester /tmp/r.tgz && chmod 600 /tmp/r.tgz
python3 -c "import multiprocessing as m; p = m.Pool(2); assert p.map(abs, [-1, -2]) == [1, 2]"
`)
	// no_new_privs: a set-uid root binary gives a user nothing.
	if out := sb.MustSh(t, "cp /usr/bin/id /tmp/suid-id && chmod 4755 /tmp/suid-id && su tester -c '/tmp/suid-id -u'"); out == "0\n" {
		t.Error("set-uid binary raised a user to root")
	}
	// x32 syscalls kill the caller.
	res := sb.Exec(t, "python3", "-c", "import ctypes; ctypes.CDLL(None).syscall(0x40000000 + 39)")
	if res.Signal != "SYS" {
		t.Errorf("x32 getpid: %+v, want SIGSYS", res)
	}
}

// TestStartLatency measures create+start+healthy and compares with a bare
// bwrap of the same root.
func TestStartLatency(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	runtimetest.Start(t, h, rt, runtimetest.DefaultLimits) // warm: shifted rootfs, agent copy
	var runs []time.Duration
	for i := 0; i < 5; i++ {
		t0 := time.Now()
		sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
		runs = append(runs, time.Since(t0))
		sb.Inst.Destroy(context.Background())
	}
	var bw []time.Duration
	if _, err := exec.LookPath("bwrap"); err == nil {
		for i := 0; i < 5; i++ {
			t0 := time.Now()
			out, err := exec.Command("bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", h.RootFS, "/", "/bin/true").CombinedOutput()
			if err != nil {
				t.Fatalf("bwrap: %v %s", err, out)
			}
			bw = append(bw, time.Since(t0))
		}
	}
	med := func(d []time.Duration) time.Duration {
		if len(d) == 0 {
			return 0
		}
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2]
	}
	t.Logf("create+start+agent healthy p50 %v (runs %v); bwrap /bin/true p50 %v", med(runs), runs, med(bw))
}

// fakeServer is a stand-in server process for TestSurvivesServerKill: it
// creates and starts one sandbox, says so, and waits to be killed.
func fakeServer() {
	rt, err := runtime.New(native.Name, runtime.Config{DataDir: os.Getenv("DATA_DIR"), AgentBinary: os.Getenv("AGENT")})
	if err == nil {
		var inst runtime.Instance
		inst, err = rt.Create(context.Background(), fakeServerSpec(os.Getenv("ROOTFS")))
		if err == nil {
			err = inst.Start(context.Background())
		}
	}
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("started")
	select {}
}

func fakeServerSpec(rootfs string) runtime.Spec {
	return runtime.Spec{ID: "sb-survivor", RootFS: rootfs, TemplateDigest: "sha256:base-bookworm-test", Limits: runtimetest.DefaultLimits}
}

// TestSurvivesServerKill: kill -9 of the server process that started a
// sandbox leaves the sandbox running, and a new server re-adopts it.
func TestSurvivesServerKill(t *testing.T) {
	h := harness(t)
	rt := h.New(t) // sets up a DataDir sharing the shifted rootfs
	caps := rt.Probe(context.Background())
	if !caps.Available {
		t.Fatal(caps.Reason)
	}
	dataDir := rt.(interface{ DataDir() string }).DataDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "NATIVE_TEST_SERVER=1", "DATA_DIR="+dataDir, "AGENT="+testenv.AgentBinary(t), "ROOTFS="+h.RootFS)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, _ := io.ReadAtLeast(out, buf, 1)
	if !strings.Contains(string(buf[:n]), "started") {
		cmd.Process.Kill()
		t.Fatalf("fake server: %s", buf[:n])
	}
	cmd.Process.Kill() // SIGKILL: no cleanup of any kind runs
	cmd.Wait()

	spec := fakeServerSpec(h.RootFS)
	inst, err := rt.Open(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.Destroy(context.Background()) })
	if !inst.Alive() {
		t.Fatal("sandbox died with the server that started it")
	}
	sb := &runtimetest.Sandbox{RT: rt, Inst: inst, Spec: spec}
	sb.Connect(t)
	if out := sb.MustSh(t, "echo still here"); out != "still here\n" {
		t.Fatalf("exec after server kill: %q", out)
	}
	// The orphaned init was reparented and its exit is still observed.
	if err := inst.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if inst.Alive() {
		t.Fatal("Alive after Stop")
	}
}

// TestConcurrentStarts creates and starts several sandboxes at once on one
// runtime (loop devices, cgroups, sockets, the shared template) and tears
// them down at once.
func TestConcurrentStarts(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	ctx := context.Background()
	const n = 4
	insts := make([]runtime.Instance, n)
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			spec := runtime.Spec{ID: fmt.Sprintf("sb-conc-%d", i), RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}
			inst, err := rt.Create(ctx, spec)
			if err == nil {
				insts[i] = inst
				err = inst.Start(ctx)
			}
			errs <- err
		}()
	}
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() {
		for _, inst := range insts {
			if inst != nil {
				inst.Destroy(ctx)
			}
		}
	})
	if t.Failed() {
		return
	}
	for i, inst := range insts {
		sb := &runtimetest.Sandbox{RT: rt, Inst: inst, Spec: runtime.Spec{ID: inst.ID()}}
		sb.Connect(t)
		if out := sb.MustSh(t, "hostname"); out != fmt.Sprintf("sb-conc-%d\n", i) {
			t.Errorf("sandbox %d hostname %q", i, out)
		}
	}
	for _, inst := range insts {
		go func() { errs <- inst.Destroy(ctx) }()
	}
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if removed, err := rt.Sweep(ctx, func(string) bool { return false }); err != nil || len(removed) != 0 {
		t.Fatalf("left behind: %v %v", removed, err)
	}
}

// TestNIC is the conformance suite's NIC subtest alone.
func TestNIC(t *testing.T) {
	runtimetest.NIC(t, harness(t))
}
