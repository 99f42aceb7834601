package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/sdk"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func newSandbox(t *testing.T, e *env, req api.CreateSandboxRequest) *api.Sandbox {
	t.Helper()
	ctx := ctxT(t, 5*time.Minute)
	sb, err := e.client.CreateSandboxAndWait(ctx, req)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		if op, err := e.client.DeleteSandbox(ctx, sb.ID, true); err == nil {
			e.client.WaitOperation(ctx, op.ID)
		}
	})
	return sb
}

func TestRunPrints42(t *testing.T) {
	e := setup(t)
	before, err := e.client.ListSandboxes(ctxT(t, time.Minute), sdk.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out, errOut, code := e.spaceCLI(t, "", "run", "--", "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("space run: code %d stdout %q stderr %q", code, out, errOut)
	}
	_, _, code = e.spaceCLI(t, "", "run", "--", "sh", "-c", "echo oops >&2; exit 3")
	if code != 3 {
		t.Fatalf("exit code not propagated: %d", code)
	}
	// run deletes its sandbox.
	after, err := e.client.ListSandboxes(ctxT(t, time.Minute), sdk.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(after) > len(before) {
		t.Errorf("space run left sandboxes behind: %d before, %d after", len(before), len(after))
	}
}

func TestLifecycleKeepsDiskAndWakes(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Env: map[string]string{"GREETING": "hi"}, Workdir: "/tmp", Labels: map[string]string{"suite": "e2e"}})
	if sb.State != api.StateRunning || sb.Runtime == "" || sb.Isolation == "" || !strings.HasPrefix(sb.TemplateDigest, "sha256:") {
		t.Fatalf("unexpected sandbox: %+v", sb)
	}
	res, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "echo $GREETING $(pwd); echo err >&2; exit 7"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 7 || res.Stdout != "hi /tmp\n" || res.Stderr != "err\n" {
		t.Fatalf("exec: %+v", res)
	}
	if _, err := e.client.WriteFile(ctx, sb.ID, "/root/keep.txt", strings.NewReader("persist me"), 0o600); err != nil {
		t.Fatal(err)
	}
	wait := func(op *api.Operation, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.client.WaitOperation(ctx, op.ID); err != nil {
			t.Fatal(err)
		}
	}
	// Deleting a running sandbox without force is a conflict.
	if _, err := e.client.DeleteSandbox(ctx, sb.ID, false); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("delete of running sandbox without force: %v", err)
	}
	wait(e.client.Stop(ctx, sb.ID))
	got, _ := e.client.GetSandbox(ctx, sb.ID)
	if got.State != api.StateStopped {
		t.Fatalf("after stop: %s", got.State)
	}
	// Pause of a stopped sandbox is a state conflict.
	if _, err := e.client.Pause(ctx, sb.ID); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("pause of stopped sandbox: %v", err)
	}
	wait(e.client.Start(ctx, sb.ID))
	rc, err := e.client.ReadFile(ctx, sb.ID, "/root/keep.txt")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != "persist me" {
		t.Fatalf("file after stop/start: %q", b)
	}
	// Pause, then an exec wakes it transparently.
	wait(e.client.Pause(ctx, sb.ID))
	if got, _ := e.client.GetSandbox(ctx, sb.ID); got.State != api.StatePaused {
		t.Fatalf("after pause: %s", got.State)
	}
	res, err = e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec on paused sandbox: %v %+v", err, res)
	}
	if got, _ := e.client.GetSandbox(ctx, sb.ID); got.State != api.StateRunning {
		t.Fatalf("after transparent wake: %s", got.State)
	}
	// Stopped sandboxes wake transparently too.
	wait(e.client.Stop(ctx, sb.ID))
	res, err = e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/root/keep.txt"}})
	if err != nil || res.Stdout != "persist me" {
		t.Fatalf("exec on stopped sandbox: %v %+v", err, res)
	}
	// Suspend: a runtime that can (auto's choice here is gVisor when runsc
	// works) suspends and wakes on the next call with the disk intact;
	// native refuses, with the runtime and the reason named.
	if sb.Runtime == "native" {
		_, err = e.client.Suspend(ctx, sb.ID)
		var ae *sdk.APIError
		if !errors.As(err, &ae) || ae.Status != 422 || !strings.Contains(ae.Message, "runtime native cannot suspend") {
			t.Fatalf("suspend on native: %v", err)
		}
	} else {
		wait(e.client.Suspend(ctx, sb.ID))
		if got, _ := e.client.GetSandbox(ctx, sb.ID); got.State != api.StateSuspended {
			t.Fatalf("after suspend: %s", got.State)
		}
		res, err = e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/root/keep.txt"}})
		if err != nil || res.Stdout != "persist me" {
			t.Fatalf("exec on suspended sandbox: %v %+v", err, res)
		}
	}
	// Operation records carry phases.
	op, err := e.client.Stop(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	op, err = e.client.WaitOperation(ctx, op.ID)
	if err != nil || op.State != api.OpSucceeded || len(op.Phases) == 0 {
		t.Fatalf("stop op: %v %+v", err, op)
	}
	wait(e.client.DeleteSandbox(ctx, sb.ID, false))
	if _, err := e.client.GetSandbox(ctx, sb.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get after delete: %v", err)
	}
}

