package agentclient

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// connCounter is an http.Server.ConnState hook that counts the streams
// (connections, to the agent's HTTP server) execs arrived on.
type connCounter struct {
	mu    sync.Mutex
	conns map[net.Conn]bool
}

func (cc *connCounter) state(c net.Conn, s http.ConnState) {
	if s == http.StateNew {
		cc.mu.Lock()
		cc.conns[c] = true
		cc.mu.Unlock()
	}
}

func (cc *connCounter) n() int {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return len(cc.conns)
}

// Sequential execs share one kept stream: one round trip per command, no
// stream opened per call; an error answer does not cost the stream either.
func TestExecKeepsItsStream(t *testing.T) {
	cc := &connCounter{conns: map[net.Conn]bool{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/exec", func(w http.ResponseWriter, r *http.Request) {
		var req agentproto.ExecRequest
		if err := decodeBody(r, &req); err != nil || len(req.Cmd) == 0 {
			http.Error(w, "bad", 400)
			return
		}
		if req.Cmd[0] == "missing" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			w.Write([]byte(`{"error":{"code":"not_found","message":"executable \"missing\" not found"}}`))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"exit_code":3,"stdout":"` + strings.Join(req.Cmd, " ") + `"}`))
	})
	c := fakeAgentWith(t, mux, time.Second, cc.state)
	ctx := context.Background()
	for i := 0; i < 20; i++ {
		res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"echo", "hi"}})
		if err != nil || res.ExitCode != 3 || res.Stdout != "echo hi" {
			t.Fatalf("exec %d: %v %+v", i, err, res)
		}
		if i == 10 {
			_, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"missing"}})
			wantIs(t, err, errdefs.ErrNotFound, "not found")
		}
	}
	if n := cc.n(); n != 1 {
		t.Fatalf("21 sequential execs used %d streams, want 1", n)
	}
	// Concurrent execs each get a stream of their own.
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"x"}}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := cc.n(); n < 1 || n > 4 {
		t.Fatalf("4 concurrent execs: %d streams in all", n)
	}
}

// A stream idle for longer than execIdleTimeout is not reused (the agent
// closes idle streams after 5 s), and one the agent closed is not either.
func TestExecDropsIdleAndClosedStreams(t *testing.T) {
	cc := &connCounter{conns: map[net.Conn]bool{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/exec", func(w http.ResponseWriter, r *http.Request) {
		var req agentproto.ExecRequest
		decodeBody(r, &req)
		if req.Cmd[0] == "close" {
			w.Header().Set("Connection", "close")
		}
		w.Write([]byte(`{"exit_code":0}`))
	})
	c := fakeAgentWith(t, mux, time.Second, cc.state)
	ctx := context.Background()
	exec := func(cmd string) {
		t.Helper()
		if _, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{cmd}}); err != nil {
			t.Fatal(err)
		}
	}
	exec("a")
	c.execs.mu.Lock()
	c.execs.idle[0].idle = time.Now().Add(-execIdleTimeout)
	c.execs.mu.Unlock()
	exec("b")
	if n := cc.n(); n != 2 {
		t.Fatalf("an expired idle stream was reused: %d streams", n)
	}
	exec("close")
	exec("c")
	if n := cc.n(); n != 3 {
		t.Fatalf("a stream the agent closed was reused: %d streams", n)
	}
}

// The hostile cases of the exec stream: giant headers, a body over the
// call's limit, headers that never come (the call's own timeout), a body
// that stops after the headers, and the caller going away — which closes
// the stream, the agent's signal to kill the process.
func TestExecHostileAgent(t *testing.T) {
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	gone := make(chan struct{}, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/exec", func(w http.ResponseWriter, r *http.Request) {
		var req agentproto.ExecRequest
		decodeBody(r, &req)
		switch req.Cmd[0] {
		case "bigheader":
			w.Header().Set("X-Big", strings.Repeat("h", 1<<20))
			w.Write([]byte(`{}`))
		case "bigbody":
			w.Write([]byte(`{"stdout":"`))
			chunk := []byte(strings.Repeat("a", 1<<20))
			for i := 0; i < 40; i++ {
				if _, err := w.Write(chunk); err != nil {
					return
				}
			}
		case "noheaders", "wait":
			select {
			case <-block:
			case <-r.Context().Done():
				gone <- struct{}{}
			}
		case "stall":
			w.Header().Set("Content-Length", "100")
			w.Write([]byte(`{"exit_code":`))
			w.(http.Flusher).Flush()
			select {
			case <-block:
			case <-r.Context().Done():
			}
		case "ok":
			w.Write([]byte(`{"exit_code":0}`))
		case "garbage":
			hj, _ := w.(http.Hijacker)
			conn, _, _ := hj.Hijack()
			conn.Write([]byte("this is not HTTP\r\n\r\n"))
			conn.Close()
		}
	})
	c := fakeAgentWith(t, mux, 2*time.Second, nil)
	ctx := context.Background()
	run := func(cmd string, timeout float64) error {
		_, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{cmd}, MaxOutputBytes: 64 << 10, TimeoutSeconds: timeout})
		return err
	}
	within(t, 10*time.Second, func() { wantIs(t, run("bigheader", 5), errdefs.ErrUnavailable, "headers exceed") })
	within(t, 10*time.Second, func() { wantIs(t, run("bigbody", 5), errdefs.ErrUnavailable, "exceeds") })
	within(t, 10*time.Second, func() { wantIs(t, run("garbage", 5), errdefs.ErrUnavailable, "") })
	within(t, 5*time.Second, func() { wantIs(t, run("stall", 5), errdefs.ErrTimeout, "") })
	// The call's deadline: the exec's timeout plus execGrace, shortened
	// here through the call's context deadline instead.
	dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	within(t, 5*time.Second, func() {
		_, err := c.Exec(dctx, agentproto.ExecRequest{Cmd: []string{"noheaders"}})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want context.DeadlineExceeded", err)
		}
	})
	<-gone
	cctx, cancel2 := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel2)
	within(t, 5*time.Second, func() {
		_, err := c.Exec(cctx, agentproto.ExecRequest{Cmd: []string{"wait"}})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	})
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("the agent did not see the caller go away")
	}
	// After all that, the client still works.
	within(t, 5*time.Second, func() {
		if err := run("ok", 5); err != nil {
			t.Fatal(err)
		}
	})
}

// fakeAgentWith is fakeAgent with a ConnState hook on the agent's server.
func fakeAgentWith(t *testing.T, h http.Handler, timeout time.Duration, state func(net.Conn, http.ConnState)) *Client {
	t.Helper()
	hostEnd, agentEnd := pair(t)
	sess, err := yamux.Server(agentEnd, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ConnState: state}
	go srv.Serve(sess)
	c, err := newClient(hostEnd, timeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); srv.Close(); sess.Close() })
	return c
}

func decodeBody(r *http.Request, v any) error {
	return json.NewDecoder(r.Body).Decode(v)
}
