package agentclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// wsMsg is one WebSocket message a fake agent sends on an attach.
type wsMsg struct {
	typ websocket.MessageType
	b   []byte
}

func binFrame(b []byte) wsMsg { return wsMsg{websocket.MessageBinary, b} }

func jsonFrame(typ byte, v any) wsMsg {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return binFrame(append([]byte{typ}, b...))
}

func outFrame(typ byte, off int64, s string) wsMsg {
	return binFrame(api.EncodeOutput(typ, off, []byte(s)))
}

var (
	startedFrame = jsonFrame(api.FrameStarted, api.Started{Pid: 42})
	exitFrame    = jsonFrame(api.FrameExit, api.ExitStatus{ExitCode: 3})
)

// attachTo attaches, through Client.Attach, to a fake agent that sends
// msgs and then closes the stream (or, with hold, keeps it open until the
// client goes).
func attachTo(t *testing.T, hold bool, msgs ...wsMsg) *websocket.Conn {
	t.Helper()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, &websocket.AcceptOptions{CompressionMode: websocket.CompressionDisabled})
		if err != nil {
			return
		}
		defer c.CloseNow()
		for _, m := range msgs {
			if err := c.Write(r.Context(), m.typ, m.b); err != nil {
				return
			}
		}
		if hold {
			c.Read(r.Context()) // until the client closes
			return
		}
		c.Close(websocket.StatusNormalClosure, "")
	})
	c := fakeAgent(t, h, 5*time.Second)
	conn, err := c.Attach(frameCtx(t), "p1", 0, 0)
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	t.Cleanup(func() { conn.CloseNow() })
	return conn
}

func frameCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// next reads a frame that must be good.
func nextFrame(t *testing.T, r *FrameReader) (api.Frame, []byte) {
	t.Helper()
	f, b, err := r.Next(frameCtx(t))
	if err != nil {
		t.Fatalf("Next: %v", err)
	}
	return f, b
}

func TestFramesStream(t *testing.T) {
	full := outFrame(api.FrameStderr, 5, strings.Repeat("x", api.MaxFrame-9))
	dropped := jsonFrame(api.FrameDropped, api.Dropped{Stream: "stdout", From: 3, To: 9})
	sent := []wsMsg{startedFrame, outFrame(api.FrameStdout, 0, "hello"), full, dropped, exitFrame}
	// Output after the exit frame is never read.
	r := Frames(attachTo(t, true, append(sent, outFrame(api.FrameStdout, 5, "late"))...))
	for i, m := range sent {
		f, b := nextFrame(t, r)
		if f.Type != m.b[0] || !bytes.Equal(b, m.b) {
			t.Fatalf("frame %d: type %d, %d bytes; sent type %d, %d bytes", i, f.Type, len(b), m.b[0], len(m.b))
		}
		switch f.Type {
		case api.FrameStarted:
			if f.Started.Pid != 42 {
				t.Errorf("started %+v", f.Started)
			}
		case api.FrameStdout:
			if f.Offset != 0 || string(f.Data) != "hello" {
				t.Errorf("stdout %d %q", f.Offset, f.Data)
			}
		case api.FrameStderr:
			if f.Offset != 5 || len(f.Data) != api.MaxFrame-9 {
				t.Errorf("stderr at %d, %d bytes", f.Offset, len(f.Data))
			}
		case api.FrameDropped:
			if f.Dropped != (api.Dropped{Stream: "stdout", From: 3, To: 9}) {
				t.Errorf("dropped %+v", f.Dropped)
			}
		case api.FrameExit:
			if f.Exit.ExitCode != 3 {
				t.Errorf("exit %+v", f.Exit)
			}
		}
	}
	for range 2 {
		if f, _, err := r.Next(frameCtx(t)); err != io.EOF {
			t.Fatalf("after the exit frame: %+v, %v; want io.EOF", f, err)
		}
	}
}