func TestCommandSessionReattach(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	cmd, err := e.client.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{ExecRequest: api.ExecRequest{
		Cmd: []string{"sh", "-c", "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.3; done; exit 4"}}})
	if err != nil {
		t.Fatal(err)
	}
	if cmd.AttachToken == "" || cmd.State != api.CommandCreated {
		t.Fatalf("command: %+v", cmd)
	}
	// A wrong token is refused.
	req, _ := http.NewRequest("GET", e.url+cmd.AttachURL, nil)
	req.Header.Set("Authorization", "Bearer wrong")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Fatalf("attach with wrong token: %d", resp.StatusCode)
	}
	var first bytes.Buffer
	s, err := e.client.Attach(ctx, cmd, sdk.AttachOptions{Stdout: &first})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(700 * time.Millisecond)
	so, se := s.Offsets()
	s.Close() // disconnect mid-run; the process keeps going
	time.Sleep(800 * time.Millisecond)
	var second bytes.Buffer
	s2, err := e.client.Attach(ctx, cmd, sdk.AttachOptions{Stdout: &second, StdoutOffset: so, StderrOffset: se})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s2.Wait()
	if err != nil {
		t.Fatal(err)
	}
	all := first.String()[:so] + second.String()
	if st.ExitCode != 4 || all != "line1\nline2\nline3\nline4\nline5\nline6\n" {
		t.Fatalf("exit %+v, output %q (first %q, second %q)", st, all, first.String(), second.String())
	}
	got, err := e.client.GetCommand(ctx, sb.ID, cmd.ID)
	if err != nil || got.State != api.CommandExited || got.Exit == nil || got.Exit.ExitCode != 4 {
		t.Fatalf("command after exit: %v %+v", err, got)
	}
}

func TestDetachedAndSignal(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	cmd, err := e.client.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{Detached: true, ExecRequest: api.ExecRequest{Cmd: []string{"sleep", "300"}}})
	if err != nil {
		t.Fatal(err)
	}
	if cmd.State != api.CommandRunning || cmd.Pid == 0 {
		t.Fatalf("detached command: %+v", cmd)
	}
	cmds, err := e.client.ListCommands(ctx, sb.ID)
	if err != nil || len(cmds) != 1 {
		t.Fatalf("list commands: %v %+v", err, cmds)
	}
	if err := e.client.SignalCommand(ctx, sb.ID, cmd.ID, "TERM"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := e.client.GetCommand(ctx, sb.ID, cmd.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == api.CommandExited {
			if got.Exit.Signal == "" {
				t.Fatalf("expected a signal exit: %+v", got.Exit)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("command did not exit after TERM: %+v", got)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestOOMIsReported(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Limits: api.Limits{MemoryMiB: 64}})
	res, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"python3", "-c", "x = bytearray(512 << 20); print(len(x))"}})
	if err != nil {
		t.Fatal(err)
	}
	if !res.OOMKilled {
		t.Fatalf("expected oom_killed: %+v", res)
	}
	// The sandbox survives its process's OOM.
	res, err = e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"echo", "alive"}})
	if err != nil || res.Stdout != "alive\n" {
		t.Fatalf("after OOM: %v %+v", err, res)
	}
}

