package agent_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
)

func TestHealth(t *testing.T) {
	e := newEnv(t, agent.Config{})
	h, err := e.c.Health(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if h.Pid != os.Getpid() || h.Version == "" {
		t.Fatalf("health = %+v", h)
	}
}

func TestExec(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	sh := func(script string) agentproto.ExecRequest {
		return agentproto.ExecRequest{Cmd: []string{"sh", "-c", script}}
	}

	t.Run("exit code and streams", func(t *testing.T) {
		res, err := e.c.Exec(ctx, sh("echo out; echo err >&2; exit 3"))
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" || res.Signal != "" {
			t.Fatalf("result = %+v", res)
		}
	})
	t.Run("stdin", func(t *testing.T) {
		in := strings.Repeat("0123456789", 50_000) // larger than a pipe buffer
		res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"cat"}, Stdin: []byte(in)})
		if err != nil {
			t.Fatal(err)
		}
		if res.Stdout != in {
			t.Fatalf("cat returned %d bytes, want %d", len(res.Stdout), len(in))
		}
	})
	t.Run("stdin ignored", func(t *testing.T) {
		res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}, Stdin: make([]byte, 600<<10)})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("res=%+v err=%v", res, err)
		}
	})
	t.Run("env", func(t *testing.T) {
		req := sh(`echo "$FOO|$PATH|$HOME|$TERM"`)
		req.Env = []string{"FOO=bar baz"}
		res, err := e.c.Exec(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		want := "bar baz|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|/root|\n"
		if res.Stdout != want {
			t.Fatalf("stdout = %q, want %q", res.Stdout, want)
		}
		req.Env = []string{"NOEQUALS"}
		_, err = e.c.Exec(ctx, req)
		wantErr(t, err, errdefs.ErrInvalidArgument)
	})
	t.Run("workdir", func(t *testing.T) {
		dir := t.TempDir()
		req := agentproto.ExecRequest{Cmd: []string{"pwd"}, Workdir: dir}
		res, err := e.c.Exec(ctx, req)
		if err != nil || res.Stdout != dir+"\n" {
			t.Fatalf("res=%+v err=%v", res, err)
		}
		req.Workdir = dir + "/missing"
		_, err = e.c.Exec(ctx, req)
		wantErr(t, err, errdefs.ErrInvalidArgument)
		if !strings.Contains(err.Error(), "does not exist") {
			t.Fatalf("unclear error: %v", err)
		}
	})
	t.Run("not found", func(t *testing.T) {
		_, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"no-such-program-xyz"}})
		wantErr(t, err, errdefs.ErrNotFound)
		_, err = e.c.Exec(ctx, agentproto.ExecRequest{})
		wantErr(t, err, errdefs.ErrInvalidArgument)
	})
	t.Run("timeout", func(t *testing.T) {
		start := time.Now()
		req := sh("sleep 30 & sleep 30")
		req.TimeoutSeconds = 0.3
		res, err := e.c.Exec(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if !res.TimedOut || res.Signal != "KILL" || res.ExitCode != 137 {
			t.Fatalf("result = %+v", res)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("timeout took %v", d)
		}
	})
	t.Run("killed by signal", func(t *testing.T) {
		res, err := e.c.Exec(ctx, sh("kill -TERM $$"))
		if err != nil || res.Signal != "TERM" || res.ExitCode != 143 {
			t.Fatalf("res=%+v err=%v", res, err)
		}
	})
	t.Run("truncation", func(t *testing.T) {
		// 5 MiB on each stream with a 1000-byte cap: the process must run to
		// completion (never blocked on a full pipe) and report truncation.
		req := sh("head -c 5242880 /dev/zero; head -c 5242880 /dev/zero >&2; echo done >&2; exit 7")
		req.MaxOutputBytes = 1000
		res, err := e.c.Exec(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode != 7 || len(res.Stdout) != 1000 || len(res.Stderr) != 1000 || !res.StdoutTruncated || !res.StderrTruncated {
			t.Fatalf("exit=%d len(out)=%d len(err)=%d truncated=%v/%v", res.ExitCode, len(res.Stdout), len(res.Stderr), res.StdoutTruncated, res.StderrTruncated)
		}
		req = sh("printf 12345")
		req.MaxOutputBytes = 5
		res, err = e.c.Exec(ctx, req)
		if err != nil || res.Stdout != "12345" || res.StdoutTruncated {
			t.Fatalf("exact cap: res=%+v err=%v", res, err)
		}
		req.MaxOutputBytes = agentproto.MaxSyncOut + 1
		_, err = e.c.Exec(ctx, req)
		wantErr(t, err, errdefs.ErrInvalidArgument)
	})
	t.Run("no descriptor leaks", func(t *testing.T) {
		res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", "ls /proc/$$/fd"}})
		if err != nil || res.Stdout != "0\n1\n2\n" {
			t.Fatalf("child descriptors: %q %v", res.Stdout, err)
		}
	})
	t.Run("too many args", func(t *testing.T) {
		req := agentproto.ExecRequest{Cmd: make([]string, agentproto.MaxArgs+1)}
		for i := range req.Cmd {
			req.Cmd[i] = "x"
		}
		_, err := e.c.Exec(ctx, req)
		wantErr(t, err, errdefs.ErrInvalidArgument)
	})
}

func TestExecUser(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t, agent.Config{})
	writeRootFile(t, e.root, "etc/passwd", "root:x:0:0:root:/root:/bin/sh\nalice:x:1234:1234::/home/alice:/bin/sh\n")
	writeRootFile(t, e.root, "etc/group", "root:x:0:\nalice:x:1234:\ndev:x:2000:bob,alice\nops:x:2001:alice\n")
	ctx := ctxT(t)
	for _, tc := range []struct {
		user, want string
	}{
		{"alice", "1234 1234 1234 2000 2001"},
		{"1234", "1234 1234 1234 2000 2001"},
		{"alice:dev", "1234 2000 2000 2001"},
		{"4321", "4321 4321 4321"},
		{"4321:99", "4321 99 99"},
		{"0:0", "0 0 0"},
	} {
		res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", `echo $(id -u) $(id -g) $(id -G)`}, User: tc.user, Workdir: "/"})
		if err != nil {
			t.Fatalf("user %q: %v", tc.user, err)
		}
		if got := strings.TrimSpace(res.Stdout); got != tc.want {
			t.Errorf("user %q: got %q (stderr %q), want %q", tc.user, got, res.Stderr, tc.want)
		}
	}
	res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo $HOME"}, User: "alice", Workdir: "/"})
	if err != nil || res.Stdout != "/home/alice\n" {
		t.Fatalf("HOME: res=%+v err=%v", res, err)
	}
	for _, bad := range []string{"mallory", "alice:nogroup", "4294967295", "x:y:z"} {
		_, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}, User: bad})
		wantErr(t, err, errdefs.ErrInvalidArgument)
	}
}

