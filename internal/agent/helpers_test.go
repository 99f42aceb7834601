package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
)

// env is an in-process agent on a unix socket with a temporary --root.
type env struct {
	root string
	a    *agent.Agent
	c    *agentclient.Client
	sock string
}

func newEnv(t *testing.T, cfg agent.Config) *env {
	t.Helper()
	if cfg.Root == "" {
		cfg.Root = t.TempDir()
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "agt")
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go a.Serve(ln)
	e := &env{root: cfg.Root, a: a, sock: sock}
	e.c = e.dial(t)
	t.Cleanup(func() {
		e.c.Close()
		ln.Close()
		a.Close()
		os.RemoveAll(dir)
	})
	return e
}

func (e *env) dial(t *testing.T) *agentclient.Client {
	t.Helper()
	conn, err := net.Dial("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantErr(t *testing.T, err, sentinel error) {
	t.Helper()
	if !errors.Is(err, sentinel) {
		t.Fatalf("error = %v, want %v", err, sentinel)
	}
}

func writeRootFile(t *testing.T, root, rel, content string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// session is what one attach received.
type session struct {
	started  *api.Started
	stdout   strings.Builder
	stderr   strings.Builder
	dropped  []api.Dropped
	exit     *api.ExitStatus
	offsets  [2]int64 // next expected offset per stream
	frames   int
	afterEnd bool // a frame arrived after FrameExit
}

// readFrame reads and records one frame; it returns false after FrameExit
// or when the connection ends.
func (s *session) readFrame(t *testing.T, ctx context.Context, c *websocket.Conn) bool {
	t.Helper()
	typ, data, err := c.Read(ctx)
	if err != nil {
		if s.exit == nil {
			t.Fatalf("attach ended before FrameExit: %v", err)
		}
		return false
	}
	if typ != websocket.MessageBinary || len(data) == 0 {
		t.Fatalf("bad frame type %v len %d", typ, len(data))
	}
	if s.exit != nil {
		s.afterEnd = true
	}
	s.frames++
	switch data[0] {
	case api.FrameStarted:
		if s.frames != 1 {
			t.Fatalf("FrameStarted is frame %d", s.frames)
		}
		s.started = new(api.Started)
		mustJSON(t, data[1:], s.started)
	case api.FrameStdout, api.FrameStderr:
		i := int(data[0] - api.FrameStdout)
		off, b, err := api.DecodeOutput(data[1:])
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > 32<<10 {
			t.Fatalf("output frame carries %d bytes", len(b))
		}
		if off != s.offsets[i] {
			t.Fatalf("stream %d: frame offset %d, expected %d", i, off, s.offsets[i])
		}
		s.offsets[i] = off + int64(len(b))
		if i == 0 {
			s.stdout.Write(b)
		} else {
			s.stderr.Write(b)
		}
	case api.FrameDropped:
		var d api.Dropped
		mustJSON(t, data[1:], &d)
		s.dropped = append(s.dropped, d)
		i := 0
		if d.Stream == "stderr" {
			i = 1
		}
		if d.From != s.offsets[i] {
			t.Fatalf("dropped from %d, expected %d", d.From, s.offsets[i])
		}
		s.offsets[i] = d.To
	case api.FrameExit:
		s.exit = new(api.ExitStatus)
		mustJSON(t, data[1:], s.exit)
		return false
	default:
		t.Fatalf("unexpected frame type %d", data[0])
	}
	return true
}

// readAll reads frames until FrameExit and checks the connection then closes.
func (s *session) readAll(t *testing.T, ctx context.Context, c *websocket.Conn) {
	t.Helper()
	for s.readFrame(t, ctx, c) {
	}
	if s.exit == nil {
		t.Fatal("no FrameExit")
	}
	_, _, err := c.Read(ctx)
	if websocket.CloseStatus(err) != websocket.StatusNormalClosure {
		t.Fatalf("after FrameExit: %v, want normal closure", err)
	}
}

// readUntil reads frames until stdout contains want.
func (s *session) readUntil(t *testing.T, ctx context.Context, c *websocket.Conn, want string) {
	t.Helper()
	for !strings.Contains(s.stdout.String(), want) {
		if !s.readFrame(t, ctx, c) {
			t.Fatalf("stdout %q never contained %q", s.stdout.String(), want)
		}
	}
}

func mustJSON(t *testing.T, b []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("decoding %q: %v", b, err)
	}
}

func send(t *testing.T, ctx context.Context, c *websocket.Conn, typ byte, payload []byte) {
	t.Helper()
	if err := c.Write(ctx, websocket.MessageBinary, append([]byte{typ}, payload...)); err != nil {
		t.Fatal(err)
	}
}

func sendJSON(t *testing.T, ctx context.Context, c *websocket.Conn, typ byte, v any) {
	t.Helper()
	b, _ := json.Marshal(v)
	send(t, ctx, c, typ, b)
}

var osStat = os.Stat

func itoa(n int) string { return strconv.Itoa(n) }
