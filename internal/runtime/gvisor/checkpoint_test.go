package gvisor_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/gvisor"
	"github.com/spacehq/space/internal/runtime/runtimetest"
	"github.com/spacehq/space/internal/testenv"
)

func TestProbeCheckpoint(t *testing.T) {
	requireRunsc(t)
	rt := newRuntime(t, testenv.AgentBinary(t))
	c := rt.Probe(context.Background())
	t.Logf("verbs %v reasons %v details %v", c.Verbs, c.VerbReasons, c.Details)
	if !c.Verbs["suspend"] {
		t.Fatal(c.VerbReasons["suspend"])
	}
}

// TestCheckpointFailureKeepsRunning forces runsc checkpoint to fail — a
// process in the sandbox binds a unix socket in its root, a host directory
// served by the gofer, which --host-uds=create makes a host socket, and
// gVisor cannot save a bound host socket — and checks
// that suspend and fork then fail with runsc's message while the sandbox
// keeps running and its agent listens again; fork leaves no child. Once the
// socket is gone, a suspend succeeds and leaves no host process.
func TestCheckpointFailureKeepsRunning(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := sb.Client.StartProc(ctx, agentproto.ProcStart{ID: "binder", Cmd: []string{"python3", "-c",
		"import socket,time; s=socket.socket(socket.AF_UNIX); s.bind('/root/held.sock'); s.listen(); time.sleep(3600)"}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		if sb.Exec(t, "test", "-S", "/root/held.sock").ExitCode == 0 {
			break
		}
		if i > 100 {
			t.Fatal("the sandbox never bound its socket")
		}
		time.Sleep(50 * time.Millisecond)
	}
	quiesce := func() {
		if err := sb.Client.Quiesce(ctx); err != nil {
			t.Fatal(err)
		}
		sb.Client.Close()
	}
	quiesce()
	err := sb.Inst.(runtime.Suspender).Suspend(ctx)
	var re *gvisor.RunscError
	if !errors.As(err, &re) || !strings.Contains(err.Error(), "socket") {
		t.Fatalf("Suspend = %v, want runsc's checkpoint error", err)
	}
	t.Logf("suspend failed as it should: %v", err)
	if !sb.Inst.Alive() || sb.Inst.(runtime.Suspender).Suspended() {
		t.Fatalf("after a failed suspend: alive %v suspended %v", sb.Inst.Alive(), sb.Inst.(runtime.Suspender).Suspended())
	}
	sb.Connect(t)
	if got := sb.MustSh(t, "echo alive"); got != "alive\n" {
		t.Fatalf("exec after a failed suspend: %q", got)
	}

	quiesce()
	kid := runtime.Spec{ID: sb.Spec.ID + "k", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits}
	if _, err := sb.Inst.(runtime.Forker).Fork(ctx, []runtime.Spec{kid}); !errors.As(err, &re) {
		t.Fatalf("Fork = %v, want runsc's checkpoint error", err)
	}
	if inst, err := rt.Open(ctx, kid); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a failed fork left its child: %v %v", inst, err)
	}
	sb.Connect(t)
	if info, err := sb.Client.Proc(ctx, "binder"); err != nil || !info.Running {
		t.Fatalf("after a failed fork: %+v %v", info, err)
	}

	// A fork refused before any checkpoint also lets the parent's agent
	// listen again: a child id given twice or the parent's (invalid)...
	quiesce()
	dup := kid
	dup.ID = sb.Spec.ID
	if _, err := sb.Inst.(runtime.Forker).Fork(ctx, []runtime.Spec{dup}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Fork into the parent's id = %v, want invalid argument", err)
	}
	sb.Connect(t)
	quiesce()
	if _, err := sb.Inst.(runtime.Forker).Fork(ctx, []runtime.Spec{kid, kid}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Fork into one id twice = %v, want invalid argument", err)
	}
	sb.Connect(t)
	// ... or the id of another sandbox (a conflict).
	other := kid
	other.ID = sb.Spec.ID + "o"
	otherInst, err := rt.Create(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	defer otherInst.Destroy(context.WithoutCancel(ctx))
	quiesce()
	if _, err := sb.Inst.(runtime.Forker).Fork(ctx, []runtime.Spec{kid, other}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("Fork into an existing id = %v, want conflict", err)
	}
	if inst, err := rt.Open(ctx, kid); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a refused fork left its first child: %v %v", inst, err)
	}
	sb.Connect(t)

	// Without the bound socket the same sandbox suspends, and then nothing
	// of it runs on the host.
	if err := sb.Client.ForgetProc(ctx, "binder"); err != nil {
		t.Fatal(err)
	}
	sb.MustSh(t, "rm -f /root/held.sock")
	quiesce()
	if err := sb.Inst.(runtime.Suspender).Suspend(ctx); err != nil {
		t.Fatalf("Suspend: %v", err)
	}
	if procs := hostProcsNaming(sb.Spec.ID); len(procs) > 0 {
		t.Fatalf("host processes of a suspended sandbox: %v", procs)
	}
}

// hostProcsNaming lists host processes whose command line names id.
func hostProcsNaming(id string) []string {
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), id) {
			out = append(out, e.Name()+": "+strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
	return out
}
