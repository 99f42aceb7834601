package sdk

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

const testKey = "k-secret"

// fakeServer implements a faithful subset of the space API: auth, sandbox
// create/get/list, operation long-poll, commands with a WebSocket attach
// that replays by offset.
type fakeServer struct {
	t  *testing.T
	mu sync.Mutex

	sandboxes map[string]api.Sandbox
	ops       map[string]*api.Operation
	opDoneAt  map[string]time.Time

	// attach behaviour
	attaches      []url0 // query offsets and token of every attach
	tokens        int
	dropFirst     bool   // first attach: send part of stdout, then drop the connection
	onDrop        func() // called as the first attach drops (dropFirst)
	gone          bool   // the command no longer exists: attach answers 404
	stdout        string // full stdout of the command
	stderr        string
	echoStdin     bool // echo stdin frames as stdout until close-stdin
	dropped       *api.Dropped
	exit          api.ExitStatus
	gotResize     []api.Resize
	gotSignals    []string
	lastListQuery string
}

type url0 struct {
	stdoutOff, stderrOff int64
	token                string
}

func newFake(t *testing.T) *fakeServer {
	return &fakeServer{t: t, sandboxes: map[string]api.Sandbox{}, ops: map[string]*api.Operation{}, opDoneAt: map[string]time.Time{}}
}

func writeErr(w http.ResponseWriter, err error, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(errdefs.HTTPStatus(err))
	json.NewEncoder(w).Encode(api.Error{Error: api.ErrorBody{Code: errdefs.Code(err), Message: msg}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

func (f *fakeServer) handler() http.Handler {
	mux := http.NewServeMux()
	auth := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer "+testKey {
				writeErr(w, errdefs.ErrUnauthorized, "bad api key")
				return
			}
			h(w, r)
		}
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, map[string]bool{"ok": true})
	})
	mux.HandleFunc("POST /v1/sandboxes", auth(func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateSandboxRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			writeErr(w, errdefs.ErrInvalidArgument, err.Error())
			return
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		id := fmt.Sprintf("sb-%d", len(f.sandboxes)+1)
		sb := api.Sandbox{ID: id, State: api.StateCreating, Template: req.Template, Limits: req.Limits, Labels: req.Labels}
		op := &api.Operation{ID: "op-" + id, Kind: api.OpCreate, SandboxID: id, State: api.OpRunning}
		f.sandboxes[id] = sb
		f.ops[op.ID] = op
		f.opDoneAt[op.ID] = time.Now().Add(300 * time.Millisecond)
		writeJSON(w, http.StatusAccepted, api.CreateSandboxResponse{Sandbox: sb, Operation: *op})
	}))
	mux.HandleFunc("GET /v1/sandboxes", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.lastListQuery = r.URL.RawQuery
		var out api.SandboxList
		for _, sb := range f.sandboxes {
			out.Sandboxes = append(out.Sandboxes, sb)
		}
		writeJSON(w, 200, out)
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		sb, ok := f.sandboxes[r.PathValue("id")]
		if !ok {
			writeErr(w, errdefs.ErrNotFound, "sandbox "+r.PathValue("id")+" not found")
			return
		}
		writeJSON(w, 200, sb)
	}))
	mux.HandleFunc("GET /v1/operations/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		wait, _ := time.ParseDuration(r.URL.Query().Get("wait"))
		deadline := time.Now().Add(min(wait, 60*time.Second))
		for {
			f.mu.Lock()
			op, ok := f.ops[r.PathValue("id")]
			if !ok {
				f.mu.Unlock()
				writeErr(w, errdefs.ErrNotFound, "no such operation")
				return
			}
			if !op.Done() && time.Now().After(f.opDoneAt[op.ID]) {
				op.State = api.OpSucceeded
				if sb, ok := f.sandboxes[op.SandboxID]; ok {
					sb.State = api.StateRunning
					f.sandboxes[op.SandboxID] = sb
				}
			}
			cp := *op
			f.mu.Unlock()
			if cp.Done() || time.Now().After(deadline) {
				writeJSON(w, 200, cp)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/commands", auth(func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateCommandRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || len(req.Cmd) == 0 {
			writeErr(w, errdefs.ErrInvalidArgument, "bad command")
			return
		}
		if req.Stdin != "" {
			writeErr(w, errdefs.ErrInvalidArgument, "stdin is for sync exec only")
			return
		}
		id := r.PathValue("id")
		writeJSON(w, http.StatusCreated, api.Command{
			ID: "c1", SandboxID: id, Cmd: req.Cmd, State: api.CommandCreated,
			AttachURL: "/v1/sandboxes/" + id + "/commands/c1/attach", AttachToken: "tok-0",
		})
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/commands/{cid}/token", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.tokens++
		tok := "tok-" + strconv.Itoa(f.tokens)
		f.mu.Unlock()
		writeJSON(w, 200, api.Command{ID: r.PathValue("cid"), SandboxID: r.PathValue("id"), AttachToken: tok})
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}/commands/{cid}/attach", f.attach)
	return mux
}

