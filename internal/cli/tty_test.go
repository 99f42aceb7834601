package cli

import (
	"context"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
)

// TestExecTTY drives `space exec -it` from a real pseudo-terminal: the
// window size goes into the request, SIGWINCH becomes a resize frame,
// Ctrl-C travels as a byte (raw mode) and the terminal is restored.
func TestExecTTY(t *testing.T) {
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Skipf("no pty: %v", err)
	}
	defer ptmx.Close()
	defer tty.Close()
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 30, Cols: 100}); err != nil {
		t.Fatal(err)
	}
	before, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}

	f, url := newFakeServer(t)
	f.stdout, f.exit = "^C", api.ExitStatus{ExitCode: 130}
	f.attached = make(chan struct{})
	attached := f.attached
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out, errb strings.Builder
	codeCh := make(chan int, 1)
	go func() {
		codeCh <- Execute(ctx, []string{"--url", url, "--api-key", key, "exec", "-it", "sb-1", "--", "bash"}, tty, &out, &errb)
	}()
	select {
	case <-attached:
	case <-ctx.Done():
		t.Fatal("never attached")
	}
	f.mu.Lock()
	req := f.commands[0]
	f.mu.Unlock()
	if !req.TTY || req.Rows != 30 || req.Cols != 100 {
		t.Fatalf("request %+v: want tty 30x100", req.ExecRequest)
	}
	raw, _ := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if raw.Lflag&unix.ICANON != 0 || raw.Lflag&unix.ISIG != 0 {
		t.Fatalf("terminal not in raw mode while attached")
	}

	pty.Setsize(ptmx, &pty.Winsize{Rows: 50, Cols: 160})
	// The CLI starts listening for SIGWINCH just after attaching, so the
	// signal is repeated until a resize arrives.
	deadline := time.Now().Add(5 * time.Second)
	for {
		syscall.Kill(os.Getpid(), syscall.SIGWINCH)
		f.mu.Lock()
		n := len(f.resizes)
		f.mu.Unlock()
		if n > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	ptmx.Write([]byte("ls\x03"))
	var code int
	select {
	case code = <-codeCh:
	case <-ctx.Done():
		t.Fatal("exec -it did not finish after Ctrl-C")
	}
	if code != 130 || out.String() != "^C" {
		t.Fatalf("code %d out %q err %q", code, out.String(), errb.String())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if string(f.stdinSeen) != "ls\x03" {
		t.Fatalf("stdin %q", f.stdinSeen)
	}
	if len(f.resizes) == 0 || f.resizes[0] != (api.Resize{Rows: 50, Cols: 160}) {
		t.Fatalf("resizes %v", f.resizes)
	}
	after, _ := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if after.Lflag != before.Lflag || after.Iflag != before.Iflag || after.Oflag != before.Oflag {
		t.Fatalf("terminal not restored")
	}
}

// TestBuildBaseProgressBars renders build-base progress with mpb on a real
// terminal and still ends with the template.
func TestBuildBaseProgressBars(t *testing.T) {
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Skipf("no pty: %v", err)
	}
	defer ptmx.Close()
	defer tty.Close()
	pty.Setsize(ptmx, &pty.Winsize{Rows: 24, Cols: 120})
	var screen strings.Builder
	read := make(chan struct{})
	go func() {
		defer close(read)
		buf := make([]byte, 4096)
		for {
			n, err := ptmx.Read(buf)
			screen.Write(buf[:n])
			if err != nil || strings.Contains(screen.String(), "sha256:aa") {
				return
			}
		}
	}()
	_, url := newFakeServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var errb strings.Builder
	code := Execute(ctx, []string{"--url", url, "--api-key", key, "template", "build-base"}, strings.NewReader(""), tty, &errb)
	if code != 0 {
		t.Fatalf("code %d: %s", code, errb.String())
	}
	select {
	case <-read:
	case <-ctx.Done():
		t.Fatalf("no template on screen; got %q", screen.String())
	}
	if s := screen.String(); !strings.Contains(s, "download") || !strings.Contains(s, "unpack") {
		t.Fatalf("progress bars missing: %q", s)
	}
}
