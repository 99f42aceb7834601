package gvisor_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/gvisor"
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

// requireRunsc finds the runsc the setup script installs: locally a missing
// one skips, in CI (where setup ran) it fails.
func requireRunsc(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t)
	p := os.Getenv("SPACE_RUNSC")
	if p == "" {
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err == nil && strings.TrimSpace(string(out)) != "" {
			p = filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), "bin", "runsc")
		}
	}
	_, err := os.Stat(p)
	testenv.Require(t, "runsc", err == nil, "scripts/setup.sh builds bin/runsc ("+p+")")
}

// shortTempDir keeps DataDir short: the agent socket path must fit in
// sockaddr_un.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gv-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("test DataDir left behind: %v", err)
		}
	})
	return dir
}

func newRuntime(t *testing.T, agent string) runtime.Runtime {
	t.Helper()
	rt, err := runtime.New(gvisor.Name, runtime.Config{DataDir: shortTempDir(t), AgentBinary: agent, Logger: testLogger})
	if err != nil {
		t.Fatal(err)
	}
	closeWithTest(t, rt)
	return rt
}

// closeWithTest releases runsc's runtime-wide mount before the test's
// DataDir is removed (cleanups run last-registered first).
func closeWithTest(t *testing.T, rt runtime.Runtime) {
	t.Cleanup(func() {
		if err := rt.(io.Closer).Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
}

func harness(t *testing.T) runtimetest.Harness {
	requireRunsc(t)
	root := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	return runtimetest.Harness{
		RootFS:         root,
		TemplateDigest: "sha256:base-bookworm-test",
		New:            func(t *testing.T) runtime.Runtime { return newRuntime(t, agent) },
	}
}

// TestConformance runs the shared suite unchanged: every subtest, the
// memory and fork-bomb limits included (ginit's memory guard, limits.go).
func TestConformance(t *testing.T) {
	runtimetest.Run(t, harness(t))
}

func TestProbe(t *testing.T) {
	requireRunsc(t)
	rt := newRuntime(t, testenv.AgentBinary(t))
	c := rt.Probe(context.Background())
	if !c.Available {
		t.Fatalf("probe: not available: %s", c.Reason)
	}
	if c.Details["runsc_version"] != gvisor.RunscVersion {
		t.Errorf("runsc_version %q, want the pinned %q", c.Details["runsc_version"], gvisor.RunscVersion)
	}
	if c.Details["platform"] != "systrap" || !strings.HasPrefix(c.Isolation, "gvisor(systrap)") {
		t.Errorf("platform %q isolation %q", c.Details["platform"], c.Isolation)
	}
	// Above native (10): auto prefers the user-space kernel where it works.
	if c.Strength <= 10 {
		t.Errorf("strength %d: must rank above native's 10 for auto", c.Strength)
	}
	t.Logf("probe: %+v", c)

	// A runtime whose agent binary is missing is unavailable, with the reason.
	bad, err := runtime.New(gvisor.Name, runtime.Config{DataDir: shortTempDir(t), AgentBinary: "/nonexistent/space-agent", Logger: testLogger})
	if err != nil {
		t.Fatal(err)
	}
	closeWithTest(t, bad)
	if c := bad.Probe(context.Background()); c.Available || !strings.Contains(c.Reason, "agent") {
		t.Errorf("probe with a missing agent: available=%v reason %q", c.Available, c.Reason)
	}
}

// TestProbeKeptForBoot: a second runtime on the same DataDir (a restarted
// server) takes the first one's successful probe instead of starting a
// sandbox again; a changed agent binary probes anew.
func TestProbeKeptForBoot(t *testing.T) {
	requireRunsc(t)
	dir := shortTempDir(t)
	agent := filepath.Join(dir, "space-agent")
	data, err := os.ReadFile(testenv.AgentBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(agent, data, 0o755); err != nil {
		t.Fatal(err)
	}
	mk := func() runtime.Runtime {
		rt, err := runtime.New(gvisor.Name, runtime.Config{DataDir: dir, AgentBinary: agent, Logger: testLogger})
		if err != nil {
			t.Fatal(err)
		}
		closeWithTest(t, rt)
		return rt
	}
	t0 := time.Now()
	first := mk().Probe(context.Background())
	if !first.Available || first.Details["probe_cached"] != "" {
		t.Fatalf("first probe: %+v", first)
	}
	t.Logf("probe %v", time.Since(t0))
	t0 = time.Now()
	second := mk().Probe(context.Background())
	if !second.Available || second.Details["probe_cached"] != "true" || second.Strength != first.Strength ||
		second.Details["probe_run_ms"] != first.Details["probe_run_ms"] {
		t.Fatalf("second probe was not the kept one: %+v", second)
	}
	if d := time.Since(t0); d > 200*time.Millisecond {
		t.Errorf("kept probe took %v", d)
	} else {
		t.Logf("kept probe %v", d)
	}
	// Another agent binary (same content, new mtime) is probed again.
	time.Sleep(10 * time.Millisecond)
	if err := os.Chtimes(agent, time.Now(), time.Now()); err != nil {
		t.Fatal(err)
	}
	if third := mk().Probe(context.Background()); !third.Available || third.Details["probe_cached"] != "" {
		t.Fatalf("probe after the agent changed: %+v", third)
	}
}

// TestLongDataDir: a DataDir whose agent socket path is far longer than a
// sockaddr_un holds (the e2e crash test's was 108 bytes) still probes and
// runs sandboxes: the gofer binds at its own short path, and the host
// dials through an O_PATH descriptor.
func TestLongDataDir(t *testing.T) {
	h := harness(t)
	dir := filepath.Join(shortTempDir(t), strings.Repeat("d", 150))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	rt, err := runtime.New(gvisor.Name, runtime.Config{DataDir: dir, AgentBinary: testenv.AgentBinary(t), Logger: testLogger})
	if err != nil {
		t.Fatal(err)
	}
	closeWithTest(t, rt)
	if c := rt.Probe(context.Background()); !c.Available || !c.Verbs[api.OpSuspend] {
		t.Fatalf("probe with a %d-byte DataDir: %+v", len(dir), c)
	}
	sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
	if out := sb.MustSh(t, "echo ok"); out != "ok\n" {
		t.Fatalf("exec: %q", out)
	}
}

// TestSweepAfterRestart: a "restarted server" (a new runtime on the same
// DataDir) re-adopts a running sandbox, and Sweep removes one nobody keeps
// (its runsc container, cgroups, mounts and directory), also when it is
// paused.
func TestSweepAfterRestart(t *testing.T) {
	h := harness(t)
	dir := shortTempDir(t)
	agent := testenv.AgentBinary(t)
	mk := func() runtime.Runtime {
		rt, err := runtime.New(gvisor.Name, runtime.Config{DataDir: dir, AgentBinary: agent, Logger: testLogger})
		if err != nil {
			t.Fatal(err)
		}
		closeWithTest(t, rt)
		return rt
	}
	rt1 := mk()
	sb := runtimetest.Start(t, h, rt1, runtimetest.DefaultLimits)
	if err := sb.Inst.(runtime.Pauser).Pause(context.Background()); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	rt2 := mk()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	inst, err := rt2.Open(ctx, sb.Spec)
	if err != nil || !inst.Alive() {
		t.Fatalf("Open after restart: %v alive=%v", err, err == nil && inst.Alive())
	}
	removed, err := rt2.Sweep(ctx, func(string) bool { return false })
	if err != nil || len(removed) != 1 || removed[0] != sb.Spec.ID {
		t.Fatalf("Sweep: %v, %v", removed, err)
	}
	select {
	case <-inst.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("swept sandbox still running")
	}
	if _, err := rt2.Open(ctx, sb.Spec); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Open after Sweep: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "sandboxes")); len(ents) != 0 {
		t.Fatalf("sandboxes left: %v", ents)
	}
	if _, err := os.Stat(filepath.Join("/sys/fs/cgroup/memory/space-gvisor", sb.Spec.ID)); err == nil {
		t.Fatal("cgroup left behind")
	}
	// Nothing stays mounted below DataDir, not even runsc's own state (a
	// killed server must leave a removable directory).
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), " "+dir+"/") {
		t.Fatalf("mounts left below %s", dir)
	}
}

