package agentclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

func pair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "sock")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	return conn(fds[0]), conn(fds[1])
}

// fakeAgent serves h as a hostile agent would: over a yamux server session.
func fakeAgent(t *testing.T, h http.Handler, timeout time.Duration) *Client {
	t.Helper()
	hostEnd, agentEnd := pair(t)
	sess, err := yamux.Server(agentEnd, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(sess)
	c, err := newClient(hostEnd, timeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); srv.Close(); sess.Close() })
	return c
}

func within(t *testing.T, d time.Duration, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("call hung for more than %v", d)
	}
}

func TestHostileAgent(t *testing.T) {
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/health", func(w http.ResponseWriter, r *http.Request) {
		switch r.Header.Get("X-Test") {
		}
		w.Write([]byte(`{"version":"`))
		chunk := []byte(strings.Repeat("a", 64<<10))
		for i := 0; i < 64; i++ { // 4 MiB
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
		w.Write([]byte(`","pid":1}`))
	})
	mux.HandleFunc("GET /v1/procs", func(w http.ResponseWriter, r *http.Request) { // never answers
		select {
		case <-block:
		case <-r.Context().Done():
		}
	})
	mux.HandleFunc("GET /v1/procs/{id}", func(w http.ResponseWriter, r *http.Request) { // invalid JSON
		w.Write([]byte(`{"id": "x", "pid": [}`))
	})
	mux.HandleFunc("GET /v1/files/stat", func(w http.ResponseWriter, r *http.Request) { // giant header
		w.Header().Set("X-Big", strings.Repeat("h", 1<<20))
		w.Write([]byte(`{}`))
	})
	mux.HandleFunc("GET /v1/files/list", func(w http.ResponseWriter, r *http.Request) { // dribbles forever
		w.Write([]byte(`{"entries":[`))
		for {
			w.(http.Flusher).Flush()
			select {
			case <-block:
				return
			case <-r.Context().Done():
				return
			case <-time.After(50 * time.Millisecond):
				w.Write([]byte(" "))
			}
		}
	})
	mux.HandleFunc("POST /v1/files/mkdir", func(w http.ResponseWriter, r *http.Request) { // long, hostile error
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"error":{"code":"not_found","message":"%s\u001b[31m%s"}}`, strings.Repeat("m", 3000), "\\n")
	})
	mux.HandleFunc("POST /v1/files/rename", func(w http.ResponseWriter, r *http.Request) { // invented code
		w.WriteHeader(http.StatusTeapot)
		w.Write([]byte(`{"error":{"code":"teapot","message":"short and stout"}}`))
	})
	mux.HandleFunc("DELETE /v1/files", func(w http.ResponseWriter, r *http.Request) { // error that is not JSON
		w.WriteHeader(http.StatusInternalServerError)
		w.Write([]byte("<html>oops</html>"))
	})
	mux.HandleFunc("GET /v1/files", func(w http.ResponseWriter, r *http.Request) { // headers never come
		<-block
	})
	mux.HandleFunc("GET /v1/files/tar", func(w http.ResponseWriter, r *http.Request) { // error body dribbles
		w.WriteHeader(http.StatusNotFound)
		for {
			w.(http.Flusher).Flush()
			select {
			case <-block:
				return
			case <-r.Context().Done():
				return
			case <-time.After(50 * time.Millisecond):
				w.Write([]byte(" "))
			}
		}
	})
	mux.HandleFunc("POST /v1/exec", func(w http.ResponseWriter, r *http.Request) { // exceeds even exec's bound
		w.Write([]byte(`{"stdout":"`))
		chunk := []byte(strings.Repeat("a", 1<<20))
		for i := 0; i < 40; i++ {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	c := fakeAgent(t, mux, 300*time.Millisecond)
	ctx := context.Background()

	within(t, 10*time.Second, func() {
		_, err := c.Health(ctx)
		wantIs(t, err, errdefs.ErrUnavailable, "exceeds")
	})
	within(t, 5*time.Second, func() {
		_, err := c.Procs(ctx)
		wantIs(t, err, errdefs.ErrTimeout, "")
	})
	within(t, 5*time.Second, func() {
		_, err := c.Proc(ctx, "x")
		wantIs(t, err, errdefs.ErrUnavailable, "malformed")
	})
	within(t, 5*time.Second, func() {
		_, err := c.Stat(ctx, "/x")
		wantIs(t, err, errdefs.ErrUnavailable, "")
	})
	within(t, 5*time.Second, func() {
		_, err := c.List(ctx, "/x")
		wantIs(t, err, errdefs.ErrTimeout, "")
	})
	within(t, 5*time.Second, func() {
		_, err := c.Mkdir(ctx, "/x", 0)
		wantIs(t, err, errdefs.ErrNotFound, "mmmm")
		if len(err.Error()) > 1200 || strings.ContainsAny(err.Error(), "\x1b\n") {
			t.Fatalf("agent message not truncated/sanitized: %d bytes %q", len(err.Error()), err.Error()[len(err.Error())-40:])
		}
	})
	within(t, 5*time.Second, func() {
		wantIs(t, c.Rename(ctx, "/a", "/b"), errdefs.ErrUnavailable, "short and stout")
	})
	within(t, 5*time.Second, func() {
		wantIs(t, c.Remove(ctx, "/a", false), errdefs.ErrUnavailable, "status 500")
	})
	within(t, 5*time.Second, func() {
		_, err := c.ReadFile(ctx, "/a")
		wantIs(t, err, errdefs.ErrTimeout, "")
	})
	within(t, 5*time.Second, func() {
		_, err := c.TarGet(ctx, "/a")
		wantIs(t, err, errdefs.ErrTimeout, "")
	})
	within(t, 10*time.Second, func() {
		_, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"x"}, MaxOutputBytes: 64 << 10, TimeoutSeconds: 5})
		wantIs(t, err, errdefs.ErrUnavailable, "exceeds")
	})
	within(t, 5*time.Second, func() {
		_, err := c.Attach(ctx, "x", 0, 0) // a 200 instead of a 101
		wantIs(t, err, errdefs.ErrUnavailable, "")
	})
	// The caller's own cancellation is reported as such.
	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	within(t, 5*time.Second, func() {
		_, err := c.Procs(cctx)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	})
}

