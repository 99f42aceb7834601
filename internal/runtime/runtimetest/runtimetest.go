// Package runtimetest is the conformance suite every runtime must pass: a
// runtime is done when Run passes on it. It drives the runtime only through
// the runtime interfaces and the agent through internal/agentclient, so the
// same suite holds every backend to the same guarantees: lifecycle, exec,
// PTY sessions, file confinement, limits, isolation probes, pause, and
// crash cleanup, the agent's channel out of reach of sandbox root;
// suspend/restore and fork where a runtime implements them.
package runtimetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// Harness describes the runtime under test.
type Harness struct {
	// New returns a fresh runtime (its own DataDir) for one subtest.
	New func(t *testing.T) runtime.Runtime
	// RootFS is the template root (a Debian base with python3, procps,
	// curl, git) and TemplateDigest its digest.
	RootFS         string
	TemplateDigest string
}

// HostPider is implemented by instances whose sandbox init is a host
// process; the suite then checks from the host that it is unprivileged.
type HostPider interface {
	Pid() int
}

// DefaultLimits are small enough to test the limits quickly.
var DefaultLimits = api.Limits{CPUs: 1, MemoryMiB: 256, Pids: 256, DiskMiB: 256}

// Run runs every conformance subtest against h.
func Run(t *testing.T, h Harness) {
	// Templates are shared and content-addressed: no runtime may change the
	// tree it is given (not even by creating mount points in it).
	before := treeListing(t, h.RootFS)
	defer func() {
		if after := treeListing(t, h.RootFS); after != before {
			t.Errorf("the runtime changed its template tree %s (entries, modes, sizes or times differ)", h.RootFS)
		}
	}()
	t.Run("lifecycle", func(t *testing.T) { testLifecycle(t, h) })
	t.Run("exec", func(t *testing.T) { testExec(t, h) })
	t.Run("pty", func(t *testing.T) { testPTY(t, h) })
	t.Run("files", func(t *testing.T) { testFiles(t, h) })
	t.Run("limits", func(t *testing.T) { testLimits(t, h) })
	t.Run("isolation", func(t *testing.T) { testIsolation(t, h) })
	t.Run("channel", func(t *testing.T) { testChannel(t, h) })
	t.Run("pause", func(t *testing.T) { testPause(t, h) })
	t.Run("crash", func(t *testing.T) { testCrash(t, h) })
	// Optional: skipped where the runtime does not implement them.
	t.Run("suspend", func(t *testing.T) { testSuspend(t, h) })
	t.Run("fork", func(t *testing.T) { testFork(t, h) })
	t.Run("nic", func(t *testing.T) { testNIC(t, h) })
}

// NIC runs the conformance suite's NIC subtest alone.
func NIC(t *testing.T, h Harness) { testNIC(t, h) }

// Sandbox is one started instance and a client for its agent.
type Sandbox struct {
	RT     runtime.Runtime
	Inst   runtime.Instance
	Spec   runtime.Spec
	Client *agentclient.Client
}

