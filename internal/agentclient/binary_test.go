package agentclient_test

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/testenv"
)

// TestAgentBinary runs the real static space-agent binary on a unix socket
// and talks to it across reconnects.
func TestAgentBinary(t *testing.T) {
	bin := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "agb")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	root := t.TempDir()
	p, err := os.StartProcess(bin, []string{"space-agent", "--socket", sock, "--root", root}, &os.ProcAttr{Files: []*os.File{nil, os.Stderr, os.Stderr}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		p.Kill()
		p.Wait() // may fail with ECHILD: an in-process agent's reaper may have taken it
	}()
	var conn net.Conn
	for deadline := time.Now().Add(10 * time.Second); ; {
		if conn, err = net.Dial("unix", sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent never listened: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for round := 0; round < 3; round++ {
		if round > 0 {
			if conn, err = net.Dial("unix", sock); err != nil {
				t.Fatal(err)
			}
		}
		c, err := agentclient.New(conn)
		if err != nil {
			t.Fatal(err)
		}
		h, err := c.Health(ctxT(t))
		if err != nil || h.Pid != p.Pid {
			t.Fatalf("health %+v %v", h, err)
		}
		res, err := c.Exec(ctxT(t), agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo hi; exit 4"}})
		if err != nil || res.Stdout != "hi\n" || res.ExitCode != 4 {
			t.Fatalf("exec %+v %v", res, err)
		}
		c.Close()
		select {
		case <-c.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("Done not closed after Close")
		}
	}
}

// TestAgentBinaryInheritedFD starts the agent the way nsinit leaves it: the
// listening socket as fd 3 and SPACE_AGENT_FD=3.
func TestAgentBinaryInheritedFD(t *testing.T) {
	bin := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "agb")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	lf, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	p, err := os.StartProcess(bin, []string{"space-agent", "--root", t.TempDir()}, &os.ProcAttr{
		Env:   []string{"SPACE_AGENT_FD=3", "PATH=/usr/bin:/bin"},
		Files: []*os.File{nil, os.Stderr, os.Stderr, lf},
	})
	lf.Close()
	ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		p.Kill()
		p.Wait()
	}()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res, err := c.Exec(ctxT(t), agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo ${SPACE_AGENT_FD-unset}; ls /proc/$$/fd"}})
	if err != nil || res.Stdout != "unset\n0\n1\n2\n" {
		t.Fatalf("exec %+v %v", res, err)
	}
}

// TestAgentBinaryAsPID1 runs the agent as PID 1 of a new pid namespace, as
// in a sandbox: orphans are reaped without a subreaper, and signals sent to
// PID 1 from inside do not stop it.
func TestAgentBinaryAsPID1(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "agb")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	p, err := os.StartProcess(bin, []string{"space-agent", "--socket", sock, "--root", t.TempDir()}, &os.ProcAttr{
		Files: []*os.File{nil, os.Stderr, os.Stderr},
		Sys:   &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID},
	})
	if err != nil {
		testenv.Require(t, "pid-namespace", false, err.Error())
	}
	defer func() {
		p.Kill()
		p.Wait()
	}()
	var conn net.Conn
	for deadline := time.Now().Add(10 * time.Second); ; {
		if conn, err = net.Dial("unix", sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent never listened: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := ctxT(t)
	if h, err := c.Health(ctx); err != nil || h.Pid != 1 {
		t.Fatalf("health %+v %v, want pid 1", h, err)
	}
	// Signals to PID 1 from inside its namespace are caught and ignored.
	res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", "for s in TERM INT HUP QUIT USR1 USR2 PIPE; do kill -$s 1; done; echo sent"}})
	if err != nil || res.Stdout != "sent\n" {
		t.Fatalf("exec %+v %v", res, err)
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := c.Health(ctx); err != nil {
		t.Fatalf("agent died of a signal from inside: %v", err)
	}
	// Children still get default signal dispositions (a handler, unlike
	// SIG_IGN, is not inherited across exec).
	res, err = c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", "kill -TERM $$; echo survived"}})
	if err != nil || res.Signal != "TERM" {
		t.Fatalf("child ignored SIGTERM: %+v %v", res, err)
	}
	// Double fork: the grandchild is orphaned to PID 1 and must be reaped.
	for i := 0; i < 5; i++ {
		if _, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"sh", "-c", "sh -c 'sleep 0.1 >/dev/null 2>&1 &'"}}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond)
	if z := zombiesOf(t, p.Pid); len(z) > 0 {
		t.Fatalf("zombies under the agent: %v", z)
	}
}

// zombiesOf lists host pids of zombie children of ppid.
func zombiesOf(t *testing.T, ppid int) []string {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, ent := range ents {
		b, err := os.ReadFile("/proc/" + ent.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) > 1 && f[0] == "Z" && f[1] == strconv.Itoa(ppid) {
			out = append(out, ent.Name())
		}
	}
	return out
}

// TestAgentBinaryIdleMemory measures what an idle sandbox costs the host:
// its agent is its only process. Several agents run from one binary, as
// sandboxes do (the host execs the same file for each), so their program
// text is one page-cache copy and each one's proportional set size (PSS)
// is its share of the host's memory. After startup, one connection and one
// exec each must stay within the budget of an idle sandbox. After a burst
// of work (large outputs, an 8 MiB upload) has come and gone, the agent's
// own memory must shrink back near that (it trims when idle).
func TestAgentBinaryIdleMemory(t *testing.T) {
	const (
		agents        = 4
		pssBudget     = 4 << 20 // bytes per idle sandbox
		anonBudget    = 2 << 20 // bytes of the agent's own (unshared) memory
		anonAfterWork = 6 << 20 // after a burst: collector state stays (untrimmed: 8 MiB)
	)
	bin := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "agb")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	pids := make([]int, agents)
	clients := make([]*agentclient.Client, agents)
	for i := range pids {
		sock := filepath.Join(dir, strconv.Itoa(i))
		p, err := os.StartProcess(bin, []string{"space-agent", "--socket", sock, "--root", t.TempDir()}, &os.ProcAttr{Files: []*os.File{nil, os.Stderr, os.Stderr}})
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			p.Kill()
			p.Wait()
		}()
		pids[i] = p.Pid
		var conn net.Conn
		for deadline := time.Now().Add(10 * time.Second); ; {
			if conn, err = net.Dial("unix", sock); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("agent never listened: %v", err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		if clients[i], err = agentclient.New(conn); err != nil {
			t.Fatal(err)
		}
		defer clients[i].Close()
		if res, err := clients[i].Exec(ctxT(t), agentproto.ExecRequest{Cmd: []string{"sh", "-c", "echo hi"}}); err != nil || res.Stdout != "hi\n" {
			t.Fatalf("exec %+v %v", res, err)
		}
	}
	time.Sleep(agent.DefaultIdleTrim + 500*time.Millisecond) // idle: the agent trims
	for _, pid := range pids {
		kb := smapsRollup(t, pid)
		t.Logf("fresh: agent %d: Rss %d kB, Pss %d kB (anon %d kB, file %d kB)", pid, kb["Rss"], kb["Pss"], kb["Pss_Anon"], kb["Pss_File"])
		if kb["Pss"]*1024 > pssBudget || kb["Anonymous"]*1024 > anonBudget {
			t.Errorf("idle agent %d: Pss %d kB, Anonymous %d kB, want at most %d and %d kB", pid, kb["Pss"], kb["Anonymous"], pssBudget>>10, anonBudget>>10)
		}
	}
	// A burst: execs whose output (escaped into JSON six bytes per NUL)
	// and a large file make the heap grow well beyond the budget.
	for i := 0; i < 20; i++ {
		res, err := clients[0].Exec(ctxT(t), agentproto.ExecRequest{Cmd: []string{"head", "-c", "200000", "/dev/zero"}})
		if err != nil || len(res.Stdout) != 200000 {
			t.Fatalf("exec: %d bytes, %v", len(res.Stdout), err)
		}
	}
	if _, err := clients[0].WriteFile(ctxT(t), "/big", 0o600, strings.NewReader(strings.Repeat("x", 8<<20))); err != nil {
		t.Fatal(err)
	}
	time.Sleep(agent.DefaultIdleTrim + 500*time.Millisecond)
	kb := smapsRollup(t, pids[0])
	t.Logf("after work: agent %d: Rss %d kB, Pss %d kB (anon %d kB, file %d kB)", pids[0], kb["Rss"], kb["Pss"], kb["Pss_Anon"], kb["Pss_File"])
	if kb["Anonymous"]*1024 > anonAfterWork {
		t.Errorf("idle agent after work: Anonymous %d kB, want at most %d kB", kb["Anonymous"], anonAfterWork>>10)
	}
}

// smapsRollup reads /proc/PID/smaps_rollup as kB per field.
func smapsRollup(t *testing.T, pid int) map[string]int {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		t.Skipf("no smaps_rollup: %v", err)
	}
	kb := map[string]int{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[2] == "kB" {
			kb[strings.TrimSuffix(f[0], ":")], _ = strconv.Atoi(f[1])
		}
	}
	return kb
}