// zombieChildren lists our children in state Z.
func zombieChildren(t *testing.T) []int {
	t.Helper()
	var out []int
	ents, _ := os.ReadDir("/proc")
	me := strconv.Itoa(os.Getpid())
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) > 1 && f[1] == me && f[0] == "Z" {
			out = append(out, pid)
		}
	}
	return out
}

func TestReapsOrphans(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	// The middle shell exits at once; its background child is orphaned,
	// reparented to the agent (subreaper here, PID 1 in a sandbox) and must
	// be reaped when it exits.
	res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", `sh -c 'sleep 0.5 >/dev/null 2>&1 & echo $!'`}})
	if err != nil {
		t.Fatal(err)
	}
	orphan, err := strconv.Atoi(strings.TrimSpace(res.Stdout))
	if err != nil {
		t.Fatalf("stdout %q", res.Stdout)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", orphan))
	if err != nil {
		t.Fatalf("orphan already gone: %v", err)
	}
	st := string(b)
	if f := strings.Fields(st[strings.LastIndexByte(st, ')')+1:]); len(f) < 2 || f[1] != strconv.Itoa(os.Getpid()) {
		t.Fatalf("orphan was not reparented to the agent: %s", b)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", orphan))
		if os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("orphan %d still exists (zombies: %v)", orphan, zombieChildren(t))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if z := zombieChildren(t); len(z) > 0 {
		t.Fatalf("zombies left: %v", z)
	}
}

// TestExecConcurrent checks that the reaper hands every exit status to its
// own process under concurrency.
func TestExecConcurrent(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	const n = 40
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			res, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", fmt.Sprintf("echo %d; exit %d", i, i)}})
			switch {
			case err != nil:
				errs <- err
			case res.ExitCode != i || res.Stdout != fmt.Sprintf("%d\n", i):
				errs <- fmt.Errorf("exec %d got exit %d stdout %q", i, res.ExitCode, res.Stdout)
			default:
				errs <- nil
			}
		}()
	}
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestExecCallerGone: when the host gives up on a sync exec, the agent
// kills the process instead of leaving it behind.
func TestExecCallerGone(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := e.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo $$ > " + e.root + "/pid; exec sleep 30"}})
	wantErr(t, err, errdefs.ErrTimeout)
	b, err := os.ReadFile(e.root + "/pid")
	if err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(string(b))
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat("/proc/" + pid); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %s outlived the abandoned exec", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