func TestFilesAndCopy(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "d", "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "d", "a.txt"), []byte("alpha"), 0o644)
	os.WriteFile(filepath.Join(src, "d", "sub", "b.txt"), []byte("beta"), 0o600)
	if _, errOut, code := e.spaceCLI(t, "", "cp", filepath.Join(src, "d"), sb.ID+":/work"); code != 0 {
		t.Fatalf("cp in: %d %s", code, errOut)
	}
	res, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "cat /work/a.txt /work/sub/b.txt"}})
	if err != nil || res.Stdout != "alphabeta" {
		t.Fatalf("files after cp: %v %+v", err, res)
	}
	dst := t.TempDir()
	if _, errOut, code := e.spaceCLI(t, "", "cp", sb.ID+":/work", filepath.Join(dst, "back")); code != 0 {
		t.Fatalf("cp out: %d %s", code, errOut)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "back", "sub", "b.txt")); string(b) != "beta" {
		t.Fatalf("copied back: %q", b)
	}
	// Confinement through the API: a symlink to the host's /etc/hostname
	// resolves inside the sandbox.
	e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "echo sandbox-secret > /etc/marker; ln -s /etc/marker /tmp/link; ln -s ../../../../../../etc/marker /tmp/rel"}})
	for _, p := range []string{"/tmp/link", "/tmp/rel", "/tmp/../../../etc/marker"} {
		rc, err := e.client.ReadFile(ctx, sb.ID, p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		b, _ := io.ReadAll(rc)
		rc.Close()
		if string(b) != "sandbox-secret\n" {
			t.Fatalf("read %s gave %q", p, b)
		}
	}
	list, err := e.client.ListDir(ctx, sb.ID, "/work")
	if err != nil || len(list) != 2 {
		t.Fatalf("list: %v %+v", err, list)
	}
	if err := e.client.RemoveFile(ctx, sb.ID, "/work", false); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("non-recursive remove of a dir: %v", err)
	}
	if err := e.client.RemoveFile(ctx, sb.ID, "/work", true); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.StatFile(ctx, sb.ID, "/work"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("stat after remove: %v", err)
	}
	// Over the per-request limit: 413, with a known length and when streamed,
	// and nothing half-written is left at the target.
	big := bytes.Repeat([]byte("b"), maxFileBytes+1)
	if _, err := e.client.WriteFile(ctx, sb.ID, "/tmp/big", bytes.NewReader(big), 0o644); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Fatalf("oversize upload: %v", err)
	}
	if _, err := e.client.WriteFile(ctx, sb.ID, "/tmp/big", io.MultiReader(bytes.NewReader(big)), 0o644); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Fatalf("oversize streamed upload: %v", err)
	}
	if _, err := e.client.StatFile(ctx, sb.ID, "/tmp/big"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("oversize upload left a file: %v", err)
	}
	// Renames and mkdir -p.
	if _, err := e.client.Mkdir(ctx, sb.ID, "/a/b/c", 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.WriteFile(ctx, sb.ID, "/a/b/c/f", strings.NewReader("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.client.Rename(ctx, sb.ID, "/a/b/c/f", "/a/g"); err != nil {
		t.Fatal(err)
	}
	if fi, err := e.client.StatFile(ctx, sb.ID, "/a/g"); err != nil || fi.Size != 1 || fi.Type != "file" {
		t.Fatalf("stat after rename: %v %+v", err, fi)
	}
}

func TestBadInputs(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	big := strings.Repeat("x", 2<<20)
	cases := []struct {
		name, method, path, body string
		status                   int
		contains                 string
	}{
		{"malformed json", "POST", "/v1/sandboxes", `{"limits":`, 400, "malformed JSON"},
		{"unknown field", "POST", "/v1/sandboxes", `{"nope":1}`, 400, "unknown field"},
		{"negative memory", "POST", "/v1/sandboxes", `{"limits":{"memory_mib":-1}}`, 400, "memory_mib"},
		{"zero-ish cpus", "POST", "/v1/sandboxes", `{"limits":{"cpus":0.0001}}`, 400, "cpus"},
		{"overflow pids", "POST", "/v1/sandboxes", `{"limits":{"pids":99999999999999999999}}`, 400, "pids"},
		{"unknown runtime", "POST", "/v1/sandboxes", `{"runtime":"xen"}`, 400, "unknown runtime"},
		{"malformed template", "POST", "/v1/sandboxes", `{"template":"../../etc"}`, 400, "template name"},
		{"bad idle", "POST", "/v1/sandboxes", `{"idle":{"after_seconds":5,"action":"explode"}}`, 400, "idle.action"},
		{"idle suspend on native", "POST", "/v1/sandboxes", `{"runtime":"native","idle":{"after_seconds":5,"action":"suspend"}}`, 422, "cannot suspend"},
		{"oversize body", "POST", "/v1/sandboxes", `{"template":"` + big + `"}`, 413, "larger"},
		{"unknown sandbox", "GET", "/v1/sandboxes/sb-aaaaaaaaaaaaaaaa", "", 404, "not found"},
		{"garbage id", "GET", "/v1/sandboxes/..%2f..%2fetc", "", 404, ""},
		{"unknown op", "GET", "/v1/operations/op-aaaaaaaaaaaaaaaa", "", 404, ""},
		{"bad wait", "GET", "/v1/operations/op-aaaaaaaaaaaaaaaa?wait=forever", "", 400, "wait"},
		{"unknown verb", "POST", "/v1/sandboxes/" + sb.ID + "/explode", "", 404, "unknown lifecycle verb"},
		{"resume running", "POST", "/v1/sandboxes/" + sb.ID + "/start", "", 202, ""},
		{"empty cmd", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":[]}`, 400, "cmd"},
		{"nul in cmd", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["echo","a\u0000b"]}`, 400, "NUL"},
		{"bad env key", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["true"],"env":{"A=B":"c"}}`, 400, "env key"},
		{"relative workdir", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["true"],"workdir":"tmp"}`, 400, "workdir"},
		{"missing workdir", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["true"],"workdir":"/does/not/exist"}`, 0, ""},
		{"relative root", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["true"],"root":"srv"}`, 400, "root must be an absolute path"},
		{"unclean root", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["true"],"root":"/srv/../etc"}`, 400, "root must be a clean path"},
		{"root not a directory", "POST", "/v1/sandboxes/" + sb.ID + "/exec", `{"cmd":["true"],"root":"/etc/passwd"}`, 400, "is not a directory"},
		{"missing root", "POST", "/v1/sandboxes/" + sb.ID + "/commands", `{"cmd":["true"],"root":"/nope","detached":true}`, 400, "does not exist"},
		{"nul path", "GET", "/v1/sandboxes/" + sb.ID + "/files?path=/etc/%00passwd", "", 400, "NUL"},
		{"long path", "GET", "/v1/sandboxes/" + sb.ID + "/files?path=/" + strings.Repeat("a", 5000), "", 400, "longer"},
		{"relative path", "GET", "/v1/sandboxes/" + sb.ID + "/files?path=etc/passwd", "", 400, "absolute"},
		{"missing file", "GET", "/v1/sandboxes/" + sb.ID + "/files?path=/nope", "", 404, ""},
		{"bad mode", "PUT", "/v1/sandboxes/" + sb.ID + "/files?path=/tmp/x&mode=999", "x", 400, "mode"},
		{"unknown command", "GET", "/v1/sandboxes/" + sb.ID + "/commands/cmd-aaaaaaaaaaaaaaaa", "", 404, ""},
		{"bad label filter", "GET", "/v1/sandboxes?label=novalue", "", 400, "label"},
		{"bad state filter", "GET", "/v1/sandboxes?state=melting", "", 400, "state"},
		{"wrong method", "PATCH", "/v1/sandboxes", "", 405, ""},
		{"unknown template", "POST", "/v1/sandboxes", `{"template":"nope:v1"}`, 404, "nope:v1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, _ := http.NewRequestWithContext(ctx, c.method, e.url+c.path, strings.NewReader(c.body))
			req.Header.Set("Authorization", "Bearer "+e.key)
			if c.body != "" && c.method != "PUT" {
				req.Header.Set("Content-Type", "application/json")
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if c.status == 0 {
				if resp.StatusCode < 400 || resp.StatusCode >= 500 {
					t.Fatalf("want a 4xx, got %d %s", resp.StatusCode, b)
				}
			} else if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, b)
			}
			if resp.StatusCode >= 400 {
				var ae api.Error
				if err := json.Unmarshal(b, &ae); err != nil || ae.Error.Code == "" || ae.Error.Message == "" {
					t.Fatalf("error body is not {error:{code,message}}: %s", b)
				}
				if !strings.Contains(ae.Error.Message, c.contains) {
					t.Fatalf("message %q does not mention %q", ae.Error.Message, c.contains)
				}
			}
		})
	}
	// Unauthenticated requests are refused.
	resp, err := http.Get(e.url + "/v1/sandboxes")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Fatalf("no API key: %d", resp.StatusCode)
	}
}

