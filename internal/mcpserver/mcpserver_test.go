package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/sdk"
)

// The tools against a real server are tested in e2e (mcp_test.go, and the
// TypeScript client in e2e/js); these are the pure parts and the checks a
// tool makes before any request.

func TestUTF8Cut(t *testing.T) {
	s := []byte("aé€😀b") // 1, 2, 3, 4, 1 bytes
	for n := 0; n <= len(s); n++ {
		c := utf8Cut(s, n)
		if c > n || n-c > 3 || !utf8.Valid(s[:c]) {
			t.Errorf("utf8Cut(%d) = %d: %q", n, c, s[:c])
		}
	}
	if c := utf8Cut(s, 3); c != 3 { // after "aé": a clean boundary stays
		t.Errorf("utf8Cut at a boundary moved to %d", c)
	}
	bin := []byte{0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0xfa}
	if c := utf8Cut(bin, 4); c != 4 { // not UTF-8 at all: cut where asked
		t.Errorf("utf8Cut of binary = %d", c)
	}
}

func TestCaptureKeepsHeadCountsAll(t *testing.T) {
	c := &capture{limit: 10}
	for _, p := range []string{"héllo ", "wörld", "!!!"} {
		if n, err := c.Write([]byte(p)); n != len(p) || err != nil {
			t.Fatalf("write %q: %d %v", p, n, err)
		}
	}
	// "héllo " is 7 bytes; 3 more fit, and "wö" is 3 bytes.
	if string(c.buf) != "héllo wö" || c.total != 16 || c.omitted() != 6 {
		t.Fatalf("kept %q (%d), total %d, omitted %d", c.buf, len(c.buf), c.total, c.omitted())
	}
	c = &capture{limit: 9}
	c.Write([]byte("héllo wö")) // 10 bytes: a cut at 9 would split ö
	if string(c.buf) != "héllo w" {
		t.Fatalf("kept %q: a cut must not split a rune", c.buf)
	}
}

func TestPager(t *testing.T) {
	p := &pager{limit: 5, next: [2]int64{100, 0}}
	p.drop("stdout", 50) // lost before the read: the offsets move on
	p.write(0, []byte("abc"))
	p.write(1, []byte("e"))
	p.write(0, []byte("defg")) // only "de" fits
	p.write(0, []byte("h"))
	if string(p.buf[0]) != "abcde" || p.next[0] != 155 || !p.full[0] || p.dropped[0] != 50 {
		t.Fatalf("stdout %q next %d full %v dropped %d", p.buf[0], p.next[0], p.full[0], p.dropped[0])
	}
	if string(p.buf[1]) != "e" || p.next[1] != 1 || p.full[1] {
		t.Fatalf("stderr %q next %d", p.buf[1], p.next[1])
	}
}

func TestParseURI(t *testing.T) {
	for uri, want := range map[string][2]string{
		"space://sandboxes/sb-1":                       {"sb-1", ""},
		"space://sandboxes/sb-1/commands/cmd-2/output": {"sb-1", "cmd-2"},
	} {
		id, cmd, ok := parseURI(uri)
		if !ok || id != want[0] || cmd != want[1] {
			t.Errorf("%s: %q %q %v", uri, id, cmd, ok)
		}
	}
	for _, uri := range []string{"space://sandboxes/", "space://other/sb-1", "space://sandboxes/sb-1/commands//output",
		"space://sandboxes/sb-1/commands/c/stdout", "space://sandboxes/sb-1/x"} {
		if _, _, ok := parseURI(uri); ok {
			t.Errorf("%s parsed", uri)
		}
	}
}

func TestTail(t *testing.T) {
	s := strings.Repeat("é", resourceOutputTail) // 2 bytes each
	got, cut := tail(s)
	if len(got) > resourceOutputTail || !utf8.ValidString(got) || cut+len(got) != len(s) {
		t.Fatalf("tail: %d bytes kept, %d cut, valid %v", len(got), cut, utf8.ValidString(got))
	}
	if got, cut := tail("short"); got != "short" || cut != 0 {
		t.Fatalf("tail of a short string: %q %d", got, cut)
	}
}

func TestArgv(t *testing.T) {
	for _, c := range []struct {
		cmd  any
		want []string
		err  bool
	}{
		{"echo hi | wc -c", []string{"/bin/sh", "-c", "echo hi | wc -c"}, false},
		{[]any{"ls", "-l"}, []string{"ls", "-l"}, false},
		{"  ", nil, true},
		{[]any{}, nil, true},
		{[]any{"", "x"}, nil, true},
		{[]any{"ls", 3.0}, nil, true},
		{nil, nil, true},
		{3.0, nil, true},
	} {
		got, err := CommandSpec{Cmd: c.cmd}.argv()
		if (err != nil) != c.err || !slices.Equal(got, c.want) {
			t.Errorf("argv(%#v) = %q, %v", c.cmd, got, err)
		}
	}
}