func (f *fakeServer) attach(w http.ResponseWriter, r *http.Request) {
	tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !strings.HasPrefix(tok, "tok-") {
		writeErr(w, errdefs.ErrUnauthorized, "bad attach token")
		return
	}
	f.mu.Lock()
	gone := f.gone
	f.mu.Unlock()
	if gone {
		writeErr(w, errdefs.ErrNotFound, "no such command")
		return
	}
	so, _ := strconv.ParseInt(r.URL.Query().Get("stdout_offset"), 10, 64)
	se, _ := strconv.ParseInt(r.URL.Query().Get("stderr_offset"), 10, 64)
	f.mu.Lock()
	first := len(f.attaches) == 0
	f.attaches = append(f.attaches, url0{so, se, tok})
	f.mu.Unlock()
	c, err := websocket.Accept(w, r, nil)
	if err != nil {
		return
	}
	defer c.CloseNow()
	c.SetReadLimit(api.MaxFrame)
	ctx := r.Context()
	send := func(b []byte) {
		if err := c.Write(ctx, websocket.MessageBinary, b); err != nil {
			f.t.Logf("server write: %v", err)
		}
	}
	sendJSON := func(typ byte, v any) {
		b, _ := json.Marshal(v)
		send(append([]byte{typ}, b...))
	}
	sendJSON(api.FrameStarted, api.Started{Pid: 42})
	if first && f.dropFirst {
		// Deliver the first half of stdout, then vanish without a close frame.
		send(api.EncodeOutput(api.FrameStdout, 0, []byte(f.stdout[:len(f.stdout)/2])))
		time.Sleep(50 * time.Millisecond)
		if f.onDrop != nil {
			f.onDrop()
		}
		return
	}
	if f.echoStdin {
		var off int64
		for {
			typ, data, err := c.Read(ctx)
			if err != nil || typ != websocket.MessageBinary || len(data) == 0 {
				return
			}
			switch data[0] {
			case api.FrameStdin:
				for p := data[1:]; len(p) > 0; {
					n := min(len(p), api.MaxFrame-9)
					send(api.EncodeOutput(api.FrameStdout, off, p[:n]))
					off += int64(n)
					p = p[n:]
				}
			case api.FrameResize:
				var rs api.Resize
				json.Unmarshal(data[1:], &rs)
				f.mu.Lock()
				f.gotResize = append(f.gotResize, rs)
				f.mu.Unlock()
			case api.FrameSignal:
				var sr api.SignalRequest
				json.Unmarshal(data[1:], &sr)
				f.mu.Lock()
				f.gotSignals = append(f.gotSignals, sr.Signal)
				f.mu.Unlock()
			case api.FrameCloseStdin:
				sendJSON(api.FrameExit, f.exit)
				c.Close(websocket.StatusNormalClosure, "")
				return
			}
		}
	}
	// Replay from two bytes before the requested offset: a real server may
	// resend a chunk that straddles the offset; the client must trim it.
	start := max(so-2, 0)
	if start < int64(len(f.stdout)) {
		send(api.EncodeOutput(api.FrameStdout, start, []byte(f.stdout[start:])))
	}
	if f.dropped != nil {
		sendJSON(api.FrameDropped, f.dropped)
	}
	if se < int64(len(f.stderr)) {
		send(api.EncodeOutput(api.FrameStderr, se, []byte(f.stderr[se:])))
	}
	sendJSON(api.FrameExit, f.exit)
	c.Close(websocket.StatusNormalClosure, "")
}