// TestDialRefusesPlantedSocket: the agent's socket lives in a host
// directory of the sandbox. No sandbox process can reach it (the agent
// covers it in its mount namespace, confine.HideChannel; the conformance
// suite's channel probe checks every other way in), and whatever else came
// to plant something in its place — a symlink to a host socket — the host
// still must not dial through it.
func TestDialRefusesPlantedSocket(t *testing.T) {
	h := harness(t)
	dataDir := shortTempDir(t)
	rt, err := runtime.New(gvisor.Name, runtime.Config{DataDir: dataDir, AgentBinary: testenv.AgentBinary(t), Logger: testLogger})
	if err != nil {
		t.Fatal(err)
	}
	closeWithTest(t, rt)
	sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Sandbox root sees an empty, read-only directory.
	for _, cmd := range []string{"test -e /run/space/agent.sock", "mv /run/space/agent.sock /run/space/moved.sock", "ln -s /tmp /run/space/agent.sock", "test -e /run/space/space-agent"} {
		if res := sb.Sh(t, cmd); res.ExitCode == 0 {
			t.Errorf("%q succeeded inside the sandbox", cmd)
		}
	}
	// A host socket the host must never be made to talk to.
	hostDir := shortTempDir(t)
	hostSock := filepath.Join(hostDir, "host.sock")
	ln, err := net.Listen("unix", hostSock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- struct{}{}
			c.Close()
		}
	}()
	agentDir := filepath.Join(dataDir, "sandboxes", sb.Spec.ID, "agent")
	sock, moved := filepath.Join(agentDir, "agent.sock"), filepath.Join(agentDir, "moved.sock")
	if err := os.Rename(sock, moved); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(hostSock, sock); err != nil {
		t.Fatal(err)
	}
	if c, err := sb.Inst.DialAgent(ctx); err == nil {
		c.Close()
		t.Fatal("DialAgent followed a planted symlink")
	}
	select {
	case <-accepted:
		t.Fatal("the host socket behind the planted symlink was dialled")
	case <-time.After(200 * time.Millisecond):
	}
	// The existing connection still works; put things back.
	if got := sb.MustSh(t, "echo alive"); got != "alive\n" {
		t.Fatalf("exec: %q", got)
	}
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(moved, sock); err != nil {
		t.Fatal(err)
	}
	c, err := sb.Inst.DialAgent(ctx)
	if err != nil {
		t.Fatalf("DialAgent after restoring the socket: %v", err)
	}
	c.Close()
}

