package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// TestCreateWait: POST /v1/sandboxes?wait= answers when the create has
// finished — 200 with the running sandbox and the succeeded operation, or
// with the failed operation and the sandbox in error — and 202 when the
// wait is too short; a bad wait is a 400 that creates nothing.
func TestCreateWait(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	post := func(query, body string) (int, api.CreateSandboxResponse, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, "POST", e.url+"/v1/sandboxes"+query, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+e.key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var out api.CreateSandboxResponse
		if resp.StatusCode < 300 {
			if err := json.Unmarshal(b, &out); err != nil {
				t.Fatalf("%s: %v", b, err)
			}
			t.Cleanup(func() {
				if op, err := e.client.DeleteSandbox(context.Background(), out.Sandbox.ID, true); err == nil {
					e.client.WaitOperation(context.Background(), op.ID)
				}
			})
		}
		return resp.StatusCode, out, string(b)
	}

	code, out, body := post("?wait=60s", `{"runtime":"native"}`)
	if code != 200 || out.Sandbox.State != api.StateRunning || out.Operation.State != api.OpSucceeded || out.Operation.FinishedAt == nil {
		t.Fatalf("wait=60s: %d %s", code, body)
	}
	if len(out.Operation.Phases) == 0 {
		t.Fatalf("the finished operation has no phases: %s", body)
	}
	res, err := e.client.Exec(ctx, out.Sandbox.ID, api.ExecRequest{Cmd: []string{"echo", "up"}})
	if err != nil || res.ExitCode != 0 || string(res.Stdout) != "up\n" {
		t.Fatalf("exec right after the create answered: %v %+v", err, res)
	}

	// A template that does not exist is the create's plan's 404, before
	// anything is written.
	code, _, body = post("?wait=60s", `{"runtime":"native","template":"nope:v1"}`)
	if code != 404 || !strings.Contains(body, "nope:v1") {
		t.Fatalf("create from a missing template: %d %s", code, body)
	}
	// A create that fails in its operation (the template's start command
	// exits before it is ready) answers with the failed operation and the sandbox in error.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM base:latest\nSTART sh -c 'echo boom >&2; exit 3'\nREADY --timeout=20s sh -c 'exit 1'\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const failing = "e2e-create-fails:v1"
	t.Cleanup(func() { e.client.RemoveTemplate(context.Background(), failing, true) })
	if _, err := e.client.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{failing}}, nil); err != nil {
		t.Fatalf("build: %v", err)
	}
	code, out, body = post("?wait=60s", `{"runtime":"native","template":"`+failing+`"}`)
	if code != 200 || out.Operation.State != api.OpFailed || out.Operation.Error == nil || out.Sandbox.State != api.StateError ||
		!strings.Contains(out.Operation.Error.Message, "boom") {
		t.Fatalf("failing create with wait: %d %s", code, body)
	}

	// 1 ms is shorter than any create: the caller gets the operation to poll.
	code, out, body = post("?wait=1ms", `{"runtime":"native"}`)
	if code != 202 || out.Operation.Done() {
		t.Fatalf("wait=1ms: %d %s", code, body)
	}
	if _, err := e.client.WaitOperation(ctx, out.Operation.ID); err != nil {
		t.Fatal(err)
	}

	// The SDK's create-and-wait (which asks with ?wait=) returns it running.
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})
	if sb.State != api.StateRunning {
		t.Fatalf("CreateSandboxAndWait: state %s", sb.State)
	}

	// A bad wait is refused before anything is made.
	label := `{"runtime":"native","labels":{"create-wait-test":"refused"}}`
	if code, _, body := post("?wait=forever", label); code != 400 || !strings.Contains(body, "wait") {
		t.Fatalf("wait=forever: %d %s", code, body)
	}
	if made, err := e.client.ListSandboxes(ctx, sdk.ListOptions{Labels: map[string]string{"create-wait-test": "refused"}}); err != nil || len(made) != 0 {
		t.Fatalf("a refused create made a sandbox: %v %v", made, err)
	}
}