func startFake(t *testing.T, f *fakeServer) *Client {
	t.Helper()
	srv := httptest.NewServer(f.handler())
	t.Cleanup(srv.Close)
	c, err := New(srv.URL, testKey)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestErrorsMatchSentinels(t *testing.T) {
	f := newFake(t)
	c := startFake(t, f)
	ctx := ctxT(t)

	_, err := c.GetSandbox(ctx, "nope")
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetSandbox(missing) = %v, want ErrNotFound", err)
	}
	var ae *APIError
	if !errors.As(err, &ae) || ae.Status != 404 || ae.Code != "not_found" || !strings.Contains(ae.Message, "nope") {
		t.Fatalf("APIError = %+v", ae)
	}

	bad, _ := New(c.BaseURL, "wrong")
	if _, err := bad.ListSandboxes(ctx, ListOptions{}); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Fatalf("wrong key: %v, want ErrUnauthorized", err)
	}
	if _, err := c.GetSandbox(ctx, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("empty id: %v", err)
	}
	if _, err := c.Lifecycle(ctx, "sb-1", "explode"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad verb: %v", err)
	}
}

func TestNonJSONErrorStillMatchesByStatus(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "upstream down", http.StatusBadGateway)
	}))
	defer srv.Close()
	c, _ := New(srv.URL, "")
	_, err := c.Info(ctxT(t))
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "upstream down") {
		t.Fatalf("got %v", err)
	}
}

func TestCreateWaitAndList(t *testing.T) {
	f := newFake(t)
	c := startFake(t, f)
	ctx := ctxT(t)
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Template: "base:latest", Limits: api.Limits{MemoryMiB: 512}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.State != api.StateRunning || sb.Limits.MemoryMiB != 512 {
		t.Fatalf("sandbox after wait: %+v", sb)
	}
	list, err := c.ListSandboxes(ctx, ListOptions{State: "running", Labels: map[string]string{"b": "2", "a": "1"}})
	if err != nil || len(list) != 1 {
		t.Fatalf("list: %v %v", list, err)
	}
	if f.lastListQuery != "label=a%3D1&label=b%3D2&state=running" {
		t.Fatalf("list query %q", f.lastListQuery)
	}
	if _, err := c.WaitOperation(ctx, "op-missing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("wait missing op: %v", err)
	}
}

func TestWaitOperationFailed(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.Operation{ID: "op1", Kind: "pause", SandboxID: "sb", State: api.OpFailed,
			Error: &api.ErrorBody{Code: "not_supported", Message: "runtime native cannot suspend"}})
	}))
	defer srv.Close()
	c, _ := New(srv.URL, "")
	op, err := c.WaitOperation(ctxT(t), "op1")
	if op == nil || !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), "cannot suspend") {
		t.Fatalf("op %v err %v", op, err)
	}
}

func TestAttachReattachesWithOffsets(t *testing.T) {
	f := newFake(t)
	f.dropFirst = true
	f.stdout = "hello, world of sandboxes\n"
	f.stderr = "warn\n"
	f.exit = api.ExitStatus{ExitCode: 3}
	c := startFake(t, f)
	ctx := ctxT(t)

	cmd, err := c.CreateCommand(ctx, "sb-1", api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"x"}}})
	if err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	sess, err := c.Attach(ctx, cmd, AttachOptions{Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatal(err)
	}
	st, err := sess.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if st.ExitCode != 3 {
		t.Fatalf("exit %+v", st)
	}
	if out.String() != f.stdout {
		t.Fatalf("stdout %q, want %q (duplicates or gaps after re-attach)", out.String(), f.stdout)
	}
	if errb.String() != f.stderr {
		t.Fatalf("stderr %q", errb.String())
	}
	if len(f.attaches) != 2 {
		t.Fatalf("attaches %+v, want 2", f.attaches)
	}
	half := int64(len(f.stdout) / 2)
	if a := f.attaches[1]; a.stdoutOff != half || a.stderrOff != 0 || a.token != "tok-1" {
		t.Fatalf("re-attach %+v, want stdout_offset=%d with a refreshed token", a, half)
	}
	if sess.Pid() != 42 {
		t.Fatalf("pid %d", sess.Pid())
	}
	if so, se := sess.Offsets(); so != int64(len(f.stdout)) || se != int64(len(f.stderr)) {
		t.Fatalf("offsets %d %d", so, se)
	}
}

