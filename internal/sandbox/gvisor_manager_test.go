package sandbox

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/gvisor"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// TestGvisorSuspendAndForkThroughTheManager drives the real gVisor runtime
// through the manager: a counting process continues across suspend and a
// transparent wake (memory kept, not restarted), and fork children run on,
// each with its own hostname and random stream.
func TestGvisorSuspendAndForkThroughTheManager(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m, newManager := gvisorManager(t, ctx)
	defer func() { m.Close() }()
	var ids []string
	defer func() {
		for _, id := range ids {
			if op, err := m.verbs.Lifecycle(context.Background(), id, api.OpDelete, true); err == nil {
				m.verbs.Wait(context.Background(), op.ID)
			}
		}
	}()
	wait := func(op api.Operation, err error) api.Operation {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		op, err = m.verbs.Wait(ctx, op.ID)
		if err != nil || op.State != api.OpSucceeded {
			t.Fatalf("%s: %v %+v", op.Kind, err, op.Error)
		}
		return op
	}
	sh := func(id, script string) string {
		t.Helper()
		res, err := m.cmds.Exec(ctx, id, api.ExecRequest{Cmd: []string{"sh", "-c", script}})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec %q in %s: %v %+v", script, id, err, res)
		}
		return strings.TrimSpace(res.Stdout)
	}
	counter := func(id string) int {
		t.Helper()
		n, err := strconv.Atoi(sh(id, "cat /tmp/n"))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	sb, op, err := m.creates.Create(ctx, api.CreateSandboxRequest{Runtime: gvisor.Name})
	if err == nil {
		ids = append(ids, sb.ID)
	}
	wait(op, err)
	// The count lives only in the shell's memory; a restarted shell would
	// begin again at 1.
	if _, err := m.cmds.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{Detached: true,
		ExecRequest: api.ExecRequest{Cmd: []string{"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.02; done"}}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)

	op = wait(m.verbs.Lifecycle(ctx, sb.ID, api.OpSuspend, false))
	t.Logf("suspend phases %+v", op.Phases)
	if s, _ := m.Get(ctx, sb.ID); s.State != api.StateSuspended {
		t.Fatalf("after suspend: %s", s.State)
	}
	before := counter(sb.ID) // wakes it
	if before < 5 {
		t.Fatalf("the counter was at %d after suspend and wake: its memory was not kept", before)
	}
	time.Sleep(200 * time.Millisecond)
	if after := counter(sb.ID); after <= before {
		t.Fatalf("the counter stopped after the wake: %d then %d", before, after)
	}

	op = wait(m.verbs.Fork(ctx, sb.ID, api.ForkRequest{Count: 2}))
	ids = append(ids, op.Children...)
	t.Logf("fork phases %+v", op.Phases)
	rnd := map[string]string{}
	for _, id := range append([]string{sb.ID}, op.Children...) {
		if id != sb.ID {
			if got := sh(id, "hostname"); got != id {
				t.Errorf("child hostname %q, want %s", got, id)
			}
			if n := counter(id); n < before {
				t.Errorf("child %s counter %d: not forked from the parent's memory (parent was at %d)", id, n, before)
			}
		}
		r := sh(id, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
		for other, v := range rnd {
			if v == r {
				t.Errorf("%s and %s read the same random bytes", id, other)
			}
		}
		rnd[id] = r
	}

	// A suspended sandbox survives a server restart: a new manager over a
	// new runtime on the same directories keeps it suspended and restores
	// it from the persisted image.
	wait(m.verbs.Lifecycle(ctx, sb.ID, api.OpSuspend, false))
	m.Close()
	m = newManager()
	if err := m.recon.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if s, _ := m.Get(ctx, sb.ID); s.State != api.StateSuspended {
		t.Fatalf("after a restart: %s (%s)", s.State, s.Error)
	}
	before = counter(sb.ID)
	time.Sleep(200 * time.Millisecond)
	if after := counter(sb.ID); after <= before || before < 5 {
		t.Fatalf("the counter after a restart and wake: %d then %d", before, after)
	}
	for _, id := range op.Children {
		if s, _ := m.Get(ctx, id); s.State != api.StateRunning {
			t.Errorf("child %s after a restart: %s", id, s.State)
		}
	}
}

// gvisorManager is a manager over the real gVisor runtime with the base
// template imported, or skips. newManager builds another manager over the
// same store and runtime directory (a restarted server).
func gvisorManager(t *testing.T, ctx context.Context) (m *Manager, newManager func() *Manager) {
	t.Helper()
	testenv.RequireRoot(t)
	if testing.Short() {
		t.Skip("slow: real gVisor checkpoints")
	}
	base := testenv.BaseRootfs(t)
	dataDir, err := os.MkdirTemp("", "sg-") // short: the agent socket path must fit in sockaddr_un
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	rt, err := gvisor.New(runtime.Config{DataDir: dataDir, AgentBinary: testenv.AgentBinary(t), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		rt.(io.Closer).Close()
		if err := os.RemoveAll(dataDir); err != nil {
			t.Errorf("runtime directory left behind: %v", err)
		}
	})
	caps := rt.Probe(ctx)
	testenv.Require(t, "gvisor", caps.Available, caps.Reason)
	testenv.Require(t, "gvisor suspend", caps.Verbs[api.OpSuspend] && caps.Verbs[api.OpFork], caps.VerbReasons[api.OpSuspend]+caps.VerbReasons[api.OpFork])

	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), log)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tmpl.ImportDir(ctx, base, template.ImportOptions{Tags: []string{"base:latest"}, Source: "dir"}); err != nil {
		t.Fatal(err)
	}
	newManager = func() *Manager {
		rt.(io.Closer).Close()
		if rt, err = gvisor.New(runtime.Config{DataDir: dataDir, AgentBinary: testenv.AgentBinary(t), Logger: log}); err != nil {
			t.Fatal(err)
		}
		return New(Config{DB: db, Templates: tmpl, Runtimes: map[string]runtime.Runtime{gvisor.Name: rt}, Logger: log})
	}
	return New(Config{DB: db, Templates: tmpl, Runtimes: map[string]runtime.Runtime{gvisor.Name: rt}, Logger: log}), newManager
}