func newID() string {
	b := make([]byte, 5)
	rand.Read(b)
	return "sb-" + hex.EncodeToString(b)
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// Start creates and starts a sandbox on rt (a new runtime from h when nil)
// and waits for its agent to be healthy. Cleanup destroys it.
func Start(t *testing.T, h Harness, rt runtime.Runtime, limits api.Limits) *Sandbox {
	t.Helper()
	if rt == nil {
		rt = h.New(t)
	}
	spec := runtime.Spec{
		ID:             newID(),
		RootFS:         h.RootFS,
		TemplateDigest: h.TemplateDigest,
		Limits:         limits,
		Hostname:       "sandbox-test",
	}
	ctx := ctxFor(t, 2*time.Minute)
	t0 := time.Now()
	inst, err := rt.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	t.Cleanup(func() {
		if err := inst.Destroy(context.Background()); err != nil {
			t.Errorf("Destroy: %v", err)
		}
	})
	tCreate := time.Since(t0)
	if err := inst.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	sb := &Sandbox{RT: rt, Inst: inst, Spec: spec}
	sb.Connect(t)
	t.Logf("sandbox %s: create %v, create+start+healthy %v", spec.ID, tCreate.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
	return sb
}

// Connect dials the agent and waits until it answers Health.
func (sb *Sandbox) Connect(t *testing.T) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	var last error
	for ctx.Err() == nil {
		conn, err := sb.Inst.DialAgent(ctx)
		if err == nil {
			c, err := agentclient.New(conn)
			if err == nil {
				hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				_, err = c.Health(hctx)
				cancel()
				if err == nil {
					sb.Client = c
					t.Cleanup(func() { c.Close() })
					return
				}
				c.Close()
			}
			last = err
		} else {
			last = err
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("agent never became healthy: %v", last)
}

// Exec runs a command synchronously and fails the test on transport errors.
func (sb *Sandbox) Exec(t *testing.T, cmd ...string) api.ExecResult {
	t.Helper()
	return sb.ExecReq(t, agentproto.ExecRequest{Cmd: cmd})
}

// Sh runs script with /bin/sh -c.
func (sb *Sandbox) Sh(t *testing.T, script string) api.ExecResult {
	t.Helper()
	return sb.Exec(t, "/bin/sh", "-c", script)
}

var defaultEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"}

// ExecReq runs req with a default environment and timeout.
func (sb *Sandbox) ExecReq(t *testing.T, req agentproto.ExecRequest) api.ExecResult {
	t.Helper()
	if req.Env == nil {
		req.Env = defaultEnv
	}
	if req.TimeoutSeconds == 0 {
		req.TimeoutSeconds = 60
	}
	res, err := sb.Client.Exec(ctxFor(t, 2*time.Minute), req)
	if err != nil {
		t.Fatalf("exec %q: %v", req.Cmd, err)
	}
	return res
}

// MustSh runs script and fails unless it exits 0; it returns stdout.
func (sb *Sandbox) MustSh(t *testing.T, script string) string {
	t.Helper()
	res := sb.Sh(t, script)
	if res.ExitCode != 0 {
		t.Fatalf("%q: exit %d signal %q\nstdout: %s\nstderr: %s", script, res.ExitCode, res.Signal, res.Stdout, res.Stderr)
	}
	return res.Stdout
}

func testLifecycle(t *testing.T, h Harness) {
	rt := h.New(t)
	sb := Start(t, h, rt, DefaultLimits)
	ctx := ctxFor(t, 2*time.Minute)
	if !sb.Inst.Alive() || sb.Inst.Exited() == nil {
		t.Fatal("started instance is not Alive or has no Exited channel")
	}
	hl, err := sb.Client.Health(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent %s pid %d", hl.Version, hl.Pid)
	sb.MustSh(t, "echo kept > /root/kept.txt && sync")
	exited := sb.Inst.Exited()
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if sb.Inst.Alive() {
		t.Fatal("Alive after Stop")
	}
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("Exited not closed after Stop")
	}
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatalf("second Stop (idempotent): %v", err)
	}
	if _, err := sb.Inst.DialAgent(ctx); err == nil {
		t.Fatal("DialAgent succeeded on a stopped sandbox")
	}
	if st, err := sb.Inst.Stats(ctx); err != nil || st.Pids != 0 {
		t.Fatalf("Stats of a stopped sandbox: %+v, %v", st, err)
	}
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatalf("Start after Stop: %v", err)
	}
	sb.Connect(t)
	if out := sb.MustSh(t, "cat /root/kept.txt"); out != "kept\n" {
		t.Fatalf("file written before Stop reads %q after Start", out)
	}
	// A restarted server re-adopts the running sandbox through Open.
	inst2, err := rt.Open(ctx, sb.Spec)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if !inst2.Alive() {
		t.Fatal("Open of a running sandbox: not Alive")
	}
	sb2 := &Sandbox{RT: rt, Inst: inst2, Spec: sb.Spec}
	sb2.Connect(t)
	if out := sb2.MustSh(t, "cat /root/kept.txt"); out != "kept\n" {
		t.Fatalf("re-adopted sandbox reads %q", out)
	}
	st, err := inst2.Stats(ctx)
	if err != nil || st.Pids < 1 || st.MemoryBytes <= 0 || st.CPUNanos <= 0 {
		t.Fatalf("Stats of a running sandbox: %+v, %v", st, err)
	}
	if err := inst2.Destroy(ctx); err != nil {
		t.Fatalf("Destroy: %v", err)
	}
	if err := sb.Inst.Destroy(ctx); err != nil {
		t.Fatalf("second Destroy (idempotent): %v", err)
	}
	if _, err := rt.Open(ctx, sb.Spec); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Open after Destroy: %v, want ErrNotFound", err)
	}
	// Nothing is left for a sweep to find.
	removed, err := rt.Sweep(ctx, func(id string) bool { return id != sb.Spec.ID })
	if err != nil || len(removed) != 0 {
		t.Fatalf("Sweep after Destroy found %v (%v)", removed, err)
	}
}

