package api

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
)

func TestDecodeFrame(t *testing.T) {
	withJSON := func(typ byte, s string) []byte { return append([]byte{typ}, s...) }
	hugeOffset := make([]byte, 9)
	hugeOffset[0] = FrameStdout
	binary.BigEndian.PutUint64(hugeOffset[1:], 1<<63)
	maxOffset := EncodeOutput(FrameStderr, 1<<62, []byte("z"))
	full := EncodeOutput(FrameStdout, 7, bytes.Repeat([]byte("x"), MaxFrame-9))
	over := EncodeOutput(FrameStdout, 7, bytes.Repeat([]byte("x"), MaxFrame-8))
	deep := withJSON(FrameExit, strings.Repeat("[", MaxFrame-1))

	for _, c := range []struct {
		name  string
		frame []byte
		err   string // "" = valid
		check func(Frame) bool
	}{
		// valid frames of every type
		{"stdin", []byte{FrameStdin, 'h', 'i'}, "", func(f Frame) bool { return string(f.Data) == "hi" }},
		{"empty stdin", []byte{FrameStdin}, "", func(f Frame) bool { return len(f.Data) == 0 }},
		{"stdout", EncodeOutput(FrameStdout, 42, []byte("out")), "", func(f Frame) bool { return f.Offset == 42 && string(f.Data) == "out" }},
		{"stderr at the largest offset", maxOffset, "", func(f Frame) bool { return f.Type == FrameStderr && f.Offset == 1<<62 }},
		{"output of exactly MaxFrame bytes", full, "", func(f Frame) bool { return len(f.Data) == MaxFrame-9 }},
		{"resize", withJSON(FrameResize, `{"rows":50,"cols":132}`), "", func(f Frame) bool { return f.Resize == Resize{Rows: 50, Cols: 132} }},
		{"signal", withJSON(FrameSignal, `{"signal":"TERM"}`), "", func(f Frame) bool { return f.Signal.Signal == "TERM" }},
		{"exit 0", withJSON(FrameExit, `{"exit_code":0}`), "", func(f Frame) bool { return f.Exit.ExitCode == 0 }},
		{"exit by signal", withJSON(FrameExit, `{"exit_code":137,"signal":"KILL","oom_killed":true}`), "",
			func(f Frame) bool { return f.Exit.ExitCode == 137 && f.Exit.Signal == "KILL" && f.Exit.OOMKilled }},
		{"exit 255", withJSON(FrameExit, `{"exit_code":255}`), "", func(f Frame) bool { return f.Exit.ExitCode == 255 }},
		{"dropped", withJSON(FrameDropped, `{"stream":"stderr","from":3,"to":9}`), "", func(f Frame) bool { return f.Dropped == Dropped{"stderr", 3, 9} }},
		{"dropped nothing", withJSON(FrameDropped, `{"stream":"stdout","from":4,"to":4}`), "", nil},
		{"close stdin", []byte{FrameCloseStdin}, "", func(f Frame) bool { return f.Type == FrameCloseStdin }},
		{"started", withJSON(FrameStarted, `{"pid":7}`), "", func(f Frame) bool { return f.Started.Pid == 7 }},

		// hostile or broken frames
		{"nil", nil, "empty frame", nil},
		{"empty", []byte{}, "empty frame", nil},
		{"over MaxFrame", over, "over the limit", nil},
		{"unknown type", []byte{9}, "unknown frame type 9", nil},
		{"type 255", []byte{255, '{', '}'}, "unknown frame type 255", nil},
		{"output without offset", []byte{FrameStdout, 0, 0, 1}, "shorter than its offset", nil},
		{"output offset past 2^62", hugeOffset, "out of range", nil},
		{"exit without payload", []byte{FrameExit}, "exit frame", nil},
		{"exit bad json", withJSON(FrameExit, `{`), "exit frame", nil},
		{"exit trailing data", withJSON(FrameExit, `{"exit_code":0}{}`), "exit frame", nil},
		{"exit code negative", withJSON(FrameExit, `{"exit_code":-1}`), "out of range", nil},
		{"exit code 256", withJSON(FrameExit, `{"exit_code":256}`), "out of range", nil},
		{"exit code huge", withJSON(FrameExit, `{"exit_code":99999999999999999999}`), "exit frame", nil},
		{"exit code a string", withJSON(FrameExit, `{"exit_code":"0"}`), "exit frame", nil},
		{"exit nested deep", deep, "exit frame", nil},
		{"resize out of range", withJSON(FrameResize, `{"rows":70000,"cols":1}`), "resize frame", nil},
		{"resize negative", withJSON(FrameResize, `{"rows":-1,"cols":1}`), "resize frame", nil},
		{"signal not json", withJSON(FrameSignal, `TERM`), "signal frame", nil},
		{"dropped reversed", withJSON(FrameDropped, `{"stream":"stdout","from":10,"to":5}`), "bad range", nil},
		{"dropped negative", withJSON(FrameDropped, `{"stream":"stdout","from":-5,"to":5}`), "bad range", nil},
		{"dropped unknown stream", withJSON(FrameDropped, `{"stream":"etc","from":0,"to":5}`), "unknown stream", nil},
		{"dropped no stream", withJSON(FrameDropped, `{"from":0,"to":5}`), "unknown stream", nil},
		{"started negative pid", withJSON(FrameStarted, `{"pid":-1}`), "pid -1", nil},
		{"started bad json", withJSON(FrameStarted, `null x`), "started frame", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, err := DecodeFrame(c.frame)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err %v, want one containing %q", err, c.err)
				}
				if f.Type != 0 || f.Data != nil {
					t.Fatalf("a refused frame decoded to %+v", f)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if f.Type != c.frame[0] {
				t.Fatalf("type %d, want %d", f.Type, c.frame[0])
			}
			if c.check != nil && !c.check(f) {
				t.Fatalf("decoded %+v", f)
			}
		})
	}
}

// FuzzDecodeFrame: whatever the bytes, DecodeFrame neither panics nor
// accepts an exit code or offset out of range.
func FuzzDecodeFrame(f *testing.F) {
	f.Add([]byte{FrameExit, '{', '}'})
	f.Add(EncodeOutput(FrameStdout, 1, []byte("x")))
	f.Add(append([]byte{FrameDropped}, `{"stream":"stdout","from":1,"to":2}`...))
	f.Fuzz(func(t *testing.T, b []byte) {
		fr, err := DecodeFrame(b)
		if err != nil {
			return
		}
		if fr.Exit.ExitCode < 0 || fr.Exit.ExitCode > MaxExitCode || fr.Offset < 0 || fr.Offset > 1<<62 ||
			fr.Dropped.From < 0 || fr.Dropped.To < fr.Dropped.From || len(b) > MaxFrame {
			t.Fatalf("accepted %q as %+v", b, fr)
		}
	})
}
