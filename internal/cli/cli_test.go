package cli

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

const key = "cli-test-key"

// fake is a small in-memory space server: enough of the API for the CLI's
// commands, with the real wire types and error bodies.
type fake struct {
	mu        sync.Mutex
	creates   []api.CreateSandboxRequest
	deletes   []string // "id force=bool"
	verbs     []string
	commands  []api.CreateCommandRequest
	uploads   map[string][]byte // dir -> tar uploaded there
	downloads map[string][]byte // path -> tar served
	exit      api.ExitStatus
	stdout    string
	stderr    string
	stdinSeen []byte
	resizes   []api.Resize
	attached  chan struct{} // closed on the first attach, if set
	noBase    bool          // base:latest is not built yet
	baseBuilt bool
	netPuts   []string // bodies of PUT …/network
	events    []api.NetworkEvent
}

func newFakeServer(t *testing.T) (*fake, string) {
	f := &fake{uploads: map[string][]byte{}, downloads: map[string][]byte{}}
	mux := http.NewServeMux()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	sb := api.Sandbox{ID: "sb-1", State: api.StateRunning, Runtime: "native", Isolation: "namespaces", Template: "base:latest",
		Labels: map[string]string{"team": "a"}, CreatedAt: now, Limits: api.Limits{MemoryMiB: 512}}
	fail := func(w http.ResponseWriter, err error, msg string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(errdefs.HTTPStatus(err))
		json.NewEncoder(w).Encode(api.Error{Error: api.ErrorBody{Code: errdefs.Code(err), Message: msg}})
	}
	reply := func(w http.ResponseWriter, status int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(v)
	}
	auth := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer "+key {
				fail(w, errdefs.ErrUnauthorized, "missing or wrong API key")
				return
			}
			h(w, r)
		}
	}
	op := func(kind, id string) api.Operation {
		return api.Operation{ID: "op-" + kind, Kind: kind, SandboxID: id, State: api.OpPending, CreatedAt: now}
	}
	mux.HandleFunc("POST /v1/sandboxes", auth(func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateSandboxRequest
		json.NewDecoder(r.Body).Decode(&req)
		f.mu.Lock()
		f.creates = append(f.creates, req)
		f.mu.Unlock()
		reply(w, 202, api.CreateSandboxResponse{Sandbox: api.Sandbox{ID: "sb-1", State: api.StateCreating}, Operation: op("create", "sb-1")})
	}))
	mux.HandleFunc("GET /v1/sandboxes", auth(func(w http.ResponseWriter, r *http.Request) {
		reply(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{sb}})
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("id") != "sb-1" {
			fail(w, errdefs.ErrNotFound, "sandbox "+r.PathValue("id")+" not found")
			return
		}
		reply(w, 200, sb)
	}))
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.deletes = append(f.deletes, r.PathValue("id")+" force="+r.URL.Query().Get("force"))
		f.mu.Unlock()
		if r.PathValue("id") != "sb-1" {
			fail(w, errdefs.ErrNotFound, "no such sandbox")
			return
		}
		reply(w, 202, op("delete", r.PathValue("id")))
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/{verb}", auth(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.verbs = append(f.verbs, r.PathValue("verb")+" "+strings.TrimSpace(string(body)))
		f.mu.Unlock()
		if r.PathValue("verb") == "suspend" {
			fail(w, errdefs.ErrNotSupported, "runtime native cannot suspend: no memory checkpoint")
			return
		}
		o := op(r.PathValue("verb"), r.PathValue("id"))
		if r.PathValue("verb") == "fork" {
			o.Children = []string{"sb-2", "sb-3"}
		}
		reply(w, 202, o)
	}))
	mux.HandleFunc("GET /v1/operations/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		fin := now.Add(1500 * time.Millisecond)
		reply(w, 200, api.Operation{ID: r.PathValue("id"), Kind: strings.TrimPrefix(r.PathValue("id"), "op-"), SandboxID: "sb-1",
			State: api.OpSucceeded, CreatedAt: now, FinishedAt: &fin, Phases: []api.Phase{{Name: "rootfs", DurationMS: 12.5}}})
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/commands", auth(func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateCommandRequest
		json.NewDecoder(r.Body).Decode(&req)
		f.mu.Lock()
		f.commands = append(f.commands, req)
		f.mu.Unlock()
		reply(w, 201, api.Command{ID: "c-1", SandboxID: r.PathValue("id"), Cmd: req.Cmd, State: api.CommandCreated,
			AttachURL: "/v1/sandboxes/" + r.PathValue("id") + "/commands/c-1/attach", AttachToken: "at-1"})
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}/commands/{cid}/attach", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer at-1" {
			fail(w, errdefs.ErrUnauthorized, "bad attach token")
			return
		}
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer c.CloseNow()
		ctx := r.Context()
		c.Write(ctx, websocket.MessageBinary, append([]byte{api.FrameStarted}, `{"pid":7}`...))
		f.mu.Lock()
		tty := f.commands[len(f.commands)-1].TTY
		if f.attached != nil {
			close(f.attached)
			f.attached = nil
		}
		f.mu.Unlock()
		// Wait for the client to close stdin, as a process reading it would;
		// a terminal session ends instead on Ctrl-C, which must arrive as a
		// byte because the local terminal is in raw mode.
		for {
			_, data, err := c.Read(ctx)
			if err != nil || len(data) == 0 {
				return
			}
			f.mu.Lock()
			switch data[0] {
			case api.FrameStdin:
				f.stdinSeen = append(f.stdinSeen, data[1:]...)
			case api.FrameResize:
				var rs api.Resize
				json.Unmarshal(data[1:], &rs)
				f.resizes = append(f.resizes, rs)
			}
			done := data[0] == api.FrameCloseStdin || (tty && bytes.IndexByte(f.stdinSeen, 3) >= 0)
			f.mu.Unlock()
			if done {
				break
			}
		}
		c.Write(ctx, websocket.MessageBinary, api.EncodeOutput(api.FrameStdout, 0, []byte(f.stdout)))
		c.Write(ctx, websocket.MessageBinary, api.EncodeOutput(api.FrameStderr, 0, []byte(f.stderr)))
		b, _ := json.Marshal(f.exit)
		c.Write(ctx, websocket.MessageBinary, append([]byte{api.FrameExit}, b...))
		c.Close(websocket.StatusNormalClosure, "")
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/stat", auth(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.Query().Get("path")
		if p == "/work" || p == "/work/proj" {
			reply(w, 200, api.FileInfo{Name: path.Base(p), Path: p, Type: "dir"})
			return
		}
		if p == "/work/proj/a.txt" {
			reply(w, 200, api.FileInfo{Name: "a.txt", Path: p, Type: "file"})
			return
		}
		fail(w, errdefs.ErrNotFound, p+": no such file")
	}))
	mux.HandleFunc("PUT /v1/sandboxes/{id}/files/tar", auth(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.uploads[r.URL.Query().Get("path")] = b
		f.mu.Unlock()
		w.WriteHeader(204)
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}/files/tar", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		b, ok := f.downloads[r.URL.Query().Get("path")]
		f.mu.Unlock()
		if !ok {
			fail(w, errdefs.ErrNotFound, "no such path")
			return
		}
		w.Header().Set("Content-Type", "application/x-tar")
		w.Write(b)
	}))
	netInfo := func(p api.NetworkPolicy) api.NetworkInfo {
		return api.NetworkInfo{Policy: p, Address: "198.18.0.2", Gateway: "198.18.0.1", Attached: true,
			Stats: api.NetworkStats{BytesOut: 2048, DNSQueries: 3, Verdicts: map[string]int64{"allow": 2, "deny": 1}}}
	}
	mux.HandleFunc("GET /v1/sandboxes/{id}/network", auth(func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("id") != "sb-1" {
			fail(w, errdefs.ErrNotFound, "sandbox "+r.PathValue("id")+" not found")
			return
		}
		reply(w, 200, netInfo(api.NetworkPolicy{AllowOut: []string{"pypi.org"}}))
	}))
	mux.HandleFunc("PUT /v1/sandboxes/{id}/network", auth(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.netPuts = append(f.netPuts, strings.TrimSpace(string(b)))
		f.mu.Unlock()
		var p api.NetworkPolicy
		json.Unmarshal(b, &p)
		reply(w, 200, netInfo(p))
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}/network/events", auth(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		f.mu.Lock()
		evs := f.events
		f.mu.Unlock()
		for _, ev := range evs {
			b, _ := json.Marshal(ev)
			w.Write(append(b, '\n'))
		}
	}))
	mux.HandleFunc("GET /v1/info", auth(func(w http.ResponseWriter, r *http.Request) {
		reply(w, 200, api.Info{Version: "0.1.0", AutoRuntime: "native", Runtimes: []api.RuntimeInfo{
			{Name: "native", Available: true, Isolation: "namespaces+seccomp+landlock", Verbs: map[string]bool{"pause": true, "stop": true, "suspend": false},
				VerbReasons: map[string]string{"suspend": "CRIU unavailable"}, Details: map[string]string{"cgroup_version": "1"}},
			{Name: "microvm", Available: false, Reason: "no qemu", Isolation: "vm"},
		}})
	}))
	mux.HandleFunc("GET /v1/templates", auth(func(w http.ResponseWriter, r *http.Request) {
		reply(w, 200, api.TemplateList{Templates: []api.Template{{Digest: "sha256:0123456789abcdef0123", Tags: []string{"base:latest"}, SizeBytes: 3 << 20, Source: "debootstrap:bookworm", CreatedAt: now}}})
	}))
	mux.HandleFunc("GET /v1/templates/{ref}", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		missing := f.noBase && !f.baseBuilt
		f.mu.Unlock()
		if r.PathValue("ref") != "base:latest" || missing {
			reply(w, 404, api.Error{Error: api.ErrorBody{Code: "not_found", Message: "template not found"}})
			return
		}
		reply(w, 200, api.Template{Digest: "sha256:aa", Tags: []string{"base:latest"}})
	}))
	mux.HandleFunc("POST /v1/templates/base", auth(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.baseBuilt = true
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-ndjson")
		io.WriteString(w, `{"phase":"download","done":1,"total":3,"message":"libc6"}`+"\n")
		io.WriteString(w, `{"phase":"unpack","done":0,"total":0}`+"\n")
		io.WriteString(w, `{"template":{"digest":"sha256:aa","tags":["base:latest"],"size_bytes":1024,"source":"debootstrap:bookworm"}}`+"\n")
	}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return f, srv.URL
}

