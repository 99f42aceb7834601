package agent_test

import (
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

func TestProcSessionReplay(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	pi, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "p1", Cmd: []string{"sh", "-c", "echo out; echo err >&2; read x; echo got $x; exit 5"}})
	if err != nil {
		t.Fatal(err)
	}
	if !pi.Running || pi.Pid == 0 || pi.ID != "p1" {
		t.Fatalf("info = %+v", pi)
	}
	c, err := e.c.Attach(ctx, "p1", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readUntil(t, ctx, c, "out\n")
	if s.started == nil || s.started.Pid != pi.Pid {
		t.Fatalf("started = %+v", s.started)
	}
	send(t, ctx, c, api.FrameStdin, []byte("hi\n"))
	s.readAll(t, ctx, c)
	if s.stdout.String() != "out\ngot hi\n" || s.stderr.String() != "err\n" || s.exit.ExitCode != 5 || s.afterEnd {
		t.Fatalf("stdout=%q stderr=%q exit=%+v", s.stdout.String(), s.stderr.String(), s.exit)
	}

	// Re-attach after exit: the whole output is replayed, then the exit.
	c2, err := e.c.Attach(ctx, "p1", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s2 session
	s2.readAll(t, ctx, c2)
	if s2.stdout.String() != "out\ngot hi\n" || s2.stderr.String() != "err\n" || s2.exit.ExitCode != 5 {
		t.Fatalf("replay stdout=%q stderr=%q exit=%+v", s2.stdout.String(), s2.stderr.String(), s2.exit)
	}
	// From offsets: only what was missed.
	c3, err := e.c.Attach(ctx, "p1", 4, 4)
	if err != nil {
		t.Fatal(err)
	}
	s3 := session{offsets: [2]int64{4, 4}}
	s3.readAll(t, ctx, c3)
	if s3.stdout.String() != "got hi\n" || s3.stderr.String() != "" || len(s3.dropped) != 0 {
		t.Fatalf("offset replay stdout=%q stderr=%q dropped=%v", s3.stdout.String(), s3.stderr.String(), s3.dropped)
	}
	pi, err = e.c.Proc(ctx, "p1")
	if err != nil || pi.Running || pi.Exit == nil || pi.Exit.ExitCode != 5 {
		t.Fatalf("proc = %+v, %v", pi, err)
	}
	_, err = e.c.Attach(ctx, "p1", -1, 0)
	wantErr(t, err, errdefs.ErrInvalidArgument)
	if err := e.c.ForgetProc(ctx, "p1"); err != nil {
		t.Fatal(err)
	}
	_, err = e.c.Attach(ctx, "p1", 0, 0)
	wantErr(t, err, errdefs.ErrNotFound)
}

func TestProcConcurrentAttachAndCloseStdin(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "cat", Cmd: []string{"cat"}}); err != nil {
		t.Fatal(err)
	}
	c1, err := e.c.Attach(ctx, "cat", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	c2, err := e.dial(t).Attach(ctx, "cat", 0, 0) // a second session, too
	if err != nil {
		t.Fatal(err)
	}
	var s1, s2 session
	// Two sessions' stdin frames have no order between them: wait for the
	// echo of the first before sending the second.
	send(t, ctx, c1, api.FrameStdin, []byte("one\n"))
	s1.readUntil(t, ctx, c1, "one\n")
	send(t, ctx, c2, api.FrameStdin, []byte("two\n"))
	s1.readUntil(t, ctx, c1, "two\n")
	s2.readUntil(t, ctx, c2, "two\n")
	send(t, ctx, c1, api.FrameCloseStdin, nil)
	s1.readAll(t, ctx, c1)
	s2.readAll(t, ctx, c2)
	if s1.stdout.String() != "one\ntwo\n" || s2.stdout.String() != "one\ntwo\n" || s1.exit.ExitCode != 0 {
		t.Fatalf("s1=%q s2=%q exit=%+v", s1.stdout.String(), s2.stdout.String(), s1.exit)
	}
}

func TestProcDroppedAfterFlood(t *testing.T) {
	e := newEnv(t, agent.Config{RingBytes: 4096})
	ctx := ctxT(t)
	const total = 300_000
	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "flood", Cmd: []string{"sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a; echo tail >&2"}}); err != nil {
		t.Fatal(err)
	}
	// Nobody attached: the flood must not block the process.
	waitExited(t, e, "flood")
	c, err := e.c.Attach(ctx, "flood", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readAll(t, ctx, c)
	if len(s.dropped) != 1 || s.dropped[0] != (api.Dropped{Stream: "stdout", From: 0, To: total - 4096}) {
		t.Fatalf("dropped = %+v", s.dropped)
	}
	if s.stdout.Len() != 4096 || strings.Trim(s.stdout.String(), "a") != "" || s.stderr.String() != "tail\n" {
		t.Fatalf("stdout len %d stderr %q", s.stdout.Len(), s.stderr.String())
	}
	if s.exit.ExitCode != 0 {
		t.Fatalf("exit = %+v", s.exit)
	}
}

