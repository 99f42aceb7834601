package agent_test

import (
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentproto"
)

// startGated starts `read x; <script>` so the output begins only after
// the test sends a line on stdin (over c, once attached).
func startGated(t *testing.T, e *env, id, script string) {
	t.Helper()
	if _, err := e.c.StartProc(ctxT(t), agentproto.ProcStart{ID: id, Cmd: []string{"sh", "-c", "read x; " + script}}); err != nil {
		t.Fatal(err)
	}
}

// TestAttachGetsEveryByte: a flood 50 times the ring reaches a live,
// reading attach in full — the process waits for the client instead of
// overwriting what it has not been sent.
func TestAttachGetsEveryByte(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	const total = 50_000_000
	startGated(t, e, "f", "head -c 50000000 /dev/zero; echo done >&2")
	c, err := e.c.Attach(ctx, "f", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readFrame(t, ctx, c) // FrameStarted: the attach is live
	send(t, ctx, c, api.FrameStdin, []byte("go\n"))
	s.readAll(t, ctx, c)
	if len(s.dropped) != 0 {
		t.Fatalf("dropped %+v", s.dropped)
	}
	if s.stdout.Len() != total || s.offsets[0] != total || strings.Trim(s.stdout.String(), "\x00") != "" {
		t.Fatalf("stdout %d bytes (offset %d), want %d zeros", s.stdout.Len(), s.offsets[0], total)
	}
	if s.stderr.String() != "done\n" || s.exit.ExitCode != 0 {
		t.Fatalf("stderr %q exit %+v", s.stderr.String(), s.exit)
	}
}

// TestAttachStalledIsBounded: an attached client that never reads holds
// the process back for about Config.AttachStall, then no longer; reading
// later it gets Dropped markers that account for every lost byte.
func TestAttachStalledIsBounded(t *testing.T) {
	const stall = 700 * time.Millisecond
	e := newEnv(t, agent.Config{RingBytes: 64 << 10, AttachStall: stall})
	ctx := ctxT(t)
	const total = 8 << 20
	startGated(t, e, "f", "head -c 8388608 /dev/zero")
	c, err := e.c.Attach(ctx, "f", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readFrame(t, ctx, c)
	send(t, ctx, c, api.FrameStdin, []byte("go\n"))
	start := time.Now()
	waitExited(t, e, "f")
	took := time.Since(start)
	// The stall is noticed per holding episode, and an attach that does
	// not read cannot advance at all, so the process is held about once.
	if took < stall/2 || took > stall+5*time.Second {
		t.Fatalf("flood took %v with a stalled attach, want about %v", took, stall)
	}
	s.readAll(t, ctx, c)
	var lost int64
	for _, d := range s.dropped {
		lost += d.To - d.From
	}
	if len(s.dropped) == 0 || lost+int64(s.stdout.Len()) != total || s.offsets[0] != total {
		t.Fatalf("received %d + dropped %d (%d markers), want %d", s.stdout.Len(), lost, len(s.dropped), total)
	}
}

// TestFloodUnattachedNeverBlocks: with no attach (never one, or one that
// has gone) a flood runs at full speed and overwrites the ring.
func TestFloodUnattachedNeverBlocks(t *testing.T) {
	e := newEnv(t, agent.Config{AttachStall: time.Minute})
	ctx := ctxT(t)
	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "a", Cmd: []string{"head", "-c", "50000000", "/dev/zero"}}); err != nil {
		t.Fatal(err)
	}
	waitExited(t, e, "a") // fails after 10 s; the held case would take a minute

	// An attach that left must not hold the process either.
	startGated(t, e, "b", "head -c 50000000 /dev/zero")
	c, err := e.c.Attach(ctx, "b", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readFrame(t, ctx, c)
	send(t, ctx, c, api.FrameStdin, []byte("go\n"))
	c.Close(websocket.StatusNormalClosure, "")
	waitExited(t, e, "b")

	for _, id := range []string{"a", "b"} {
		c, err := e.c.Attach(ctx, id, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		var s session
		s.readAll(t, ctx, c)
		if len(s.dropped) != 1 || s.dropped[0].To != 50_000_000-agentproto.DefaultRingBytes || s.offsets[0] != 50_000_000 {
			t.Fatalf("%s: dropped %+v, offset %d", id, s.dropped, s.offsets[0])
		}
	}
}

// TestAttachSlowReaderGetsTail: output still held back in the pipe when
// the process exits reaches a slow reader in full, although draining it
// takes longer than the post-exit drain grace (250 ms).
func TestAttachSlowReaderGetsTail(t *testing.T) {
	e := newEnv(t, agent.Config{RingBytes: 64 << 10})
	ctx := ctxT(t)
	const total = 640 << 10
	startGated(t, e, "f", "head -c 655360 /dev/zero")
	c, err := e.c.Attach(ctx, "f", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readFrame(t, ctx, c)
	send(t, ctx, c, api.FrameStdin, []byte("go\n"))
	for n := 0; s.readFrame(t, ctx, c); n = s.stdout.Len() {
		// 4 ms per KiB: the 96 KiB in the pipe and pump take ~400 ms.
		time.Sleep(time.Duration(s.stdout.Len()-n) * 4 * time.Millisecond / 1024)
	}
	if len(s.dropped) != 0 || s.stdout.Len() != total {
		t.Fatalf("received %d of %d bytes, dropped %+v", s.stdout.Len(), total, s.dropped)
	}
}

// TestHoldForAttach: a process started for an attach that comes a moment
// later loses nothing to that moment, however fast it writes; if the attach
// never comes, the hold ends after the stall like a stalled attach's.
func TestHoldForAttach(t *testing.T) {
	const stall = 700 * time.Millisecond
	e := newEnv(t, agent.Config{RingBytes: 64 << 10, AttachStall: stall})
	ctx := ctxT(t)
	const total = 8 << 20
	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "held", Cmd: []string{"head", "-c", "8388608", "/dev/zero"}, HoldForAttach: true}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // far more than 64 KiB of output's worth
	c, err := e.c.Attach(ctx, "held", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var s session
	s.readAll(t, ctx, c)
	if len(s.dropped) != 0 || s.stdout.Len() != total {
		t.Fatalf("received %d of %d bytes, dropped %+v", s.stdout.Len(), total, s.dropped)
	}

	if _, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "orphan", Cmd: []string{"head", "-c", "8388608", "/dev/zero"}, HoldForAttach: true}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waitExited(t, e, "orphan")
	if took := time.Since(start); took < stall/2 {
		t.Fatalf("an unattached held process finished in %v: the hold did not hold", took)
	}
}
