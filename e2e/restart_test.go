package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cli"
	"github.com/spacehq/space/internal/testenv"
)

// lockedBuffer is a bytes.Buffer safe to read while the CLI writes to it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestExecOutlivesServerRestart: `space exec` keeps its command while the
// server is killed and started again under it. The command prints, then
// waits for a file that is only created after the restart, prints again and
// exits 3: the CLI must re-attach to the new server, deliver both lines
// once each and exit with the command's code. (It used to try one
// re-attach, get "connection refused" and exit 125.)
func TestExecOutlivesServerRestart(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	bin := buildSpace(t)
	root, err := os.MkdirTemp("", "sr-") // short: sandbox socket paths live under it
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	data := filepath.Join(root, "data")
	addr := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	p := startServer(t, bin, data, addr)
	defer func() { p.kill9() }()
	c := p.client(t)
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	key, err := os.ReadFile(filepath.Join(data, "api-key"))
	if err != nil {
		t.Fatal(err)
	}
	var out, errOut lockedBuffer
	done := make(chan int, 1)
	go func() {
		done <- cli.Execute(ctx, []string{"--url", p.url, "--api-key", strings.TrimSpace(string(key)),
			"exec", sb.ID, "--", "sh", "-c", "echo before; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo after; exit 3"},
			strings.NewReader(""), &out, &errOut)
	}()
	for deadline := time.Now().Add(time.Minute); out.String() != "before\n"; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("command did not start: stdout %q stderr %q", out.String(), errOut.String())
		}
	}

	p.kill9()
	time.Sleep(time.Second) // the CLI meets a refused connection at least once
	p = startServer(t, bin, data, addr)
	c = p.client(t)
	if _, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"touch", "/tmp/go"}}); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-done:
		if code != 3 || out.String() != "before\nafter\n" {
			t.Fatalf("exit code %d, stdout %q, stderr %q; want 3 and both lines once", code, out.String(), errOut.String())
		}
	case <-time.After(90 * time.Second):
		t.Fatalf("space exec did not finish after the restart: stdout %q stderr %q", out.String(), errOut.String())
	}
	op, err := c.DeleteSandbox(ctx, sb.ID, true)
	if err == nil {
		_, err = c.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatal(err)
	}
}
