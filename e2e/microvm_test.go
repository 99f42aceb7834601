package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
)

// requireMicroVM skips (fails in CI, where setup installs QEMU and the
// guest kernel) unless the server's microvm runtime is available.
func requireMicroVM(t *testing.T, e *env) api.RuntimeInfo {
	t.Helper()
	info, err := e.client.Info(ctxT(t, 2*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range info.Runtimes {
		if r.Name == "microvm" {
			testenv.Require(t, "microvm", r.Available, "microvm runtime: "+r.Reason)
			return r
		}
	}
	testenv.Require(t, "microvm", false, "no microvm runtime registered")
	return api.RuntimeInfo{}
}

// TestMicroVMThroughTheAPI: sandboxes on their own guest kernel, created
// through the API (the second from the warm template the first left),
// each with its own hostname and disk; a Python process's memory survives
// suspend and the transparent wake; fork children get their own entropy.
func TestMicroVMThroughTheAPI(t *testing.T) {
	e := setup(t)
	ri := requireMicroVM(t, e)
	accel := ri.Details["accel"]
	if accel != "kvm" && accel != "tcg" {
		t.Fatalf("space info does not say which accelerator microvm uses: %+v", ri.Details)
	}
	ctx := ctxT(t, 10*time.Minute)
	req := api.CreateSandboxRequest{Runtime: "microvm"}
	a := newSandbox(t, e, req)
	if a.Runtime != "microvm" || !strings.Contains(a.Isolation, accel) {
		t.Fatalf("sandbox reports runtime %q isolation %q, want microvm with %s", a.Runtime, a.Isolation, accel)
	}
	kernel := func(id string) string {
		res, err := e.client.Exec(ctx, id, api.ExecRequest{Cmd: []string{"sh", "-c", "uname -r; hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"}})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec in %s: %v %+v", id, err, res)
		}
		return res.Stdout
	}
	outA := kernel(a.ID)
	if !strings.HasPrefix(outA, "6.1.0-50-cloud-amd64\n") {
		t.Fatalf("sandbox does not run the guest kernel: %q", outA)
	}
	if _, err := e.client.WriteFile(ctx, a.ID, "/root/mine.txt", strings.NewReader("a's"), 0o644); err != nil {
		t.Fatal(err)
	}

	b := newSandbox(t, e, req)
	outB := kernel(b.ID)
	la, lb := strings.Split(outA, "\n"), strings.Split(outB, "\n")
	if la[1] == lb[1] || la[2] == lb[2] {
		t.Fatalf("two sandboxes share a hostname or random stream:\n%q\n%q", outA, outB)
	}
	if res, _ := e.client.Exec(ctx, b.ID, api.ExecRequest{Cmd: []string{"test", "-e", "/root/mine.txt"}}); res == nil || res.ExitCode == 0 {
		t.Fatal("a file written in one sandbox is visible in another")
	}

	// Suspend keeps a process's memory; any call wakes it.
	if _, err := e.client.WriteFile(ctx, a.ID, "/root/state.py", strings.NewReader(pyState), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.CreateCommand(ctx, a.ID, api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"python3", "/root/state.py"}}, Detached: true}); err != nil {
		t.Fatal(err)
	}
	var before pyReading
	for deadline := time.Now().Add(60 * time.Second); ; {
		res, _ := e.client.Exec(ctx, a.ID, api.ExecRequest{Cmd: []string{"cat", "/tmp/state"}})
		if res != nil && res.ExitCode == 0 {
			before = readState(t, e, a.ID)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the python process never wrote its state")
		}
		time.Sleep(200 * time.Millisecond)
	}
	op, err := e.client.Suspend(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if op, err = e.client.WaitOperation(ctx, op.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("suspend: %v %+v", err, op)
	}
	if n := hostProcsOf(a.ID); n != 0 {
		t.Fatalf("%d host processes still name the suspended sandbox", n)
	}
	after := readState(t, e, a.ID) // wakes it
	if after.pid != before.pid || after.token != before.token || after.n < before.n {
		t.Fatalf("process memory not kept across suspend: before %+v after %+v", before, after)
	}

	op, err = e.client.Fork(ctx, a.ID, api.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	if op, err = e.client.WaitOperation(ctx, op.ID); err != nil || op.State != api.OpSucceeded || len(op.Children) != 2 {
		t.Fatalf("fork: %v %+v", err, op)
	}
	seen := map[string]string{la[2]: a.ID}
	for _, id := range op.Children {
		t.Cleanup(func() {
			if op, err := e.client.DeleteSandbox(ctxT(t, time.Minute), id, true); err == nil {
				e.client.WaitOperation(ctxT(t, time.Minute), op.ID)
			}
		})
		st := readState(t, e, id)
		if st.token != before.token {
			t.Fatalf("fork child %s lost the parent's process memory: %+v", id, st)
		}
		l := strings.Split(kernel(id), "\n")
		if l[1] != id {
			t.Fatalf("child hostname %q, want its id %s", l[1], id)
		}
		if other, dup := seen[l[2]]; dup {
			t.Fatalf("child %s reads the same random bytes as %s", id, other)
		}
		seen[l[2]] = id
	}
}