// runCLI runs the CLI in-process and returns exit code, stdout, stderr.
func runCLI(t *testing.T, url string, stdin string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	full := append([]string{"--url", url, "--api-key", key}, args...)
	code := Execute(ctx, full, strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

func TestCreateFlagsBuildRequest(t *testing.T) {
	f, url := newFakeServer(t)
	t.Setenv("FROM_HOST", "hostval")
	code, out, errOut := runCLI(t, url, "", "sandbox", "create", "-q", "--wait", "--template", "py:3", "--runtime", "native",
		"--cpus", "0.5", "--memory", "1g", "--pids", "64", "--disk", "2048", "-e", "A=1", "-e", "FROM_HOST", "-w", "/src",
		"--label", "team=a", "--ttl", "1h", "--idle-after", "5m", "--idle-action", "suspend")
	if code != 0 || out != "sb-1\n" {
		t.Fatalf("code %d out %q err %q", code, out, errOut)
	}
	got := f.creates[0]
	want := api.CreateSandboxRequest{Template: "py:3", Runtime: "native", Workdir: "/src",
		Limits: api.Limits{CPUs: 0.5, MemoryMiB: 1024, Pids: 64, DiskMiB: 2048},
		Env:    map[string]string{"A": "1", "FROM_HOST": "hostval"}, Labels: map[string]string{"team": "a"},
		TTLSeconds: 3600, Idle: &api.IdlePolicy{AfterSeconds: 300, Action: "suspend"}}
	gj, _ := json.Marshal(got)
	wj, _ := json.Marshal(want)
	if !bytes.Equal(gj, wj) {
		t.Fatalf("request\n got %s\nwant %s", gj, wj)
	}
	// The alias `space create` is the same command.
	if code, out, _ := runCLI(t, url, "", "create", "-q"); code != 0 || out != "sb-1\n" {
		t.Fatalf("alias: %d %q", code, out)
	}
}

func TestCreateFlagValidation(t *testing.T) {
	_, url := newFakeServer(t)
	cases := []struct {
		args []string
		msg  string
	}{
		{[]string{"create", "--memory", "1.5m"}, "not a whole number of MiB"},
		{[]string{"create", "--memory", "512k"}, "smallest unit is MiB"},
		{[]string{"create", "--memory", "lots"}, "want a number"},
		{[]string{"create", "--disk", "0"}, "at least 1 MiB"},
		{[]string{"create", "--ttl", "soon"}, "want a duration"},
		{[]string{"create", "--ttl", "1500ms"}, "whole number of seconds"},
		{[]string{"create", "--idle-after", "5m"}, "go together"},
		{[]string{"create", "--idle-after", "5m", "--idle-action", "explode"}, "want pause, stop or suspend"},
		{[]string{"create", "--label", "novalue"}, "want KEY=VALUE"},
		{[]string{"create", "-e", "A=1", "-e", "A=2"}, "given twice"},
		{[]string{"create", "--cpus", "-1"}, "--cpus"},
		{[]string{"create", "-w", "relative"}, "absolute"},
		{[]string{"create", "--bogus"}, "unknown flag"},
		{[]string{"fork", "sb-1", "--count", "0"}, "--count"},
		{[]string{"fork", "sb-1", "--count", "17"}, "want 1 to 16"},
		{[]string{"exec", "sb-1"}, "requires at least 2"},
		{[]string{"exec", "-u", "root", "sb-1", "--", "id"}, "--user"},
		{[]string{"exec", "-t", "sb-1", "--", "sh"}, "needs a terminal"},
		{[]string{"cp", "sb-1:/a", "sb-2:/b"}, "between two sandboxes"},
		{[]string{"cp", "a", "b"}, "must be ID:/path"},
		{[]string{"cp", "sb-1:rel", "b"}, "must be absolute"},
		{[]string{"template", "import", "--tag", "No-Caps", "."}, "name:tag"},
	}
	for _, c := range cases {
		code, _, errOut := runCLI(t, url, "", c.args...)
		if code != ExitUsage || !strings.Contains(errOut, c.msg) {
			t.Errorf("%v: code %d stderr %q, want %d and %q", c.args, code, errOut, ExitUsage, c.msg)
		}
	}
}

func TestParseMiB(t *testing.T) {
	good := map[string]int64{"1024": 1024, "512m": 512, "512M": 512, "512MiB": 512, "1g": 1024, "1.5g": 1536, "2Gi": 2048, "1t": 1 << 20}
	for in, want := range good {
		if got, err := parseMiB(in); err != nil || got != want {
			t.Errorf("parseMiB(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1", "1.5", "1e3", "1gg", "0.0001g", "m", "1 g", "99999999999999t"} {
		if got, err := parseMiB(in); err == nil {
			t.Errorf("parseMiB(%q) = %d, want an error", in, got)
		}
	}
}

func TestListInspectOutput(t *testing.T) {
	_, url := newFakeServer(t)
	code, out, _ := runCLI(t, url, "", "ls")
	if code != 0 {
		t.Fatal(code)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "ID ") || !strings.Contains(lines[0], "STATE") ||
		!strings.HasPrefix(lines[1], "sb-1 ") || !strings.Contains(lines[1], "running") || !strings.Contains(lines[1], "team=a") {
		t.Fatalf("ls table:\n%s", out)
	}
	code, out, _ = runCLI(t, url, "", "--json", "ls")
	var list api.SandboxList
	if code != 0 || json.Unmarshal([]byte(out), &list) != nil || len(list.Sandboxes) != 1 || list.Sandboxes[0].ID != "sb-1" {
		t.Fatalf("ls --json: %d %s", code, out)
	}
	code, out, _ = runCLI(t, url, "", "inspect", "sb-1")
	if code != 0 || !strings.Contains(out, "Isolation:") || !strings.Contains(out, "memory=512MiB") {
		t.Fatalf("inspect:\n%s", out)
	}
	code, _, errOut := runCLI(t, url, "", "inspect", "sb-404")
	if code != ExitError || !strings.Contains(errOut, "not_found") {
		t.Fatalf("inspect missing: %d %q", code, errOut)
	}
}

func TestRunExitCodeOutputAndCleanup(t *testing.T) {
	f, url := newFakeServer(t)
	f.stdout, f.stderr, f.exit = "out\n", "err\n", api.ExitStatus{ExitCode: 7}
	code, out, errOut := runCLI(t, url, "", "run", "--memory", "256m", "-e", "X=1", "--", "sh", "-c", "exit 7")
	if code != 7 || out != "out\n" || errOut != "err\n" {
		t.Fatalf("run: code %d out %q err %q", code, out, errOut)
	}
	if len(f.creates) != 1 || f.creates[0].Limits.MemoryMiB != 256 || f.creates[0].Env["X"] != "1" {
		t.Fatalf("create %+v", f.creates)
	}
	if got := strings.Join(f.commands[0].Cmd, " "); got != "sh -c exit 7" {
		t.Fatalf("cmd %q", got)
	}
	if len(f.deletes) != 1 || f.deletes[0] != "sb-1 force=true" {
		t.Fatalf("deletes %v: run must delete its sandbox", f.deletes)
	}

	// A process killed by a signal exits 128+n, with the reason on stderr.
	f.exit = api.ExitStatus{ExitCode: 137, Signal: "KILL", OOMKilled: true, Reason: "killed by the OOM killer"}
	code, _, errOut = runCLI(t, url, "", "run", "--rm=false", "--", "hog")
	if code != 137 || !strings.Contains(errOut, "OOM") {
		t.Fatalf("killed: %d %q", code, errOut)
	}
	if len(f.deletes) != 1 {
		t.Fatalf("--rm=false still deleted: %v", f.deletes)
	}
}

func TestExec(t *testing.T) {
	f, url := newFakeServer(t)
	f.stdout, f.exit = "hi\n", api.ExitStatus{ExitCode: 0}
	code, out, _ := runCLI(t, url, "", "exec", "-e", "K=V", "-w", "/tmp", "-u", "1000:1000", "sb-1", "--", "echo", "-n", "hi")
	if code != 0 || out != "hi\n" {
		t.Fatalf("exec: %d %q", code, out)
	}
	c := f.commands[0]
	if strings.Join(c.Cmd, "|") != "echo|-n|hi" || c.Env["K"] != "V" || c.Workdir != "/tmp" || c.User != "1000:1000" || c.Detached {
		t.Fatalf("command %+v", c)
	}
	// -i forwards stdin (the fake waits for close-stdin, which comes after EOF).
	if code, _, _ := runCLI(t, url, "data", "exec", "-i", "sb-1", "--", "cat"); code != 0 {
		t.Fatalf("exec -i: %d", code)
	}
	code, out, _ = runCLI(t, url, "", "exec", "-d", "sb-1", "--", "sleep", "100")
	if code != 0 || out != "c-1\n" || !f.commands[2].Detached {
		t.Fatalf("exec -d: %d %q %+v", code, out, f.commands[2])
	}
}

func TestLifecycleAndOps(t *testing.T) {
	f, url := newFakeServer(t)
	code, out, _ := runCLI(t, url, "", "pause", "--wait", "sb-1")
	if code != 0 || !strings.Contains(out, "op-pause") || !strings.Contains(out, "succeeded") || !strings.Contains(out, "1.5s") {
		t.Fatalf("pause: %d\n%s", code, out)
	}
	code, _, errOut := runCLI(t, url, "", "suspend", "sb-1")
	if code != ExitError || !strings.Contains(errOut, "cannot suspend") {
		t.Fatalf("suspend: %d %q", code, errOut)
	}
	code, out, _ = runCLI(t, url, "", "--json", "fork", "sb-1", "--count", "3")
	var op api.Operation
	if code != 0 || json.Unmarshal([]byte(out), &op) != nil || op.Kind != "fork" {
		t.Fatalf("fork: %d %s", code, out)
	}
	if f.verbs[len(f.verbs)-1] != `fork {"count":3}` || len(op.Children) != 2 {
		t.Fatalf("fork body %q, op %+v", f.verbs[len(f.verbs)-1], op)
	}
	code, out, _ = runCLI(t, url, "", "fork", "-q", "--wait", "sb-1", "--count", "2")
	if code != 0 || out != "sb-2\nsb-3\n" {
		t.Fatalf("fork -q: %d %q", code, out)
	}
	code, out, _ = runCLI(t, url, "", "fork", "--wait", "sb-1")
	if code != 0 || !strings.Contains(out, "op-fork") || !strings.Contains(out, "CHILD") || !strings.Contains(out, "sb-3") {
		t.Fatalf("fork table:\n%s", out)
	}
	for _, verb := range []string{"restore", "wake"} {
		if code, out, _ := runCLI(t, url, "", verb, "--wait", "sb-1"); code != 0 || !strings.Contains(out, "op-"+verb) {
			t.Fatalf("%s: %d\n%s", verb, code, out)
		}
	}
	code, out, _ = runCLI(t, url, "", "op", "wait", "op-stop")
	if code != 0 || !strings.Contains(out, "rootfs") || !strings.Contains(out, "12.5ms") {
		t.Fatalf("op wait:\n%s", out)
	}
	// rm keeps going past a bad id and reports it.
	code, out, errOut = runCLI(t, url, "", "rm", "-f", "sb-404", "sb-1")
	if code != ExitError || out != "sb-1\n" || !strings.Contains(errOut, "sb-404") {
		t.Fatalf("rm: %d %q %q", code, out, errOut)
	}
}

func TestInfoTemplatesBuildBase(t *testing.T) {
	_, url := newFakeServer(t)
	code, out, _ := runCLI(t, url, "", "info")
	if code != 0 || !strings.Contains(out, "namespaces+seccomp+landlock") || !strings.Contains(out, "pause,stop") ||
		!strings.Contains(out, "no qemu") || !strings.Contains(out, "CRIU unavailable") || !strings.Contains(out, "cgroup_version") {
		t.Fatalf("info:\n%s", out)
	}
	code, out, _ = runCLI(t, url, "", "template", "ls")
	if code != 0 || !strings.Contains(out, "sha256:0123456789ab ") || !strings.Contains(out, "3.0 MiB") {
		t.Fatalf("template ls:\n%s", out)
	}
	code, out, _ = runCLI(t, url, "", "template", "build-base")
	if code != 0 || !strings.Contains(out, "download 1/3: libc6\nunpack\n") || !strings.Contains(out, "sha256:aa") {
		t.Fatalf("build-base:\n%s", out)
	}
}

func TestConfigDiscovery(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("SPACE_DATA", dir)
	t.Setenv("SPACE_URL", "unix:///run/space.sock")
	t.Setenv("SPACE_API_KEY", "")
	os.WriteFile(filepath.Join(dir, "api-key"), []byte("from-file\n"), 0o600)
	cfg, err := discoverConfig("", "")
	if err != nil || cfg.URL != "unix:///run/space.sock" || cfg.APIKey != "from-file" {
		t.Fatalf("%+v %v", cfg, err)
	}
	t.Setenv("SPACE_API_KEY", "from-env")
	if cfg, _ := discoverConfig("http://x:1", ""); cfg.APIKey != "from-env" || cfg.URL != "http://x:1" {
		t.Fatalf("%+v", cfg)
	}
	if cfg, _ := discoverConfig("", "from-flag"); cfg.APIKey != "from-flag" {
		t.Fatalf("%+v", cfg)
	}
	t.Setenv("SPACE_URL", "")
	if cfg, _ := discoverConfig("", ""); cfg.URL != "http://127.0.0.1:7070" {
		t.Fatalf("default url %q", cfg.URL)
	}
	// A wrong key is the server's to refuse, and the CLI says so.
	_, url := newFakeServer(t)
	var out, errb bytes.Buffer
	code := Execute(context.Background(), []string{"--url", url, "--api-key", "wrong", "ls"}, strings.NewReader(""), &out, &errb)
	if code != ExitError || !strings.Contains(errb.String(), "unauthorized") {
		t.Fatalf("wrong key: %d %q", code, errb.String())
	}
}

func TestCpRoundTrip(t *testing.T) {
	f, url := newFakeServer(t)
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "proj", "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "proj", "a.txt"), []byte("alpha"), 0o640)
	os.WriteFile(filepath.Join(src, "proj", "sub", "b.sh"), []byte("#!/bin/sh"), 0o755)
	os.Symlink("a.txt", filepath.Join(src, "proj", "link"))

	// Into an existing sandbox directory: uploaded into it under its own name.
	if code, _, errOut := runCLI(t, url, "", "cp", filepath.Join(src, "proj"), "sb-1:/work"); code != 0 {
		t.Fatalf("cp in: %d %s", code, errOut)
	}
	archive, ok := f.uploads["/work"]
	if !ok {
		t.Fatalf("uploads %v", f.uploads)
	}
	// To a new name: uploaded into the parent with the root entry renamed.
	if code, _, errOut := runCLI(t, url, "", "cp", filepath.Join(src, "proj", "a.txt"), "sb-1:/work/renamed.txt"); code != 0 {
		t.Fatalf("cp rename: %d %s", code, errOut)
	}
	if names := tarNames(t, f.uploads["/work"]); strings.Join(names, ",") != "renamed.txt" {
		t.Fatalf("renamed upload entries %v", names)
	}

	// Out again, into a new local name. The server's archive of a
	// directory holds the entries below it, relative.
	f.downloads["/work/proj"] = stripTop(t, archive)
	f.downloads["/work/proj/a.txt"] = f.uploads["/work"]
	dst := t.TempDir()
	if code, _, errOut := runCLI(t, url, "", "cp", "sb-1:/work/proj", filepath.Join(dst, "copy")); code != 0 {
		t.Fatalf("cp out: %d %s", code, errOut)
	}
	b, err := os.ReadFile(filepath.Join(dst, "copy", "sub", "b.sh"))
	fi, _ := os.Stat(filepath.Join(dst, "copy", "sub", "b.sh"))
	if err != nil || string(b) != "#!/bin/sh" || fi.Mode().Perm() != 0o755 {
		t.Fatalf("round trip: %q %v %v", b, err, fi)
	}
	if l, _ := os.Readlink(filepath.Join(dst, "copy", "link")); l != "a.txt" {
		t.Fatalf("symlink %q", l)
	}
	// Into an existing local directory keeps the name.
	if code, _, _ := runCLI(t, url, "", "cp", "sb-1:/work/proj", dst); code != 0 {
		t.Fatal(code)
	}
	if _, err := os.Stat(filepath.Join(dst, "proj", "a.txt")); err != nil {
		t.Fatal(err)
	}
	// A single file, into an existing directory and to a new name.
	if code, _, errOut := runCLI(t, url, "", "cp", "sb-1:/work/proj/a.txt", dst); code != 0 {
		t.Fatalf("cp file out: %d %s", code, errOut)
	}
	if code, _, _ := runCLI(t, url, "", "cp", "sb-1:/work/proj/a.txt", filepath.Join(dst, "b.txt")); code != 0 {
		t.Fatal(code)
	}
	for _, p := range []string{"a.txt", "b.txt"} {
		if b, err := os.ReadFile(filepath.Join(dst, p)); err != nil || string(b) != "alpha" {
			t.Fatalf("%s: %q %v", p, b, err)
		}
	}
	// `-` streams the raw archive.
	if code, out, _ := runCLI(t, url, "", "cp", "sb-1:/work/proj", "-"); code != 0 || out != string(f.downloads["/work/proj"]) {
		t.Fatalf("cp to stdout: %d, %d bytes", code, len(out))
	}
}

// stripTop rewrites an archive rooted at one directory into the entries
// below it, as the server archives a directory.
func stripTop(t *testing.T, b []byte) []byte {
	t.Helper()
	var out bytes.Buffer
	tw := tar.NewWriter(&out)
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		_, rest, _ := strings.Cut(h.Name, "/")
		if rest == "" {
			continue
		}
		h.Name = rest
		tw.WriteHeader(h)
		io.Copy(tw, tr)
	}
	tw.Close()
	return out.Bytes()
}

func tarNames(t *testing.T, b []byte) []string {
	t.Helper()
	var names []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return names
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
	}
}

// A sandbox controls what the tar endpoint returns; extraction must not
// write outside the destination however the archive is built.
func TestExtractTarRejectsEscapes(t *testing.T) {
	build := func(entries ...*tar.Header) []byte {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for _, h := range entries {
			tw.WriteHeader(h)
			if h.Typeflag == tar.TypeReg {
				tw.Write(make([]byte, h.Size))
			}
		}
		tw.Close()
		return buf.Bytes()
	}
	reg := func(name string) *tar.Header {
		return &tar.Header{Name: name, Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}
	}
	for name, mk := range map[string]func(base string) []byte{
		"dotdot":     func(string) []byte { return build(reg("x/../../evil")) },
		"deepdotdot": func(string) []byte { return build(reg("../../../evil")) },
		"absolute":   func(base string) []byte { return build(reg(filepath.Join(base, "evil"))) },
		"symlink-dir": func(base string) []byte {
			return build(&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: base}, reg("l/evil"))
		},
		"symlink-dotdot": func(base string) []byte {
			return build(&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "../.."}, reg("l/evil"))
		},
		"symlink-file": func(base string) []byte {
			return build(&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: filepath.Join(base, "evil")}, reg("l"))
		},
		"hardlink": func(base string) []byte {
			return build(&tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../evil"})
		},
	} {
		base := t.TempDir()
		dst := filepath.Join(base, "d")
		os.Mkdir(dst, 0o755)
		_ = extractTar(bytes.NewReader(mk(base)), dst, "out", false)
		ents, _ := os.ReadDir(base)
		if len(ents) != 1 || ents[0].Name() != "d" {
			t.Errorf("%s: archive wrote outside the destination: %v", name, ents)
		}
		if _, err := os.Lstat(filepath.Join(base, "evil")); err == nil {
			t.Errorf("%s: wrote %s", name, filepath.Join(base, "evil"))
		}
	}
	// setuid bits never survive, and a file's archive holds one entry.
	dst := t.TempDir()
	if err := extractTar(bytes.NewReader(build(&tar.Header{Name: "s", Typeflag: tar.TypeReg, Size: 1, Mode: 0o4755})), dst, "s2", true); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(filepath.Join(dst, "s2")); fi.Mode()&os.ModeSetuid != 0 || fi.Mode().Perm() != 0o755 {
		t.Fatalf("mode %v", fi.Mode())
	}
	if err := extractTar(bytes.NewReader(build(reg("a"), reg("b"))), dst, "two", true); err == nil {
		t.Fatal("a file archive with two entries was accepted")
	}
}

// TestRunBuildsMissingBaseWithProgress: a first `space run` against a server
// without the base template shows the build's progress on stderr (stdout is
// the process's) and only then creates the sandbox.
func TestRunBuildsMissingBaseWithProgress(t *testing.T) {
	f, url := newFakeServer(t)
	f.noBase = true
	f.stdout = "out\n"
	var out, errb bytes.Buffer
	code := Execute(context.Background(), []string{"--url", url, "--api-key", key, "run", "--", "true"}, strings.NewReader(""), &out, &errb)
	if code != 0 || out.String() != "out\n" {
		t.Fatalf("code %d stdout %q stderr %q", code, out.String(), errb.String())
	}
	if !strings.Contains(errb.String(), "building the base template") || !strings.Contains(errb.String(), "libc6") {
		t.Fatalf("no build progress on stderr: %q", errb.String())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.baseBuilt || len(f.creates) != 1 {
		t.Fatalf("built %v, creates %d", f.baseBuilt, len(f.creates))
	}
}