func waitExited(t *testing.T, e *env, id string) agentproto.ProcInfo {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		pi, err := e.c.Proc(ctxT(t), id)
		if err != nil {
			t.Fatal(err)
		}
		if !pi.Running {
			return pi
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %s still running", id)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestProcPTY(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "tty", Cmd: []string{"sh", "-i"}, TTY: true, Rows: 30, Cols: 100, Env: []string{"PS1=$ "}}); err != nil {
		t.Fatal(err)
	}
	c, err := e.c.Attach(ctx, "tty", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	send(t, ctx, c, api.FrameStdin, []byte("echo $TERM; stty size\n"))
	s.readUntil(t, ctx, c, "30 100")
	if !strings.Contains(s.stdout.String(), "echo $TERM; stty size") {
		t.Fatalf("no echo of the input: %q", s.stdout.String())
	}
	if !strings.Contains(s.stdout.String(), "xterm-256color") {
		t.Fatalf("TERM not set: %q", s.stdout.String())
	}
	sendJSON(t, ctx, c, api.FrameResize, api.Resize{Rows: 41, Cols: 121})
	send(t, ctx, c, api.FrameStdin, []byte("stty size\n"))
	s.readUntil(t, ctx, c, "41 121")

	// Ctrl-C through the terminal kills the foreground sleep, not the shell.
	start := time.Now()
	send(t, ctx, c, api.FrameStdin, []byte("sleep 30\n"))
	time.Sleep(300 * time.Millisecond)
	send(t, ctx, c, api.FrameStdin, []byte{0x03})
	send(t, ctx, c, api.FrameStdin, []byte("echo alive$((40+2))\n"))
	s.readUntil(t, ctx, c, "alive42")
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("sleep was not interrupted (%v)", d)
	}
	send(t, ctx, c, api.FrameStdin, []byte("exit 9\n"))
	s.readAll(t, ctx, c)
	if s.exit.ExitCode != 9 || s.stderr.Len() != 0 {
		t.Fatalf("exit=%+v stderr=%q", s.exit, s.stderr.String())
	}
}

func TestProcSignalsAndTable(t *testing.T) {
	e := newEnv(t, agent.Config{MaxProcs: 3})
	ctx := ctxT(t)
	start := func(id string, cmd ...string) error {
		_, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: id, Cmd: cmd})
		return err
	}
	if err := start("s1", "sleep", "30"); err != nil {
		t.Fatal(err)
	}
	wantErr(t, start("s1", "true"), errdefs.ErrConflict)
	wantErr(t, start("bad/id", "true"), errdefs.ErrInvalidArgument)
	wantErr(t, start("", "true"), errdefs.ErrInvalidArgument)
	wantErr(t, e.c.Signal(ctx, "s1", "NOPE"), errdefs.ErrInvalidArgument)
	wantErr(t, e.c.Signal(ctx, "s1", "99"), errdefs.ErrInvalidArgument)
	wantErr(t, e.c.Signal(ctx, "missing", "TERM"), errdefs.ErrNotFound)
	if err := e.c.Signal(ctx, "s1", "TERM"); err != nil {
		t.Fatal(err)
	}
	pi := waitExited(t, e, "s1")
	if pi.Exit.Signal != "TERM" || pi.Exit.ExitCode != 143 {
		t.Fatalf("exit = %+v", pi.Exit)
	}
	wantErr(t, e.c.Signal(ctx, "s1", "KILL"), errdefs.ErrConflict)

	if err := start("s2", "sleep", "30"); err != nil {
		t.Fatal(err)
	}
	if err := start("s3", "sleep", "30"); err != nil {
		t.Fatal(err)
	}
	wantErr(t, start("s4", "true"), errdefs.ErrConflict) // the table is full
	procs, err := e.c.Procs(ctx)
	if err != nil || len(procs) != 3 || procs[0].ID != "s1" || procs[2].ID != "s3" {
		t.Fatalf("procs = %+v, %v", procs, err)
	}
	// Forgetting a running process kills it.
	pid := procs[1].Pid
	if err := e.c.ForgetProc(ctx, "s2"); err != nil {
		t.Fatal(err)
	}
	wantErr(t, e.c.ForgetProc(ctx, "s2"), errdefs.ErrNotFound)
	deadline := time.Now().Add(5 * time.Second)
	for zombieOrAlive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("forgotten process %d still exists", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := start("s4", "true"); err != nil {
		t.Fatal(err)
	}
	// A signal frame on the attach reaches the process group.
	c, err := e.c.Attach(ctx, "s3", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	sendJSON(t, ctx, c, api.FrameSignal, api.SignalRequest{Signal: "INT"})
	var s session
	s.readAll(t, ctx, c)
	if s.exit.Signal != "INT" || s.exit.ExitCode != 130 {
		t.Fatalf("exit = %+v", s.exit)
	}
}

func zombieOrAlive(pid int) bool {
	_, err := osStat("/proc/" + itoa(pid))
	return err == nil
}

// TestProcSlowAttach: a live attach that does not read while the process
// floods holds it back only for Config.AttachStall, then gets Dropped
// markers and still accounts for every byte offset.
func TestProcSlowAttach(t *testing.T) {
	e := newEnv(t, agent.Config{RingBytes: 4096, AttachStall: 200 * time.Millisecond})
	ctx := ctxT(t)
	const total = 4 << 20
	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "f", Cmd: []string{"sh", "-c", "sleep 0.2; head -c 4194304 /dev/zero"}}); err != nil {
		t.Fatal(err)
	}
	c, err := e.c.Attach(ctx, "f", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	waitExited(t, e, "f") // the flood finishes although nobody reads
	var s session
	s.readAll(t, ctx, c)
	if len(s.dropped) == 0 || s.offsets[0] != total {
		t.Fatalf("dropped=%v final offset %d, want drops and %d", s.dropped, s.offsets[0], total)
	}
	var lost int64
	for _, d := range s.dropped {
		lost += d.To - d.From
	}
	if lost+int64(s.stdout.Len()) != total {
		t.Fatalf("received %d + dropped %d != %d", s.stdout.Len(), lost, total)
	}
}