func testExec(t *testing.T, h Harness) {
	sb := Start(t, h, nil, DefaultLimits)
	res := sb.Sh(t, "echo out; echo err >&2; exit 3")
	if res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" {
		t.Fatalf("exit/stdout/stderr: %+v", res)
	}
	res = sb.ExecReq(t, agentproto.ExecRequest{Cmd: []string{"/bin/sh", "-c", "echo $FOO; pwd"}, Env: append([]string{"FOO=bar baz"}, defaultEnv...), Workdir: "/tmp"})
	if res.ExitCode != 0 || res.Stdout != "bar baz\n/tmp\n" {
		t.Fatalf("env/workdir: %+v", res)
	}
	res = sb.Exec(t, "python3", "-c", "import sys; print(sum(range(10))); sys.exit(7)")
	if res.ExitCode != 7 || res.Stdout != "45\n" {
		t.Fatalf("python3: %+v", res)
	}
	res = sb.ExecReq(t, agentproto.ExecRequest{Cmd: []string{"cat"}, Stdin: []byte("from stdin")})
	if res.Stdout != "from stdin" {
		t.Fatalf("stdin: %+v", res)
	}
	// A missing binary is an error or a non-zero exit, never success.
	res, err := sb.Client.Exec(ctxFor(t, time.Minute), agentproto.ExecRequest{Cmd: []string{"/no/such/binary"}, Env: defaultEnv})
	if err == nil && res.ExitCode == 0 {
		t.Fatalf("missing binary exited 0: %+v", res)
	}
}

func testCrash(t *testing.T, h Harness) {
	rt := h.New(t)
	sb := Start(t, h, rt, DefaultLimits)
	ctx := ctxFor(t, time.Minute)
	hl, err := sb.Client.Health(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// SIGKILL kills an agent that is not its namespace's init; an init
	// ignores SIGKILL from inside, but a Go program aborts on SIGABRT.
	script := fmt.Sprintf("kill -KILL %d; sleep 1; kill -ABRT %d", hl.Pid, hl.Pid)
	_, _ = sb.Client.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"/bin/sh", "-c", script}, Env: defaultEnv, TimeoutSeconds: 10})
	select {
	case <-sb.Inst.Exited():
	case <-time.After(15 * time.Second):
		t.Fatal("Exited did not fire after the agent was killed from inside")
	}
	if sb.Inst.Alive() {
		t.Fatal("Alive after the agent died")
	}
	if err := sb.Inst.Destroy(ctx); err != nil {
		t.Fatalf("Destroy after crash: %v", err)
	}

	// Sweep removes an instance whose id is not kept, and only that one.
	victim := Start(t, h, rt, DefaultLimits)
	survivor := Start(t, h, rt, DefaultLimits)
	removed, err := rt.Sweep(ctx, func(id string) bool { return id != victim.Spec.ID })
	if err != nil {
		t.Fatalf("Sweep: %v", err)
	}
	if len(removed) != 1 || removed[0] != victim.Spec.ID {
		t.Fatalf("Sweep removed %v, want [%s]", removed, victim.Spec.ID)
	}
	select {
	case <-victim.Inst.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("swept sandbox still running")
	}
	if _, err := rt.Open(ctx, victim.Spec); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Open of a swept sandbox: %v, want ErrNotFound", err)
	}
	if out := survivor.MustSh(t, "echo alive"); out != "alive\n" {
		t.Fatalf("kept sandbox after Sweep: %q", out)
	}
}

func contains(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// treeListing describes every entry of root (path, mode, size, mtime).
func treeListing(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s %o %d %d\n", p, fi.Mode(), fi.Size(), fi.ModTime().UnixNano())
		return nil
	})
	if err != nil {
		t.Fatalf("list template tree: %v", err)
	}
	return b.String()
}
