package sdk

import (
	"bytes"
	"errors"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// TestAttachOutlivesServerRestart: the server goes away mid-stream (its
// listener closed, connections refused) and comes back on the same address
// 1.5 s later; Wait keeps re-attaching with backoff and delivers the whole
// output and the exit status. It used to re-attach once and fail.
func TestAttachOutlivesServerRestart(t *testing.T) {
	f := newFake(t)
	f.dropFirst = true
	f.stdout = "before the restart | after the restart\n"
	f.exit = api.ExitStatus{ExitCode: 3}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	srv := &http.Server{Handler: f.handler()}
	go srv.Serve(l)
	defer srv.Close()
	back := make(chan *http.Server, 1)
	f.onDrop = func() {
		l.Close()
		go func() {
			time.Sleep(1500 * time.Millisecond)
			l2, err := net.Listen("tcp", addr)
			if err != nil {
				t.Errorf("listening again on %s: %v", addr, err)
				back <- nil
				return
			}
			srv2 := &http.Server{Handler: f.handler()}
			go srv2.Serve(l2)
			back <- srv2
		}()
	}
	c, err := New("http://"+addr, testKey)
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	cmd, err := c.CreateCommand(ctx, "sb-1", api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"x"}}})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	sess, err := c.Attach(ctx, cmd, AttachOptions{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	st, err := sess.Wait()
	if srv2 := <-back; srv2 != nil {
		defer srv2.Close()
	}
	if err != nil || st.ExitCode != 3 || out.String() != f.stdout {
		t.Fatalf("after a server restart: exit %+v, err %v, stdout %q", st, err, out.String())
	}
}

// TestAttachReattachGivesUp: re-attaching stops at once on an answer that
// will not change (the command is gone), and after ReattachTimeout while the
// server stays unreachable.
func TestAttachReattachGivesUp(t *testing.T) {
	for _, gone := range []bool{true, false} {
		f := newFake(t)
		f.dropFirst = true
		f.stdout = "some output\n"
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: f.handler()}
		go srv.Serve(l)
		f.onDrop = func() {
			f.mu.Lock()
			f.gone = gone
			f.mu.Unlock()
			if !gone {
				l.Close()
			}
		}
		c, _ := New("http://"+l.Addr().String(), testKey)
		ctx := ctxT(t)
		cmd, _ := c.CreateCommand(ctx, "sb-1", api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"x"}}})
		sess, err := c.Attach(ctx, cmd, AttachOptions{ReattachTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		_, err = sess.Wait()
		d := time.Since(t0)
		srv.Close()
		switch {
		case gone && (!errors.Is(err, ErrNotFound) || d > 500*time.Millisecond):
			t.Errorf("command gone: %v after %s, want not found at once", err, d)
		case !gone && (err == nil || d < time.Second || d > 4*time.Second):
			t.Errorf("server down: %v after %s, want an error after about 1s", err, d)
		}
	}
}