func TestIdlePolicyAndTTL(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	idle := newSandbox(t, e, api.CreateSandboxRequest{Idle: &api.IdlePolicy{AfterSeconds: 1, Action: "pause"}})
	ttl := newSandbox(t, e, api.CreateSandboxRequest{TTLSeconds: 2})
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, err := e.client.GetSandbox(ctx, idle.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == api.StatePaused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idle sandbox still %s", got.State)
		}
		time.Sleep(100 * time.Millisecond)
	}
	res, err := e.client.Exec(ctx, idle.ID, api.ExecRequest{Cmd: []string{"echo", "woke"}})
	if err != nil || res.Stdout != "woke\n" {
		t.Fatalf("exec after idle pause: %v %+v", err, res)
	}
	for {
		_, err := e.client.GetSandbox(ctx, ttl.ID)
		if errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("TTL sandbox still exists: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestMetricsAndOpenAPI(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	// An exec of its own, so space_exec_total exists when the test runs alone.
	if _, code := sh(t, e, sb.ID, "true"); code != 0 {
		t.Fatalf("exec: exit %d", code)
	}
	resp, err := http.Get(e.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`space_sandboxes{runtime="` + sb.Runtime + `",state="running"}`, "space_operation_phase_seconds_bucket", `space_exec_total`} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	resp, err = http.Get(e.url + "/openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.Contains(b, []byte("openapi: 3.1")) {
		t.Fatalf("/openapi.yaml: %.100s", b)
	}
}

// countWriter counts bytes and checks they are all the same byte.
type countWriter struct {
	n   int64
	bad bool
}

func (w *countWriter) Write(p []byte) (int, error) {
	for _, b := range p {
		if b != 'y' && b != '\n' {
			w.bad = true
		}
	}
	w.n += int64(len(p))
	return len(p), nil
}

// TestAttachedOutputIsComplete: while a client is attached and reading, a
// fast producer is held back instead of overflowing the replay buffer, so
// every byte arrives (the bounded buffer is for clients that are away).
func TestAttachedOutputIsComplete(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	const total = 30 << 20
	var out countWriter
	var errOut bytes.Buffer
	st, err := e.client.Run(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "yes | head -c 31457280"}}, &out, &errOut)
	if err != nil || st.ExitCode != 0 {
		t.Fatalf("run: %v %+v", err, st)
	}
	if out.n != total || out.bad || strings.Contains(errOut.String(), "dropped") {
		t.Fatalf("got %d of %d bytes (corrupt=%v); stderr %q", out.n, total, out.bad, errOut.String())
	}
}
