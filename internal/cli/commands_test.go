package cli

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/spacehq/space/api"
)

func TestLastLines(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"a\nb\nc\n", 1, "c\n"},
		{"a\nb\nc\n", 2, "b\nc\n"},
		{"a\nb\nc", 1, "c"},
		{"a\nb\nc", 2, "b\nc"},
		{"a\nb\nc\n", 5, "a\nb\nc\n"},
		{"a\nb\nc\n", 0, ""},
		{"", 3, ""},
		{"\n\n", 1, "\n"},
	} {
		if got := string(lastLines([]byte(c.in), c.n)); got != c.want {
			t.Errorf("lastLines(%q, %d) = %q, want %q", c.in, c.n, got, c.want)
		}
	}
}

// A tail of the output up to an offset, then everything after it as it
// comes — including a write that straddles the offset.
func TestTailWriterStopsHoldingAtOffset(t *testing.T) {
	var out bytes.Buffer
	var off int64
	tw := &tailWriter{w: &out, n: 1, until: 8, offset: func() int64 { return off }}
	write := func(s string) {
		off += int64(len(s))
		if _, err := tw.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	write("l1\nl2\n") // 0..6: held
	if out.Len() != 0 {
		t.Fatalf("wrote %q before the tail was complete", out.String())
	}
	write("l3\nnew\n") // 6..13: "l3" ends the tail at 8, "\nnew\n" is live
	if got := out.String(); got != "l3\nnew\n" {
		t.Fatalf("got %q, want the tail's last line l3, then the live part", got)
	}
	write("more\n")
	if !strings.HasSuffix(out.String(), "new\nmore\n") {
		t.Fatalf("live output not passed through: %q", out.String())
	}
	if err := tw.flush(); err != nil || strings.Count(out.String(), "l3") != 1 {
		t.Fatalf("flush after the tail wrote again: %q %v", out.String(), err)
	}

	// Without offsets everything is held until flush.
	out.Reset()
	tw = &tailWriter{w: &out, n: 2}
	tw.Write([]byte("a\nb\n"))
	tw.Write([]byte("c\nd"))
	if out.Len() != 0 {
		t.Fatalf("wrote before flush: %q", out.String())
	}
	tw.flush()
	if out.String() != "c\nd" {
		t.Fatalf("tail 2 = %q", out.String())
	}
}

func TestCopyInputDetachKeys(t *testing.T) {
	for _, c := range []struct {
		name     string
		chunks   []string
		detach   bool
		want     string
		detached bool
	}{
		{"plain", []string{"hello\n"}, true, "hello\n", false},
		{"detach", []string{"ab\x10\x11cd"}, true, "ab", true},
		{"detach split across reads", []string{"ab\x10", "\x11cd"}, true, "ab", true},
		{"ctrl-p alone passes", []string{"a\x10b"}, true, "a\x10b", false},
		{"ctrl-p at a read's end then other", []string{"a\x10", "b"}, true, "a\x10b", false},
		{"ctrl-p ctrl-p ctrl-q", []string{"\x10\x10\x11z"}, true, "\x10", true},
		{"no detach keys without a tty", []string{"a\x10\x11b"}, false, "a\x10\x11b", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			// One read per chunk, as a terminal delivers keystrokes.
			src := &chunkReader{chunks: c.chunks}
			var dst bytes.Buffer
			err := copyInput(&dst, src, c.detach)
			if c.detached != errors.Is(err, errDetached) || (!c.detached && err != nil) {
				t.Fatalf("err %v, want detached=%v", err, c.detached)
			}
			if dst.String() != c.want {
				t.Fatalf("forwarded %q, want %q", dst.String(), c.want)
			}
		})
	}
	// A reader that fails is reported.
	if err := copyInput(&bytes.Buffer{}, iotest.ErrReader(errors.New("boom")), true); err == nil || err.Error() != "boom" {
		t.Fatalf("read error: %v", err)
	}
}

type chunkReader struct{ chunks []string }

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.chunks) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.chunks[0])
	r.chunks = r.chunks[1:]
	return n, nil
}

func TestRecentCommandsAndExitText(t *testing.T) {
	var cmds []api.Command
	for i := 0; i < 8; i++ {
		cmds = append(cmds, api.Command{ID: string(rune('a' + i)), State: api.CommandExited})
	}
	cmds[2].State = api.CommandRunning
	cmds[6].State = api.CommandCreated
	var ids string
	for _, c := range recentCommands(cmds, 3) {
		ids += c.ID
	}
	// Running c and created g are kept; of the exited a b d e f h, the last 3.
	if ids != "cefgh" {
		t.Fatalf("kept %q", ids)
	}
	for _, c := range []struct {
		st   *api.ExitStatus
		want string
	}{
		{nil, "-"},
		{&api.ExitStatus{ExitCode: 3}, "3"},
		{&api.ExitStatus{ExitCode: -1, Signal: "TERM"}, "143 (SIGTERM)"},
		{&api.ExitStatus{ExitCode: 137, Signal: "KILL", OOMKilled: true}, "137 (OOM killed)"},
	} {
		if got := exitText(c.st); got != c.want {
			t.Errorf("exitText(%+v) = %q, want %q", c.st, got, c.want)
		}
	}
	if got := commandLine([]string{"sh", "-c", "echo hi; exit 3"}, 60); got != `sh -c "echo hi; exit 3"` {
		t.Fatalf("commandLine = %q", got)
	}
	if got := commandLine([]string{strings.Repeat("x", 100)}, 10); got != "xxxxxxxxx…" {
		t.Fatalf("cut commandLine = %q", got)
	}
}