// TestGvisorStopDiscardsTheSuspendedImage: stopping a suspended sandbox
// throws its memory image away (runtime.Instance.Stop releases memory, the
// saved one included) and keeps its disk; start then boots it afresh.
func TestGvisorStopDiscardsTheSuspendedImage(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m, _ := gvisorManager(t, ctx)
	defer m.Close()
	wait := func(op api.Operation, err error) api.Operation {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		op, err = m.verbs.Wait(ctx, op.ID)
		if err != nil || op.State != api.OpSucceeded {
			t.Fatalf("%s: %v %+v", op.Kind, err, op.Error)
		}
		return op
	}
	sb, op, err := m.creates.Create(ctx, api.CreateSandboxRequest{Runtime: gvisor.Name})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if op, err := m.verbs.Lifecycle(context.Background(), sb.ID, api.OpDelete, true); err == nil {
			m.verbs.Wait(context.Background(), op.ID)
		}
	}()
	wait(op, err)
	if res, err := m.cmds.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "echo kept > /root/f"}}); err != nil || res.ExitCode != 0 {
		t.Fatalf("write: %v %+v", err, res)
	}
	wait(m.verbs.Lifecycle(ctx, sb.ID, api.OpSuspend, false))
	wait(m.verbs.Lifecycle(ctx, sb.ID, api.OpStop, false))
	if got, _ := m.Get(ctx, sb.ID); got.State != api.StateStopped {
		t.Fatalf("after stop of suspended: %s %q", got.State, got.Error)
	}
	op = wait(m.verbs.Lifecycle(ctx, sb.ID, api.OpStart, false))
	if got := phaseNames(op); !strings.HasPrefix(got, "start_runtime,agent_ready") {
		t.Fatalf("start after the image was discarded: %s", got)
	}
	if res, err := m.cmds.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/root/f"}}); err != nil || res.Stdout != "kept\n" {
		t.Fatalf("disk after stop of suspended: %v %+v", err, res)
	}
}
