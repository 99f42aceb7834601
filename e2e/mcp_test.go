package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/mcpserver"
	"github.com/spacehq/space/internal/testenv"
)

// The MCP server through the official Go SDK client, over both transports:
// `space mcp` (stdio, a separate process configured like any CLI command)
// and the server's /mcp (streamable HTTP, API key as bearer). Real
// sandboxes on the native runtime (fast); suspend and fork where a runtime
// can do them.

// bearer adds an API key to every request.
type bearer struct {
	key string
	rt  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.key)
	return b.rt.RoundTrip(r)
}

// mcpConnect opens a client session over the named transport.
func mcpConnect(t *testing.T, e *env, transport string) *mcp.ClientSession {
	t.Helper()
	var tr mcp.Transport
	switch transport {
	case "stdio":
		cmd := exec.Command(spaceBinary(t), "mcp")
		// Configured like every other CLI command: the server's URL and key
		// from the environment.
		cmd.Env = append(os.Environ(), "SPACE_URL="+e.url, "SPACE_API_KEY="+e.key)
		cmd.Stderr = os.Stderr
		tr = &mcp.CommandTransport{Command: cmd}
	case "http":
		tr = &mcp.StreamableClientTransport{Endpoint: e.url + "/mcp", MaxRetries: -1,
			HTTPClient: &http.Client{Transport: bearer{e.key, http.DefaultTransport}}}
	default:
		t.Fatalf("transport %q", transport)
	}
	client := mcp.NewClient(&mcp.Implementation{Name: "space-e2e", Version: "1"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cs, err := client.Connect(ctx, tr, nil)
	if err != nil {
		t.Fatalf("connecting over %s: %v", transport, err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// callTool calls a tool; a protocol error fails the test, a tool error is
// returned in the result.
func callTool(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) *mcp.CallToolResult {
	t.Helper()
	res, err := cs.CallTool(ctxT(t, 3*time.Minute), &mcp.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s: protocol error %v", name, err)
	}
	return res
}

// toolOK calls a tool that must succeed and decodes its structured output.
func toolOK[Out any](t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) Out {
	t.Helper()
	res := callTool(t, cs, name, args)
	if res.IsError {
		t.Fatalf("%s %v: tool error %s", name, args, resultText(res))
	}
	var out Out
	b, err := json.Marshal(res.StructuredContent)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%s: structured output %s: %v", name, b, err)
	}
	return out
}

// toolErr calls a tool that must fail as a tool (not a protocol) error and
// returns its message.
func toolErr(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) string {
	t.Helper()
	res := callTool(t, cs, name, args)
	if !res.IsError {
		t.Fatalf("%s %v: want a tool error, got %s", name, args, resultText(res))
	}
	return resultText(res)
}

func resultText(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// waitOutput polls command_output until the command has exited, returning
// everything it printed.
func waitOutput(t *testing.T, cs *mcp.ClientSession, id, cmdID string) (stdout string, last mcpserver.CommandOutputOut) {
	t.Helper()
	var since int64
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		o := toolOK[mcpserver.CommandOutputOut](t, cs, "command_output", map[string]any{"id": id, "command_id": cmdID, "since_stdout": since, "wait_seconds": 5})
		if o.NextStdout != since+int64(len(o.Stdout)) {
			t.Fatalf("next_stdout %d after %d bytes from %d", o.NextStdout, len(o.Stdout), since)
		}
		stdout += o.Stdout
		since = o.NextStdout
		if !o.Running {
			return stdout, o
		}
	}
	t.Fatalf("command %s still running after a minute; output so far %q", cmdID, stdout)
	return
}

var mcpToolNames = []string{
	"command_kill", "command_list", "command_output", "command_run", "command_start",
	"file_list", "file_read", "file_write", "port_expose",
	"sandbox_create", "sandbox_delete", "sandbox_fork", "sandbox_get", "sandbox_list", "sandbox_suspend", "sandbox_wake",
}

func TestMCP(t *testing.T) {
	e := setup(t)
	for _, transport := range []string{"stdio", "http"} {
		t.Run(transport, func(t *testing.T) {
			mcpScenario(t, e, mcpConnect(t, e, transport), transport)
		})
	}
}

func mcpScenario(t *testing.T, e *env, cs *mcp.ClientSession, transport string) {
	tools, err := cs.ListTools(ctxT(t, time.Minute), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tl := range tools.Tools {
		names = append(names, tl.Name)
		if len(tl.Description) < 40 || tl.InputSchema == nil || tl.OutputSchema == nil {
			t.Errorf("tool %s: description %q, schemas %v / %v", tl.Name, tl.Description, tl.InputSchema != nil, tl.OutputSchema != nil)
		}
	}
	slices.Sort(names)
	if !slices.Equal(names, mcpToolNames) {
		t.Fatalf("tools %v, want %v", names, mcpToolNames)
	}

	sb := toolOK[mcpserver.SandboxInfo](t, cs, "sandbox_create", map[string]any{
		"runtime": "native", "labels": map[string]any{"suite": "mcp-" + transport}, "env": map[string]any{"GREETING": "hello"},
	})
	deleted := false
	t.Cleanup(func() {
		if !deleted {
			if op, err := e.client.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
				e.client.WaitOperation(context.Background(), op.ID)
			}
		}
	})
	if sb.ID == "" || sb.State != api.StateRunning || sb.Runtime != "native" || sb.Isolation == "" {
		t.Fatalf("sandbox_create: %+v", sb)
	}
	id := sb.ID

	// A foreground command: exit code and output, as structure and text.
	res := callTool(t, cs, "command_run", map[string]any{"id": id, "cmd": "echo hi; echo $GREETING >&2; exit 3"})
	run := decode[mcpserver.CommandRunOut](t, res)
	if res.IsError || run.ExitCode != 3 || run.Stdout != "hi\n" || run.Stderr != "hello\n" || run.StdoutTruncated || run.CommandID == "" {
		t.Fatalf("command_run: %+v %s", run, resultText(res))
	}
	if txt := resultText(res); !strings.Contains(txt, "exit_code: 3") || !strings.Contains(txt, "hi") {
		t.Fatalf("command_run text %q", txt)
	}
	// An argv array, stdin, cwd.
	run = toolOK[mcpserver.CommandRunOut](t, cs, "command_run", map[string]any{"id": id, "cmd": []any{"sh", "-c", "pwd; cat"}, "stdin": "piped", "cwd": "/tmp"})
	if run.ExitCode != 0 || run.Stdout != "/tmp\npiped" {
		t.Fatalf("command_run argv+stdin: %+v", run)
	}

	// The output cap: 200 KiB printed, 64 KiB returned, the rest counted
	// and readable by offset.
	const big = 200 << 10
	res = callTool(t, cs, "command_run", map[string]any{"id": id, "cmd": "head -c 204800 /dev/zero | tr '\\0' a"})
	run = decode[mcpserver.CommandRunOut](t, res)
	if res.IsError || !run.StdoutTruncated || len(run.Stdout) != mcpserver.DefaultOutputBytes || run.StdoutOmitted != big-mcpserver.DefaultOutputBytes {
		t.Fatalf("capped command_run: truncated %v, %d bytes returned, %d omitted (%s)", run.StdoutTruncated, len(run.Stdout), run.StdoutOmitted, firstLine(resultText(res)))
	}
	if txt := resultText(res); !strings.Contains(txt, "truncated, 139264 bytes omitted") || !strings.Contains(txt, "since_stdout: 65536") {
		t.Fatalf("capped command_run text does not say what was left out or how to read it: %q", firstLines(txt, 3)+"…"+txt[len(txt)-300:])
	}
	rest := toolOK[mcpserver.CommandOutputOut](t, cs, "command_output", map[string]any{"id": id, "command_id": run.CommandID, "since_stdout": mcpserver.DefaultOutputBytes, "max_bytes": 1 << 20})
	if rest.Running || rest.ExitCode == nil || *rest.ExitCode != 0 || len(rest.Stdout) != big-mcpserver.DefaultOutputBytes || rest.NextStdout != big || rest.More {
		t.Fatalf("the rest of the capped output: %d bytes, next %d, running %v, more %v", len(rest.Stdout), rest.NextStdout, rest.Running, rest.More)
	}
	// Paging with a small max_bytes says there is more.
	page := toolOK[mcpserver.CommandOutputOut](t, cs, "command_output", map[string]any{"id": id, "command_id": run.CommandID, "since_stdout": 100, "max_bytes": 1000})
	if len(page.Stdout) != 1000 || page.NextStdout != 1100 || !page.More {
		t.Fatalf("a page of 1000 bytes from 100: %d bytes, next %d, more %v", len(page.Stdout), page.NextStdout, page.More)
	}

	// A time limit kills the command and says so.
	start := time.Now()
	run = toolOK[mcpserver.CommandRunOut](t, cs, "command_run", map[string]any{"id": id, "cmd": "sleep 30", "timeout_seconds": 1})
	if !run.TimedOut || run.Signal != "KILL" || time.Since(start) > 15*time.Second {
		t.Fatalf("command_run with timeout: %+v after %v", run, time.Since(start))
	}

	// A background command and its output, read later.
	bg := toolOK[mcpserver.CommandStartOut](t, cs, "command_start", map[string]any{"id": id, "cmd": "sleep 0.5; echo later; exit 4"})
	if bg.CommandID == "" || bg.Pid == 0 {
		t.Fatalf("command_start: %+v", bg)
	}
	out, last := waitOutput(t, cs, id, bg.CommandID)
	if out != "later\n" || last.ExitCode == nil || *last.ExitCode != 4 {
		t.Fatalf("background output %q, last %+v", out, last)
	}
	list := toolOK[mcpserver.CommandListOut](t, cs, "command_list", map[string]any{"id": id})
	if !slices.ContainsFunc(list.Commands, func(c mcpserver.CommandInfo) bool {
		return c.CommandID == bg.CommandID && c.State == api.CommandExited && c.ExitCode != nil && *c.ExitCode == 4
	}) {
		t.Fatalf("command_list lacks the exited background command: %+v", list.Commands)
	}
	// A command killed by command_kill.
	sl := toolOK[mcpserver.CommandStartOut](t, cs, "command_start", map[string]any{"id": id, "cmd": []any{"sleep", "300"}})
	toolOK[mcpserver.CommandKillOut](t, cs, "command_kill", map[string]any{"id": id, "command_id": sl.CommandID})
	if _, last := waitOutput(t, cs, id, sl.CommandID); last.Signal != "KILL" {
		t.Fatalf("killed command: %+v", last)
	}
	// The output resource of a command, and the sandbox resource.
	rr, err := cs.ReadResource(ctxT(t, time.Minute), &mcp.ReadResourceParams{URI: "space://sandboxes/" + id + "/commands/" + bg.CommandID + "/output"})
	if err != nil || len(rr.Contents) != 1 || !strings.Contains(rr.Contents[0].Text, "later") || !strings.Contains(rr.Contents[0].Text, "exit_code: 4") {
		t.Fatalf("output resource: %v %+v", err, rr)
	}
	rr, err = cs.ReadResource(ctxT(t, time.Minute), &mcp.ReadResourceParams{URI: "space://sandboxes/" + id})
	var viaRes mcpserver.SandboxInfo
	if err != nil || len(rr.Contents) != 1 || json.Unmarshal([]byte(rr.Contents[0].Text), &viaRes) != nil || viaRes.ID != id || viaRes.State != api.StateRunning {
		t.Fatalf("sandbox resource: %v %+v", err, rr)
	}
	if _, err := cs.ReadResource(ctxT(t, time.Minute), &mcp.ReadResourceParams{URI: "space://sandboxes/sb-nosuchsandbox0000"}); err == nil {
		t.Fatal("reading the resource of a missing sandbox succeeded")
	}
	lr, err := cs.ListResources(ctxT(t, time.Minute), nil)
	if err != nil || !slices.ContainsFunc(lr.Resources, func(r *mcp.Resource) bool { return r.URI == "space://sandboxes/"+id }) {
		t.Fatalf("resources/list lacks the running sandbox: %v %+v", err, lr)
	}
	tmpls, err := cs.ListResourceTemplates(ctxT(t, time.Minute), nil)
	if err != nil || len(tmpls.ResourceTemplates) != 2 {
		t.Fatalf("resource templates: %v %+v", err, tmpls)
	}

	// Files: write (parents made), read whole and in part, binary, list.
	w := toolOK[mcpserver.FileWriteOut](t, cs, "file_write", map[string]any{"id": id, "path": "/tmp/mcp/dir/hello.txt", "content": "héllo\n", "mode": "0600"})
	if w.Size != 7 || w.Mode != "0600" {
		t.Fatalf("file_write: %+v", w)
	}
	r := toolOK[mcpserver.FileReadOut](t, cs, "file_read", map[string]any{"id": id, "path": "/tmp/mcp/dir/hello.txt"})
	if r.Content != "héllo\n" || r.Encoding != "utf-8" || !r.EOF || r.Size != 7 || r.NextOffset != 7 {
		t.Fatalf("file_read: %+v", r)
	}
	// From offset 1, 2 bytes: exactly "é", and the read says there is more.
	r = toolOK[mcpserver.FileReadOut](t, cs, "file_read", map[string]any{"id": id, "path": "/tmp/mcp/dir/hello.txt", "offset": 1, "limit": 2})
	if r.Content != "é" || r.EOF || r.NextOffset != 3 {
		t.Fatalf("file_read part: %+v", r)
	}
	bin := []byte{0, 1, 2, 0xff, 0xfe}
	toolOK[mcpserver.FileWriteOut](t, cs, "file_write", map[string]any{"id": id, "path": "/tmp/mcp/bin", "content": base64.StdEncoding.EncodeToString(bin), "base64": true})
	r = toolOK[mcpserver.FileReadOut](t, cs, "file_read", map[string]any{"id": id, "path": "/tmp/mcp/bin"})
	if got, _ := base64.StdEncoding.DecodeString(r.Content); r.Encoding != "base64" || string(got) != string(bin) {
		t.Fatalf("binary file_read: %+v", r)
	}
	fl := toolOK[mcpserver.FileListOut](t, cs, "file_list", map[string]any{"id": id, "path": "/tmp/mcp", "depth": 2})
	var paths []string
	for _, en := range fl.Entries {
		paths = append(paths, en.Path+":"+en.Type)
	}
	slices.Sort(paths)
	if want := []string{"/tmp/mcp/bin:file", "/tmp/mcp/dir/hello.txt:file", "/tmp/mcp/dir:dir"}; !slices.Equal(paths, want) {
		t.Fatalf("file_list depth 2: %v, want %v", paths, want)
	}
	if msg := toolErr(t, cs, "file_read", map[string]any{"id": id, "path": "/tmp/mcp"}); !strings.Contains(msg, "file_list") {
		t.Fatalf("file_read of a directory: %q", msg)
	}

	// Errors are tool errors that say what to do.
	if msg := toolErr(t, cs, "command_run", map[string]any{"id": "sb-nosuchsandbox0000", "cmd": "true"}); !strings.Contains(msg, "not found") || !strings.Contains(msg, "sandbox_list") {
		t.Fatalf("command_run on a missing sandbox: %q", msg)
	}
	if msg := toolErr(t, cs, "sandbox_fork", map[string]any{"id": id, "count": 99}); !strings.Contains(msg, "count") {
		t.Fatalf("fork of 99: %q", msg)
	}
	if msg := toolErr(t, cs, "command_run", map[string]any{"id": id, "cmd": []any{1, 2}}); !strings.Contains(msg, "cmd") {
		t.Fatalf("cmd of numbers: %q", msg)
	}
	if msg := toolErr(t, cs, "command_run", map[string]any{"id": id}); !strings.Contains(msg, "cmd") {
		t.Fatalf("no cmd: %q", msg)
	}
	// native cannot suspend or fork (no memory checkpoint): refused, naming
	// the runtime, as a tool error.
	for _, verb := range []string{"sandbox_suspend", "sandbox_fork"} {
		msg := toolErr(t, cs, verb, map[string]any{"id": id})
		if !strings.Contains(msg, "native") || !strings.Contains(msg, "runtime") {
			t.Fatalf("%s on native: %q", verb, msg)
		}
	}
	// wake of a running sandbox leaves it running.
	if sb := toolOK[mcpserver.SandboxInfo](t, cs, "sandbox_wake", map[string]any{"id": id}); sb.State != api.StateRunning {
		t.Fatalf("wake of a running sandbox: %+v", sb)
	}

	port := toolOK[mcpserver.PortExposeOut](t, cs, "port_expose", map[string]any{"id": id, "port": 8000})
	if !strings.Contains(port.URL, "8000-"+id) || !strings.Contains(port.PathURL, "/v1/sandboxes/"+id+"/ports/8000") || port.Token == "" || port.Public {
		t.Fatalf("port_expose: %+v", port)
	}
	if port = toolOK[mcpserver.PortExposeOut](t, cs, "port_expose", map[string]any{"id": id, "port": 8000, "public": true}); !port.Public {
		t.Fatalf("port_expose public: %+v", port)
	}

	ls := toolOK[mcpserver.SandboxListOut](t, cs, "sandbox_list", map[string]any{"label": "suite=mcp-" + transport})
	if len(ls.Sandboxes) != 1 || ls.Sandboxes[0].ID != id {
		t.Fatalf("sandbox_list by label: %+v", ls)
	}
	if got := toolOK[mcpserver.SandboxInfo](t, cs, "sandbox_get", map[string]any{"id": id}); got.ID != id || got.Labels["suite"] != "mcp-"+transport {
		t.Fatalf("sandbox_get: %+v", got)
	}
	if d := toolOK[mcpserver.SandboxDeleteOut](t, cs, "sandbox_delete", map[string]any{"id": id}); !d.Deleted {
		t.Fatalf("sandbox_delete: %+v", d)
	}
	deleted = true
	if msg := toolErr(t, cs, "sandbox_get", map[string]any{"id": id}); !strings.Contains(msg, "not found") {
		t.Fatalf("sandbox_get after delete: %q", msg)
	}
}

func decode[Out any](t *testing.T, res *mcp.CallToolResult) Out {
	t.Helper()
	var out Out
	if res.StructuredContent == nil {
		return out
	}
	b, _ := json.Marshal(res.StructuredContent)
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("structured output %s: %v", b, err)
	}
	return out
}

func firstLine(s string) string { l, _, _ := strings.Cut(s, "\n"); return l }

func firstLines(s string, n int) string {
	ls := strings.SplitN(s, "\n", n+1)
	return strings.Join(ls[:min(n, len(ls))], "\n")
}

// TestMCPHTTPAuth: /mcp is behind the API key like the REST API.
func TestMCPHTTPAuth(t *testing.T) {
	e := setup(t)
	body := `{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}`
	for _, key := range []string{"", "sk_wrong_key_0123456789"} {
		req, _ := http.NewRequest("POST", e.url+"/mcp", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e api.Error
		json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || e.Error.Code != api.CodeUnauthorized {
			t.Fatalf("key %q: %d %+v", key, resp.StatusCode, e)
		}
	}
	// With the key, a stateless tools/call answers at once, and the API
	// request the tool makes lands in the server's metrics like any other.
	before := metricValue(t, e, `space_http_requests_total{code="200",method="GET"}`)
	call := `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"sandbox_list","arguments":{}}}`
	req, _ := http.NewRequest("POST", e.url+"/mcp", strings.NewReader(call))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer "+e.key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"sandboxes"`) || strings.Contains(string(b), `"isError":true`) {
		t.Fatalf("tools/call with the key: %d %s", resp.StatusCode, b)
	}
	if after := metricValue(t, e, `space_http_requests_total{code="200",method="GET"}`); after < before+1 {
		t.Fatalf("GET 200 requests %v → %v: the tool's API request was not counted", before, after)
	}
}

// metricValue reads one sample of the server's /metrics (0 if absent).
func metricValue(t *testing.T, e *env, series string) float64 {
	t.Helper()
	resp, err := http.Get(e.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", l, err)
			}
			return f
		}
	}
	return 0
}

// TestMCPSuspendWakeFork drives suspend, wake and fork through MCP on a
// runtime that can do them (gvisor or microvm).
func TestMCPSuspendWakeFork(t *testing.T) {
	e := setup(t)
	info, err := e.client.Info(ctxT(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	rt := ""
	for _, r := range info.Runtimes {
		if r.Available && r.Verbs[api.OpSuspend] && r.Verbs[api.OpFork] && (rt == "" || r.Name == "gvisor") {
			rt = r.Name
		}
	}
	testenv.Require(t, "suspend+fork", rt != "", "no runtime here can suspend and fork")
	t.Logf("runtime %s", rt)
	cs := mcpConnect(t, e, "http")
	sb := toolOK[mcpserver.SandboxInfo](t, cs, "sandbox_create", map[string]any{"runtime": rt})
	ids := []string{sb.ID}
	t.Cleanup(func() {
		for _, id := range ids {
			if op, err := e.client.DeleteSandbox(context.Background(), id, true); err == nil {
				e.client.WaitOperation(context.Background(), op.ID)
			}
		}
	})
	// A process holding state only in memory.
	toolOK[mcpserver.CommandStartOut](t, cs, "command_start", map[string]any{"id": sb.ID,
		"cmd": `python3 -c 'import os,time; t=os.urandom(8).hex(); open("/tmp/tok","w").write(t)
while True:
    time.sleep(0.2); open("/tmp/alive","w").write(t)'`})
	var tok string
	for i := 0; i < 100 && tok == ""; i++ {
		r := toolOK[mcpserver.CommandRunOut](t, cs, "command_run", map[string]any{"id": sb.ID, "cmd": "cat /tmp/tok 2>/dev/null"})
		tok = r.Stdout
		time.Sleep(100 * time.Millisecond)
	}
	if s := toolOK[mcpserver.SandboxInfo](t, cs, "sandbox_suspend", map[string]any{"id": sb.ID}); s.State != api.StateSuspended {
		t.Fatalf("after sandbox_suspend: %+v", s)
	}
	if s := toolOK[mcpserver.SandboxInfo](t, cs, "sandbox_wake", map[string]any{"id": sb.ID}); s.State != api.StateRunning {
		t.Fatalf("after sandbox_wake: %+v", s)
	}
	// The process lives on: it rewrites /tmp/alive with its token.
	toolOK[mcpserver.CommandRunOut](t, cs, "command_run", map[string]any{"id": sb.ID, "cmd": "rm -f /tmp/alive"})
	run := toolOK[mcpserver.CommandRunOut](t, cs, "command_run", map[string]any{"id": sb.ID, "cmd": "sleep 1; cat /tmp/alive"})
	if tok == "" || run.Stdout != tok {
		t.Fatalf("after wake the in-memory process wrote %q, want its token %q", run.Stdout, tok)
	}
	fk := toolOK[mcpserver.SandboxForkOut](t, cs, "sandbox_fork", map[string]any{"id": sb.ID, "count": 2})
	if len(fk.Children) != 2 {
		t.Fatalf("sandbox_fork: %+v", fk)
	}
	for _, c := range fk.Children {
		ids = append(ids, c.ID)
		if c.State != api.StateRunning {
			t.Fatalf("fork child %+v", c)
		}
		run := toolOK[mcpserver.CommandRunOut](t, cs, "command_run", map[string]any{"id": c.ID, "cmd": "hostname; rm -f /tmp/alive; sleep 1; cat /tmp/alive"})
		if run.Stdout != c.ID+"\n"+tok {
			t.Fatalf("fork child %s: %q, want its hostname and the parent's token %q", c.ID, run.Stdout, tok)
		}
	}
}