func TestFramesHostile(t *testing.T) {
	hugeName := jsonFrame(api.FrameDropped, api.Dropped{Stream: strings.Repeat("\x1b[31m", 10000), From: 1, To: 2})
	badOffset := outFrame(api.FrameStdout, 0, "x")
	badOffset.b[1] = 0x80
	for _, tc := range []struct {
		name string
		msgs []wsMsg // the last one is refused
	}{
		{"text message", []wsMsg{startedFrame, {websocket.MessageText, []byte{api.FrameStdout, 0, 0, 0, 0, 0, 0, 0, 0, 'x'}}}},
		{"text message first", []wsMsg{{websocket.MessageText, []byte("hello")}}},
		{"empty message", []wsMsg{startedFrame, binFrame(nil)}},
		{"output shorter than its offset", []wsMsg{startedFrame, binFrame([]byte{api.FrameStdout, 0, 0, 0})}},
		{"output offset out of range", []wsMsg{startedFrame, badOffset}},
		{"truncated exit", []wsMsg{startedFrame, binFrame(append([]byte{api.FrameExit}, `{"exit_code":`...))}},
		{"exit code out of range", []wsMsg{startedFrame, jsonFrame(api.FrameExit, api.ExitStatus{ExitCode: 256})}},
		{"truncated started", []wsMsg{binFrame([]byte{api.FrameStarted, '{'})}},
		{"dropped backwards", []wsMsg{startedFrame, jsonFrame(api.FrameDropped, api.Dropped{Stream: "stderr", From: 9, To: 3})}},
		{"dropped of a long, hostile stream name", []wsMsg{startedFrame, hugeName}},
		{"unknown type", []wsMsg{startedFrame, binFrame([]byte{9, 'x'})}},
		{"type 255", []wsMsg{startedFrame, binFrame([]byte{255})}},
		{"stdin from the agent", []wsMsg{startedFrame, binFrame([]byte{api.FrameStdin, 'x'})}},
		{"close stdin from the agent", []wsMsg{startedFrame, binFrame([]byte{api.FrameCloseStdin})}},
		{"resize from the agent", []wsMsg{startedFrame, jsonFrame(api.FrameResize, api.Resize{Rows: 1, Cols: 1})}},
		{"signal from the agent", []wsMsg{startedFrame, jsonFrame(api.FrameSignal, api.SignalRequest{Signal: "KILL"})}},
		{"one byte over MaxFrame", []wsMsg{startedFrame, outFrame(api.FrameStdout, 0, strings.Repeat("x", api.MaxFrame-8))}},
		{"far over MaxFrame", []wsMsg{startedFrame, binFrame(make([]byte, 4*api.MaxFrame))}},
		{"output before started", []wsMsg{outFrame(api.FrameStdout, 0, "x")}},
		{"dropped before started", []wsMsg{jsonFrame(api.FrameDropped, api.Dropped{Stream: "stdout", From: 0, To: 1})}},
		{"exit before started", []wsMsg{exitFrame}},
		{"started twice", []wsMsg{startedFrame, outFrame(api.FrameStdout, 0, "x"), startedFrame}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Frames(attachTo(t, true, tc.msgs...))
			for range tc.msgs[:len(tc.msgs)-1] {
				nextFrame(t, r)
			}
			f, b, err := r.Next(frameCtx(t))
			if !errors.Is(err, ErrBadFrame) || !errors.Is(err, errdefs.ErrUnavailable) {
				t.Fatalf("got %+v (%d bytes), %v; want ErrBadFrame and ErrUnavailable", f, len(b), err)
			}
			if msg := err.Error(); len(msg) > 2*maxMessage || strings.ContainsRune(msg, 0x1b) {
				t.Errorf("error text not bounded and clean: %d bytes: %.200q", len(msg), msg)
			}
		})
	}
}

func TestFramesAgentGoneIsNotABadFrame(t *testing.T) {
	r := Frames(attachTo(t, false, startedFrame, outFrame(api.FrameStdout, 0, "x")))
	nextFrame(t, r)
	nextFrame(t, r)
	_, _, err := r.Next(frameCtx(t))
	if !errors.Is(err, errdefs.ErrUnavailable) || errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), "went away before the process exited") {
		t.Fatalf("stream closed before the exit frame: %v", err)
	}
}

func TestFramesContextEnds(t *testing.T) {
	r := Frames(attachTo(t, true, startedFrame))
	nextFrame(t, r)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, _, err := r.Next(ctx); err != context.Canceled {
		t.Fatalf("Next after cancel: %v; want context.Canceled itself", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	r = Frames(attachTo(t, true, startedFrame))
	nextFrame(t, r)
	if _, _, err := r.Next(ctx); err != context.DeadlineExceeded {
		t.Fatalf("Next past the deadline: %v; want context.DeadlineExceeded itself", err)
	}
}

func TestFramesTrimOverlap(t *testing.T) {
	msgs := []wsMsg{
		startedFrame,
		outFrame(api.FrameStdout, 0, "hello"),
		outFrame(api.FrameStdout, 0, "hello"),    // replayed whole: skipped
		outFrame(api.FrameStdout, 2, "llo"),      // replayed whole, ending where returned: skipped
		outFrame(api.FrameStdout, 3, "lo world"), // overlaps: " world" at 5
		outFrame(api.FrameStderr, 0, "err"),      // its own stream
		outFrame(api.FrameStdout, 5, ""),         // empty, inside: skipped
		jsonFrame(api.FrameDropped, api.Dropped{Stream: "stdout", From: 11, To: 20}),
		outFrame(api.FrameStdout, 20, "gap"), // after a gap: as it is
		outFrame(api.FrameStdout, 21, "ap!"), // "!" at 23
		outFrame(api.FrameStderr, 1, "rr2"),  // "2" at 3
		exitFrame,
	}
	type got struct {
		typ  byte
		off  int64
		data string
	}
	read := func(r *FrameReader) []got {
		var gs []got
		for {
			f, b, err := r.Next(frameCtx(t))
			if err == io.EOF {
				return gs
			}
			if err != nil {
				t.Fatalf("Next: %v", err)
			}
			if f.Type == api.FrameStdout || f.Type == api.FrameStderr {
				if !bytes.Equal(b, api.EncodeOutput(f.Type, f.Offset, f.Data)) {
					t.Errorf("raw bytes %q do not say frame %d %d %q", b, f.Type, f.Offset, f.Data)
				}
				gs = append(gs, got{f.Type, f.Offset, string(f.Data)})
			}
		}
	}
	want := []got{
		{api.FrameStdout, 0, "hello"}, {api.FrameStdout, 5, " world"}, {api.FrameStderr, 0, "err"},
		{api.FrameStdout, 20, "gap"}, {api.FrameStdout, 23, "!"}, {api.FrameStderr, 3, "2"},
	}
	if gs := read(Frames(attachTo(t, true, msgs...), TrimOverlap())); !slices.Equal(gs, want) {
		t.Errorf("trimmed:\n got %+v\nwant %+v", gs, want)
	}
	// Without TrimOverlap every frame passes as the agent sent it.
	var all []got
	for _, m := range msgs {
		if m.b[0] == api.FrameStdout || m.b[0] == api.FrameStderr {
			f, _ := api.DecodeFrame(m.b)
			all = append(all, got{f.Type, f.Offset, string(f.Data)})
		}
	}
	if gs := read(Frames(attachTo(t, true, msgs...))); !slices.Equal(gs, all) {
		t.Errorf("untrimmed:\n got %+v\nwant %+v", gs, all)
	}
}