func TestAttachDroppedNote(t *testing.T) {
	f := newFake(t)
	f.stdout = "abc"
	f.stderr = ""
	f.dropped = &api.Dropped{Stream: "stdout", From: 3, To: 1003}
	c := startFake(t, f)
	ctx := ctxT(t)
	cmd := &api.Command{ID: "c1", SandboxID: "sb-1"} // no token: Attach must ask for one
	var out, errb bytes.Buffer
	sess, err := c.Attach(ctx, cmd, AttachOptions{Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Wait(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(errb.String(), "[space: 1000 bytes of output were dropped]") {
		t.Fatalf("stderr %q lacks the dropped note", errb.String())
	}
	if so, _ := sess.Offsets(); so != 1003 {
		t.Fatalf("stdout offset %d after drop, want 1003", so)
	}
}

// TestAttachOnDropped: a caller that pages output by offset is told of the
// loss through OnDropped, in order with the writes, and Stderr carries only
// the process's own bytes.
func TestAttachOnDropped(t *testing.T) {
	f := newFake(t)
	f.stdout = "abc"
	f.stderr = "err"
	f.dropped = &api.Dropped{Stream: "stdout", From: 3, To: 1003}
	c := startFake(t, f)
	var out, errb bytes.Buffer
	var events []string
	sess, err := c.Attach(ctxT(t), &api.Command{ID: "c1", SandboxID: "sb-1"}, AttachOptions{
		Stdout: &out, Stderr: &errb,
		OnDropped: func(stream string, n int64) {
			events = append(events, fmt.Sprintf("%s:%d after %q", stream, n, out.String()))
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Wait(); err != nil {
		t.Fatal(err)
	}
	if errb.String() != "err" {
		t.Fatalf("stderr %q, want only the process's", errb.String())
	}
	if len(events) != 1 || events[0] != `stdout:1000 after "abc"` {
		t.Fatalf("OnDropped calls %q", events)
	}
}

func TestAttachBadTokenIsUnauthorized(t *testing.T) {
	f := newFake(t)
	c := startFake(t, f)
	_, err := c.Attach(ctxT(t), &api.Command{ID: "c1", SandboxID: "sb-1", AttachToken: "forged"}, AttachOptions{})
	if !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Fatalf("got %v, want ErrUnauthorized", err)
	}
}

func TestRunStdinResizeSignal(t *testing.T) {
	f := newFake(t)
	f.echoStdin = true
	f.exit = api.ExitStatus{ExitCode: 0}
	c := startFake(t, f)
	ctx := ctxT(t)
	big := strings.Repeat("x", 200<<10) // spans several stdin frames
	var out bytes.Buffer
	st, err := c.Run(ctx, "sb-1", api.ExecRequest{Cmd: []string{"cat"}, Stdin: big}, &out, nil)
	if err != nil || st.ExitCode != 0 {
		t.Fatalf("run: %+v %v", st, err)
	}
	if out.String() != big {
		t.Fatalf("echoed %d bytes, want %d", out.Len(), len(big))
	}

	f.attaches = nil
	cmd, _ := c.CreateCommand(ctx, "sb-1", api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"sh"}, TTY: true}})
	sess, err := c.Attach(ctx, cmd, AttachOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.Resize(40, 120); err != nil {
		t.Fatal(err)
	}
	if err := sess.Signal("INT"); err != nil {
		t.Fatal(err)
	}
	if err := sess.Resize(0, 1); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("zero resize: %v", err)
	}
	sess.Stdin.Close()
	if _, err := sess.Wait(); err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Stdin.Write([]byte("late")); !errors.Is(err, ErrSessionClosed) {
		t.Fatalf("write after exit: %v", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.gotResize) != 1 || f.gotResize[0] != (api.Resize{Rows: 40, Cols: 120}) || len(f.gotSignals) != 1 || f.gotSignals[0] != "INT" {
		t.Fatalf("resize %v signals %v", f.gotResize, f.gotSignals)
	}
}

func TestUnixSocketBaseURL(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "space.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	f := newFake(t)
	srv := &http.Server{Handler: f.handler()}
	go srv.Serve(ln)
	defer srv.Close()
	for _, base := range []string{"unix://" + sock, "unix:" + sock} {
		c, err := New(base, testKey)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Health(ctxT(t)); err != nil {
			t.Fatalf("%s: %v", base, err)
		}
	}
}

func TestNewRejectsBadURLs(t *testing.T) {
	for _, u := range []string{"ftp://x", "127.0.0.1:7070", "http://", "unix://", "http://h/?q=1"} {
		if _, err := New(u, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("New(%q) = %v, want ErrInvalidArgument", u, err)
		}
	}
	c, err := New("", "")
	if err != nil || c.BaseURL != DefaultURL {
		t.Fatalf("default: %v %v", c, err)
	}
}
