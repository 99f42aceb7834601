package hostproc

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"syscall"
	"testing"
	"time"
)

// startSleep starts a child that runs until killed; it is killed and
// reaped at the end of the test unless the test reaps it itself.
func startSleep(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: not closed after 10s", what)
	}
}

// waitZombie waits until pid (a child not reaped) is a zombie.
func waitZombie(t *testing.T, pid int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if st, err := stat(pid); errors.Is(err, ErrNotRunning) && st.PID == 0 {
			return
		}
	}
	t.Fatalf("process %d did not become a zombie", pid)
}

func TestPidFileRoundTrip(t *testing.T) {
	cmd := startSleep(t)
	rec, err := Identify(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Pid != cmd.Process.Pid || rec.StartTime == 0 {
		t.Fatalf("Identify = %+v", rec)
	}
	path := filepath.Join(t.TempDir(), "x.pid")
	if err := WritePidFile(path, rec); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path + ".tmp"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("temporary file left behind: %v", err)
	}
	got, err := ReadPidFile(path)
	if err != nil || got != rec {
		t.Fatalf("ReadPidFile = %+v, %v; want %+v", got, err, rec)
	}
	if _, err := ReadPidFile(filepath.Join(t.TempDir(), "none")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing pid file: %v", err)
	}
	for _, bad := range []string{"", "x y", "1 123\n", "0 5\n", "-3 5\n"} {
		if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
			t.Fatal(err)
		}
		if rec, err := ReadPidFile(path); err == nil {
			t.Errorf("ReadPidFile(%q) = %+v, want an error", bad, rec)
		}
	}
}

func TestOpenLiveness(t *testing.T) {
	cmd := startSleep(t)
	rec, err := Identify(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Open(rec)
	if err != nil {
		t.Fatalf("Open of a running process: %v", err)
	}
	if p.Pid() != rec.Pid || p.Record() != rec {
		t.Fatalf("Open: %+v, want %+v", p.Record(), rec)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	// The same pid with another start time is another process.
	if p, err := Open(Record{Pid: rec.Pid, StartTime: rec.StartTime + 1}); !errors.Is(err, ErrNotRunning) {
		if p != nil {
			p.Close()
		}
		t.Fatalf("Open with a mismatched start time: %v, want ErrNotRunning", err)
	}
	if _, err := Open(Record{Pid: 0}); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("Open of pid 0: %v", err)
	}
}

// TestZombieIsNotRunning: a process that exited but was not reaped keeps
// its pid and start time; it must not be re-adopted.
func TestZombieIsNotRunning(t *testing.T) {
	cmd := startSleep(t)
	rec, err := Identify(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitZombie(t, rec.Pid) // not reaped: cmd.Wait runs at cleanup
	if p, err := Open(rec); !errors.Is(err, ErrNotRunning) {
		if p != nil {
			p.Close()
		}
		t.Fatalf("Open of a zombie: %v, want ErrNotRunning", err)
	}
	if _, err := OpenPid(rec.Pid); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("OpenPid of a zombie: %v, want ErrNotRunning", err)
	}
	if _, err := StartTime(rec.Pid); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("StartTime of a zombie: %v, want ErrNotRunning", err)
	}
	_ = cmd.Wait()
	if _, err := Open(rec); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("Open of a reaped process: %v, want ErrNotRunning", err)
	}
}

func TestExitedAndSignal(t *testing.T) {
	cmd := startSleep(t)
	p, err := OpenPid(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	ex := p.Exited()
	if p.Exited() != ex {
		t.Fatal("Exited returned two channels")
	}
	select {
	case <-ex:
		t.Fatal("Exited closed while the process runs")
	case <-time.After(100 * time.Millisecond):
	}
	if err := p.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("signal 0 to a running process: %v", err)
	}
	if err := p.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Fires on the exit itself, before anyone reaps the child.
	waitClosed(t, ex, "Exited")
	if err := p.Signal(syscall.SIGKILL); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("Signal after the exit: %v, want ErrNotRunning", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close after Exited: %v", err)
	}
}

// TestExitedHoldsNoThread: many watched processes cost no OS thread each
// (the wait parks in the runtime's poller).
func TestExitedHoldsNoThread(t *testing.T) {
	const n = 40
	threads := pprof.Lookup("threadcreate")
	before := threads.Count()
	var chans []<-chan struct{}
	var cmds []*exec.Cmd
	for range n {
		cmd := startSleep(t)
		p, err := OpenPid(cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, p.Exited())
		cmds = append(cmds, cmd)
	}
	time.Sleep(200 * time.Millisecond) // let every watch reach its wait
	if grown := threads.Count() - before; grown >= n/2 {
		t.Fatalf("%d watched processes created %d OS threads", n, grown)
	}
	for i, cmd := range cmds {
		_ = cmd.Process.Kill()
		waitClosed(t, chans[i], "Exited")
	}
}

func TestRunning(t *testing.T) {
	if Running(nil) {
		t.Error("a nil channel (nothing watched) is running")
	}
	ch := make(chan struct{})
	if !Running(ch) {
		t.Error("an open channel is not running")
	}
	close(ch)
	if Running(ch) {
		t.Error("a closed channel is running")
	}
}