func wantIs(t *testing.T, err, sentinel error, contains string) {
	t.Helper()
	if !errors.Is(err, sentinel) || !strings.Contains(fmt.Sprint(err), contains) {
		t.Fatalf("err = %.300v; want %v containing %q", err, sentinel, contains)
	}
}

// TestGarbageStream: an "agent" that speaks no yamux at all.
func TestGarbageStream(t *testing.T) {
	hostEnd, agentEnd := pair(t)
	defer agentEnd.Close()
	c, err := newClient(hostEnd, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		io.Copy(io.Discard, io.LimitReader(agentEnd, 1)) // wait for the client to speak
		agentEnd.Write([]byte(strings.Repeat("\xff garbage \x00", 1000)))
	}()
	within(t, 5*time.Second, func() {
		_, err := c.Health(context.Background())
		wantIs(t, err, errdefs.ErrUnavailable, "")
	})
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("session not reported dead")
	}
	within(t, 5*time.Second, func() {
		_, err := c.Health(context.Background())
		wantIs(t, err, errdefs.ErrUnavailable, "")
	})
}

// TestAgentOpensStreams: streams opened by the agent are never accepted;
// at most one is parked, the rest are reset, so they pin no memory.
func TestAgentOpensStreams(t *testing.T) {
	hostEnd, agentEnd := pair(t)
	sess, err := yamux.Server(agentEnd, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	c, err := newClient(hostEnd, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	within(t, 20*time.Second, func() {
		for i := 0; i < 50; i++ {
			s, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			s.SetWriteDeadline(time.Now().Add(200 * time.Millisecond))
			s.Write(make([]byte, 64<<10))
		}
	})
	time.Sleep(100 * time.Millisecond)
	if n := c.sess.NumStreams(); n > 1 {
		t.Fatalf("client holds %d agent-opened streams", n)
	}
	// The session still works for the client's own calls.
	if c.sess.IsClosed() {
		t.Fatal("session died")
	}
}
