package e2e

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
)

// requireSuspend skips (fails in CI) unless auto's runtime can suspend here.
func requireSuspend(t *testing.T, e *env) string {
	t.Helper()
	info, err := e.client.Info(ctxT(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range info.Runtimes {
		if r.Name == info.AutoRuntime {
			testenv.Require(t, "suspend", r.Verbs[api.OpSuspend], "auto runtime "+r.Name+": "+r.VerbReasons[api.OpSuspend])
			return r.Name
		}
	}
	t.Fatalf("auto runtime %q not listed", info.AutoRuntime)
	return ""
}

// pyState is a Python process holding a token and a counter only in memory;
// it writes both to /tmp/state ten times a second.
const pyState = `import os, time
token = os.urandom(8).hex()
n = 0
while True:
    n += 1
    with open("/tmp/state.new", "w") as f:
        f.write("%d %s %d" % (os.getpid(), token, n))
    os.replace("/tmp/state.new", "/tmp/state")
    time.sleep(0.1)
`

type pyReading struct {
	pid, token string
	n          int
}

func readState(t *testing.T, e *env, id string) pyReading {
	t.Helper()
	res, err := e.client.Exec(ctxT(t, 2*time.Minute), id, api.ExecRequest{Cmd: []string{"cat", "/tmp/state"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("read state of %s: %v %+v", id, err, res)
	}
	f := strings.Fields(res.Stdout)
	if len(f) != 3 {
		t.Fatalf("state %q", res.Stdout)
	}
	n, _ := strconv.Atoi(f[2])
	return pyReading{f[0], f[1], n}
}

// hostProcsOf counts host processes whose command line names the sandbox.
func hostProcsOf(id string) int {
	n := 0
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		if _, err := strconv.Atoi(d.Name()); err != nil {
			continue
		}
		b, _ := os.ReadFile("/proc/" + d.Name() + "/cmdline")
		if strings.Contains(string(b), id) {
			n++
		}
	}
	return n
}

// TestSuspendKeepsProcessMemoryAndForkGivesOwnEntropy: a Python process's
// in-memory state survives suspend (nothing of the sandbox runs meanwhile)
// and the transparent wake; a fork's children carry the same process and
// state but read different random streams.
func TestSuspendKeepsProcessMemoryAndForkGivesOwnEntropy(t *testing.T) {
	e := setup(t)
	requireSuspend(t, e)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	if _, err := e.client.WriteFile(ctx, sb.ID, "/root/state.py", strings.NewReader(pyState), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"python3", "/root/state.py"}}, Detached: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.WriteFile(ctx, sb.ID, "/root/before.txt", strings.NewReader("written before suspend"), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	var before pyReading
	for {
		res, _ := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/tmp/state"}})
		if res != nil && res.ExitCode == 0 {
			before = readState(t, e, sb.ID)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the python process never wrote its state")
		}
		time.Sleep(100 * time.Millisecond)
	}

	op, err := e.client.Suspend(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if op, err = e.client.WaitOperation(ctx, op.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("suspend: %v %+v", err, op)
	}
	if got, _ := e.client.GetSandbox(ctx, sb.ID); got.State != api.StateSuspended {
		t.Fatalf("state after suspend: %s", got.State)
	}
	if n := hostProcsOf(sb.ID); n != 0 {
		t.Fatalf("%d host processes still name suspended sandbox %s", n, sb.ID)
	}
	time.Sleep(500 * time.Millisecond)

	// Any call wakes it: the same process continues with the same memory.
	after := readState(t, e, sb.ID)
	if after.pid != before.pid || after.token != before.token || after.n < before.n {
		t.Fatalf("state before %+v, after restore %+v", before, after)
	}
	time.Sleep(300 * time.Millisecond)
	if later := readState(t, e, sb.ID); later.n <= after.n || later.token != before.token {
		t.Fatalf("the restored process is not running: %+v then %+v", after, later)
	}
	res, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/root/before.txt"}})
	if err != nil || res.Stdout != "written before suspend" {
		t.Fatalf("file after restore: %v %+v", err, res)
	}

	// Fork: two children with the parent's file and process state.
	op, err = e.client.Fork(ctx, sb.ID, api.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	children := op.Children
	for _, c := range children {
		c := c
		t.Cleanup(func() {
			if op, err := e.client.DeleteSandbox(ctxT(t, time.Minute), c, true); err == nil {
				e.client.WaitOperation(ctxT(t, time.Minute), op.ID)
			}
		})
	}
	if op, err = e.client.WaitOperation(ctx, op.ID); err != nil || op.State != api.OpSucceeded || len(children) != 2 {
		t.Fatalf("fork: %v %+v", err, op)
	}
	random := map[string]string{}
	for _, id := range append([]string{sb.ID}, children...) {
		st := readState(t, e, id)
		if st.token != before.token {
			t.Errorf("%s: in-memory token %s, parent's %s", id, st.token, before.token)
		}
		res, err := e.client.Exec(ctx, id, api.ExecRequest{Cmd: []string{"sh", "-c", "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /root/before.txt"}})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("%s: %v %+v", id, err, res)
		}
		lines := strings.SplitN(res.Stdout, "\n", 2)
		if len(lines) != 2 || lines[1] != "written before suspend" {
			t.Errorf("%s: %q", id, res.Stdout)
		}
		for other, r := range random {
			if r == lines[0] {
				t.Errorf("%s and %s read the same random bytes", id, other)
			}
		}
		random[id] = lines[0]
	}
	// A child's writes stay its own.
	if _, err := e.client.Exec(ctx, children[0], api.ExecRequest{Cmd: []string{"sh", "-c", "echo child > /root/mine"}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{sb.ID, children[1]} {
		if res, _ := e.client.Exec(ctx, id, api.ExecRequest{Cmd: []string{"test", "-e", "/root/mine"}}); res == nil || res.ExitCode == 0 {
			t.Errorf("child's file visible in %s", id)
		}
	}
}

// TestIdleAutoSuspend: with idle action suspend, a quiet sandbox suspends on
// its own and the next request wakes it.
func TestIdleAutoSuspend(t *testing.T) {
	e := setup(t)
	requireSuspend(t, e)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Idle: &api.IdlePolicy{AfterSeconds: 1, Action: "suspend"}})
	if _, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "echo kept > /root/k"}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		got, err := e.client.GetSandbox(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == api.StateSuspended {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idle sandbox not suspended: %s", got.State)
		}
		time.Sleep(200 * time.Millisecond)
	}
	res, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/root/k"}})
	if err != nil || res.Stdout != "kept\n" {
		t.Fatalf("exec after idle suspend: %v %+v", err, res)
	}
}
