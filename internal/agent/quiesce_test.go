package agent

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

func dialAgent(t *testing.T, sock string) *agentclient.Client {
	t.Helper()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func exists(p string) bool { _, err := os.Lstat(p); return err == nil }

// accepting reports whether a unix socket takes connections: its file
// appears at bind, a moment before listen (CI once dialled in between).
func accepting(sock string) bool {
	c, err := net.Dial("unix", sock)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// TestQuiesceAndResume: a quiesce answers 204, then ends every host
// session and removes the socket; nothing can connect until the resume
// marker appears; then the agent listens again with its processes intact,
// and can be quiesced again.
func TestQuiesceAndResume(t *testing.T) {
	a, err := New(Config{Root: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	dir, err := os.MkdirTemp("", "agq")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "agent.sock")
	marker := sock + ResumeSuffix
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- a.serveSocket(ctx, sock) }()
	waitFor(t, "socket", func() bool { return accepting(sock) })

	c1, c2 := dialAgent(t, sock), dialAgent(t, sock)
	if _, err := c1.StartProc(ctx, agentproto.ProcStart{ID: "sleeper", Cmd: []string{"sleep", "60"}}); err != nil {
		t.Fatal(err)
	}
	// A stale marker must not end the quiesce at once.
	if err := os.WriteFile(marker, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 2; round++ {
		if err := c1.Quiesce(ctx); err != nil {
			t.Fatalf("round %d: quiesce: %v", round, err)
		}
		c1.Close() // as the manager does; c2 is left for the agent to close
		for _, c := range []*agentclient.Client{c1, c2} {
			select {
			case <-c.Done():
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: a host session survived the quiesce", round)
			}
		}
		waitFor(t, "socket removal", func() bool { return !exists(sock) })
		time.Sleep(20 * resumePoll)
		if exists(sock) {
			t.Fatalf("round %d: agent listens again without the marker", round)
		}
		if exists(marker) {
			t.Fatalf("round %d: stale marker not removed by the quiesce", round)
		}
		t0 := time.Now()
		if err := os.WriteFile(marker, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "listening again", func() bool { return accepting(sock) })
		t.Logf("round %d: marker → listening in %v", round, time.Since(t0))
		c1 = dialAgent(t, sock)
		c2 = dialAgent(t, sock)
		info, err := c1.Proc(ctx, "sleeper")
		if err != nil || !info.Running {
			t.Fatalf("round %d: process lost across quiesce: %+v %v", round, info, err)
		}
		waitFor(t, "marker removal", func() bool { return !exists(marker) })
	}
	select {
	case err := <-served:
		t.Fatalf("serveSocket returned: %v", err)
	default:
	}
}

// TestQuiesceFDModeDropsSessions: on an inherited listener the agent only
// drops its sessions and keeps accepting.
func TestQuiesceFDModeDropsSessions(t *testing.T) {
	a, err := New(Config{Root: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	dir, err := os.MkdirTemp("", "agq")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go a.Serve(ln)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := dialAgent(t, sock)
	if err := c.Quiesce(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("session survived the quiesce")
	}
	if _, err := dialAgent(t, sock).Health(ctx); err != nil {
		t.Fatalf("listener gone after a quiesce in fd mode: %v", err)
	}
}

// TestRestored: the seed is bounded, a hostname is validated and lands in
// /etc/hostname below the agent's root; an agent that does not own the
// system leaves the host's hostname alone.
func TestRestored(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("parent\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := New(Config{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	dir, err := os.MkdirTemp("", "agr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go a.Serve(ln)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := dialAgent(t, sock)
	hostBefore, _ := os.Hostname()
	seed := bytes.Repeat([]byte{7}, 64)
	for _, bad := range []agentproto.Restored{
		{Seed: seed[:8]},
		{Seed: make([]byte, maxSeed+1)},
		{Seed: seed, Hostname: "bad/name"},
		{Seed: seed, Hostname: "-x"},
	} {
		if err := c.Restored(ctx, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Restored(seed %d, %q) = %v, want invalid argument", len(bad.Seed), bad.Hostname, err)
		}
	}
	if err := c.Restored(ctx, agentproto.Restored{Seed: seed, Hostname: "child-1", TimeUnixNano: 1}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "etc/hostname"))
	if err != nil || string(b) != "child-1\n" {
		t.Fatalf("/etc/hostname = %q %v", b, err)
	}
	if h, _ := os.Hostname(); h != hostBefore {
		t.Fatalf("host hostname changed to %q", h)
	}
	if time.Since(time.Unix(0, 1)) < time.Hour {
		t.Fatal("clock moved")
	}
}