func TestIsText(t *testing.T) {
	if !isText([]byte("héllo")) || isText([]byte("a\x00b")) || isText([]byte{0xff, 'a'}) || isText([]byte("h\xc3")) {
		t.Fatal("isText")
	}
}

func TestToolErrorHints(t *testing.T) {
	for _, c := range []struct {
		err  error
		hint string
	}{
		{fmt.Errorf("no sandbox: %w", sdk.ErrNotFound), "sandbox_list"},
		{fmt.Errorf("native cannot: %w", sdk.ErrNotSupported), "runtime"},
		{fmt.Errorf("is stopped: %w", sdk.ErrConflict), "sandbox_get"},
		{fmt.Errorf("bad: %w", sdk.ErrInvalidArgument), "Fix the arguments"},
		{fmt.Errorf("key: %w", sdk.ErrUnauthorized), "configuration"},
		{context.DeadlineExceeded, "timed out"},
	} {
		err := toolError("doing it", c.err)
		if !strings.HasPrefix(err.Error(), "doing it: ") || !strings.Contains(err.Error(), c.hint) {
			t.Errorf("%v → %q, want a hint with %q", c.err, err, c.hint)
		}
		if !errors.Is(err, c.err) && c.err != context.DeadlineExceeded {
			t.Errorf("%q does not wrap %v", err, c.err)
		}
	}
}

// TestBadArgumentsAreToolErrors: arguments a tool refuses before any
// request (here no server listens at all) come back as tool errors with
// the reason, never as protocol errors.
func TestBadArgumentsAreToolErrors(t *testing.T) {
	c, err := sdk.New("http://127.0.0.1:1", "sk_none")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ct, st := mcp.NewInMemoryTransports()
	ss, err := New(c, Options{}).Connect(ctx, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "1"}, nil).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	for _, c := range []struct {
		tool string
		args map[string]any
		want string
	}{
		{"command_run", map[string]any{"id": "sb-1", "cmd": []any{1}}, "cmd"},
		{"command_run", map[string]any{"id": "sb-1"}, "cmd"},
		{"command_run", map[string]any{"id": "sb-1", "cmd": "true", "timeout_seconds": 4000}, "timeout_seconds"},
		{"command_run", map[string]any{"id": "sb-1", "cmd": "true", "max_output_bytes": 2 << 20}, "max_output_bytes"},
		{"command_output", map[string]any{"id": "sb-1", "command_id": "c", "wait_seconds": 61}, "wait_seconds"},
		{"command_output", map[string]any{"id": "sb-1", "command_id": "c", "since_stdout": -1}, "since_stdout"},
		{"file_read", map[string]any{"id": "sb-1", "path": "/x", "limit": 2 << 20}, "limit"},
		{"file_write", map[string]any{"id": "sb-1", "path": "/x", "content": "!!", "base64": true}, "base64"},
		{"file_write", map[string]any{"id": "sb-1", "path": "/x", "content": "", "mode": "999"}, "mode"},
		{"file_list", map[string]any{"id": "sb-1", "path": "/", "depth": 9}, "depth"},
		{"sandbox_fork", map[string]any{"id": "sb-1", "count": 17}, "count"},
		{"sandbox_list", map[string]any{"label": "novalue"}, "key=value"},
		{"port_expose", map[string]any{"id": "sb-1", "port": 70000}, "port"},
		{"sandbox_create", map[string]any{"cpus": -1}, "negative"},
		{"sandbox_get", map[string]any{}, "id"},
		{"sandbox_get", map[string]any{"id": "sb-1", "extra": 1}, "extra"},
		// Reaches for the server, which is not there: still a tool error.
		{"sandbox_get", map[string]any{"id": "sb-1"}, "could not be reached"},
	} {
		res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: c.tool, Arguments: c.args})
		if err != nil {
			t.Errorf("%s %v: protocol error %v", c.tool, c.args, err)
			continue
		}
		txt := ""
		for _, ct := range res.Content {
			if tc, ok := ct.(*mcp.TextContent); ok {
				txt += tc.Text
			}
		}
		if !res.IsError || !strings.Contains(txt, c.want) {
			t.Errorf("%s %v: isError %v, %q (want it to name %q)", c.tool, c.args, res.IsError, txt, c.want)
		}
	}
}
