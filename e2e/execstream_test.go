package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cli"
	"github.com/spacehq/space/sdk"
)

// TestExecStream: `space exec` without a TTY runs through one request
// (POST …/exec/stream) and keeps what the attach path gave: stdout and
// stderr apart and whole (3 MB, more than the agent's 1 MiB replay
// buffer), output as it is produced, the exit code, signals, and a
// missing sandbox named as before.
func TestExecStream(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})

	out, errOut, code := e.spaceCLI(t, "", "exec", sb.ID, "--", "sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo err >&2; exit 7")
	if code != 7 || len(out) != 3000001 || strings.Trim(out, "a\n") != "" || errOut != "err\n" {
		t.Fatalf("exec: code %d, %d bytes of stdout, stderr %q", code, len(out), errOut)
	}

	// Output arrives while the command runs: the first line is there
	// before the command is let go.
	var o, se lockedBuffer
	done := make(chan int, 1)
	go func() {
		done <- cli.Execute(ctx, []string{"--url", e.url, "--api-key", e.key, "exec", sb.ID, "--", "sh", "-c",
			"echo first; while [ ! -e /tmp/go-stream ]; do sleep 0.05; done; echo second"}, strings.NewReader(""), &o, &se)
	}()
	for deadline := time.Now().Add(time.Minute); o.String() != "first\n"; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no output while the command runs: stdout %q stderr %q", o.String(), se.String())
		}
	}
	if _, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"touch", "/tmp/go-stream"}}); err != nil {
		t.Fatal(err)
	}
	if code := <-done; code != 0 || o.String() != "first\nsecond\n" {
		t.Fatalf("streamed exec: code %d stdout %q stderr %q", code, o.String(), se.String())
	}

	// A signal reaches the process through the session (POST …/signal).
	var up lockedBuffer
	sess, err := e.client.ExecStream(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "echo up; exec sleep 60"}}, sdk.AttachOptions{Stdout: &up})
	if err != nil {
		t.Fatal(err)
	}
	waited := make(chan api.ExitStatus, 1)
	go func() { st, _ := sess.Wait(); waited <- st }()
	for deadline := time.Now().Add(30 * time.Second); up.String() != "up\n"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no output from the command to signal: %q", up.String())
		}
	}
	if err := sess.Signal("TERM"); err != nil {
		t.Fatalf("signal: %v", err)
	}
	select {
	case st := <-waited:
		if st.Signal != "TERM" && st.ExitCode != 143 {
			t.Fatalf("after TERM: %+v", st)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("TERM did not end the command")
	}
	sess.Close()

	// stdin in the request is the process's whole stdin.
	var so bytes.Buffer
	sess, err = e.client.ExecStream(ctx, sb.ID, api.ExecRequest{Cmd: []string{"wc", "-c"}, Stdin: "12345"}, sdk.AttachOptions{Stdout: &so})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := sess.Wait(); err != nil || st.ExitCode != 0 || strings.TrimSpace(so.String()) != "5" {
		t.Fatalf("stdin: %v %+v %q", err, st, so.String())
	}

	if _, errOut, code := e.spaceCLI(t, "", "exec", "sb-nosuchsandbox", "--", "true"); code != cli.ExitRunFailed || !strings.Contains(errOut, "not found") {
		t.Fatalf("missing sandbox: %d %q", code, errOut)
	}
}

// TestExecStreamWire: the route's answers on the wire — length-prefixed
// frames ending with exit and the command's id in a header; 4xx JSON for a
// TTY or an output cap.
func TestExecStreamWire(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})
	post := func(body string) *http.Response {
		req, _ := http.NewRequestWithContext(context.Background(), "POST", e.url+"/v1/sandboxes/"+sb.ID+"/exec/stream", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+e.key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	resp := post(`{"cmd":["sh","-c","echo hi; exit 4"]}`)
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/vnd.space.frames" || resp.Header.Get("Space-Command-Id") == "" {
		t.Fatalf("stream: %d %v", resp.StatusCode, resp.Header)
	}
	var types []byte
	var exit api.ExitStatus
	for {
		var n [4]byte
		if _, err := io.ReadFull(resp.Body, n[:]); err != nil {
			break
		}
		b := make([]byte, binary.BigEndian.Uint32(n[:]))
		if _, err := io.ReadFull(resp.Body, b); err != nil {
			t.Fatal(err)
		}
		f, err := api.DecodeFrame(b)
		if err != nil {
			t.Fatal(err)
		}
		types = append(types, f.Type)
		if f.Type == api.FrameExit {
			exit = f.Exit
		}
	}
	if len(types) < 3 || types[0] != api.FrameStarted || types[len(types)-1] != api.FrameExit || exit.ExitCode != 4 {
		t.Fatalf("frames %v, exit %+v", types, exit)
	}
	for _, body := range []string{`{"cmd":["true"],"tty":true}`, `{"cmd":["true"],"max_output_bytes":10}`, `{"cmd":[]}`} {
		r := post(body)
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != 400 || !strings.Contains(string(b), `"code"`) {
			t.Errorf("%s: %d %s", body, r.StatusCode, b)
		}
	}
}