// TestStartErrorIsRunscs: a runsc failure comes back promptly with runsc's
// own message, and leaves nothing running or mounted.
func TestStartErrorIsRunscs(t *testing.T) {
	h := harness(t)
	// The runtime's agent is a copy that disappears between two starts:
	// the second fails inside runsc (the sandbox cannot mount it).
	agent := filepath.Join(shortTempDir(t), "space-agent")
	data, err := os.ReadFile(testenv.AgentBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(agent, data, 0o755); err != nil {
		t.Fatal(err)
	}
	rt := newRuntime(t, agent)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	inst, err := rt.Create(ctx, runtime.Spec{ID: "sb-err", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.Destroy(context.Background()) })
	if err := inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	os.Remove(agent)
	t0 := time.Now()
	err = inst.Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "runsc run: ") || errors.Is(err, errdefs.ErrTimeout) || time.Since(t0) > 30*time.Second {
		t.Fatalf("Start without its agent binary: %v, want runsc's own message, promptly", err)
	}
	t.Logf("after %v: %v", time.Since(t0).Round(time.Millisecond), err)
	if inst.Alive() {
		t.Fatal("Alive after a failed Start")
	}
	if err := inst.Destroy(ctx); err != nil {
		t.Fatalf("Destroy: %v", err)
	}
}

// TestStartAfterCrash: a sandbox whose agent died on its own starts again
// without a Stop in between (runsc still knows the dead container), with
// its files.
func TestStartAfterCrash(t *testing.T) {
	h := harness(t)
	sb := runtimetest.Start(t, h, nil, runtimetest.DefaultLimits)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sb.MustSh(t, "echo kept > /root/kept")
	// The agent is PID 1 of its namespace: SIGABRT is the signal it dies of.
	sb.Client.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"/bin/sh", "-c", "kill -ABRT 1"}, TimeoutSeconds: 5})
	select {
	case <-sb.Inst.Exited():
	case <-time.After(15 * time.Second):
		t.Fatal("Exited did not fire")
	}
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatalf("Start after a crash: %v", err)
	}
	sb.Connect(t)
	if out := sb.MustSh(t, "cat /root/kept"); out != "kept\n" {
		t.Fatalf("after the restart /root/kept reads %q", out)
	}
}

// TestNIC is the conformance suite's NIC subtest alone.
func TestNIC(t *testing.T) {
	runtimetest.NIC(t, harness(t))
}
