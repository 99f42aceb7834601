package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/e2b"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/sdk"
)

// The REST and E2B routes the matrix's other rows do not reach (reads, the exec
// stream, command sessions, ports, the lifecycle verbs that need a sandbox
// in another state), and the check that every route which can cause a
// policy action (server.FrontDoorActions, e2b.FrontDoorActions) has a row: a new route without
// one fails TestFrontDoorPolicy.

const (
	fdSecretReason = "fd-secret stays private"
	fdPortReason   = "port 8000 is shut"
	fdChurnReason  = "leave it as it is"
)

// fdMoreRules are added to fdRules on the matrix's two sandboxes.
var fdMoreRules = []api.PolicyRule{
	{Name: "secret-ro", Verdict: "deny", Reason: fdSecretReason,
		Match: `action.kind == "file.read" && under(action.path, "/etc/fd-secret")`},
	{Name: "port-8000", Verdict: "deny", Reason: fdPortReason,
		Match: `action.kind == "port" && action.port == 8000`},
}

// fdChurnRules hold the churn sandboxes where their set-up left them.
var fdChurnRules = []api.PolicyRule{
	{Name: "no-churn", Verdict: "deny", Reason: fdChurnReason,
		Match: `action.kind == "lifecycle" && action.verb in ["stop", "start", "resume", "wake", "restore"]`},
}

// fdRouteOf maps the rows' names to the route each one reaches.
var fdRouteOf = []struct{ prefix, route string }{
	{"rest/write/", "PUT /v1/sandboxes/{id}/files"},
	{"rest/allow/write-tmp", "PUT /v1/sandboxes/{id}/files"},
	{"rest/mkdir/", "POST /v1/sandboxes/{id}/files/mkdir"},
	{"rest/rename-", "POST /v1/sandboxes/{id}/files/rename"},
	{"rest/delete/", "DELETE /v1/sandboxes/{id}/files"},
	{"rest/tar/", "PUT /v1/sandboxes/{id}/files/tar"},
	{"rest/exec/", "POST /v1/sandboxes/{id}/exec"},
	{"rest/pause", "POST /v1/sandboxes/{id}/pause"},
	{"rest/suspend", "POST /v1/sandboxes/{id}/suspend"},
	{"rest/fork", "POST /v1/sandboxes/{id}/fork"},
	{"rest/delete-sandbox", "DELETE /v1/sandboxes/{id}"},
	{"mcp/", "POST /mcp"},
	{"e2b/files.write/", "POST /e2b/envd/files"},
	{"e2b/allow/files.write-tmp", "POST /e2b/envd/files"},
	{"e2b/files.makeDir/", "POST /e2b/envd/filesystem.Filesystem/MakeDir"},
	{"e2b/files.rename-into/", "POST /e2b/envd/filesystem.Filesystem/Move"},
	{"e2b/files.remove/", "POST /e2b/envd/filesystem.Filesystem/Remove"},
	{"e2b/uploadUrl/", "POST /files"},
	{"e2b/commands.run", "POST /e2b/envd/process.Process/Start"},
	{"e2b/pause/", "POST /e2b/sandboxes/{id}/pause"},
	{"e2b/fork", "POST /e2b/sandboxes/{id}/fork"},
	{"e2b/Sandbox.kill", "DELETE /e2b/sandboxes/{id}"},
}

// fdRowRoute is the route a row reaches, in space's table or E2B's.
func fdRowRoute(r fdRow) string {
	if r.route != "" {
		return r.route
	}
	for _, m := range fdRouteOf {
		if strings.HasPrefix(r.name, m.prefix) {
			return m.route
		}
	}
	return ""
}

// checkRouteCoverage fails for every route that can cause a policy action
// and that no row reaches.
func checkRouteCoverage(t *testing.T, rows []fdRow) {
	t.Helper()
	covered := map[string]bool{}
	for _, r := range rows {
		covered[fdRowRoute(r)] = true
	}
	var missing []string
	for _, table := range []map[string][]string{server.FrontDoorActions, e2b.FrontDoorActions} {
		for pattern, kinds := range table {
			if len(kinds) > 0 && !covered[pattern] {
				missing = append(missing, fmt.Sprintf("%s (%s)", pattern, strings.Join(kinds, ", ")))
			}
		}
	}
	sort.Strings(missing)
	for _, m := range missing {
		t.Errorf("no front-door row reaches %s: add one to the matrix", m)
	}
}

// fdChurn are the sandboxes the lifecycle rows need in another state:
// stopped (start), paused (resume, wake), suspended (restore).
type fdChurn struct{ stopped, paused, suspended string }

func (fd *frontDoor) routeRows(nat string, ch fdChurn) []fdRow {
	c := fd.e.client
	ctx := context.Background()
	read := func(name, route, audit string, call func() error) fdRow {
		return fdRow{name: name, route: route, want: fdDeny, sb: nat, deny: fdSecretReason, audit: audit,
			do: func(t *testing.T) fdOutcome { return restOutcome(call()) }}
	}
	rows := []fdRow{
		read("rest/read/dotdot", "GET /v1/sandboxes/{id}/files", "file.read of /etc/fd-secret/s", func() error {
			rc, err := c.ReadFile(ctx, nat, "/tmp/../etc/fd-secret/s")
			if err == nil {
				rc.Close()
			}
			return err
		}),
		read("rest/stat/symlink", "GET /v1/sandboxes/{id}/files/stat", "file.read of /etc/fd-secret/s", func() error {
			_, err := c.StatFile(ctx, nat, "/tmp/l/fd-secret/s")
			return err
		}),
		read("rest/list/dslash", "GET /v1/sandboxes/{id}/files/list", "file.read of /etc/fd-secret", func() error {
			_, err := c.ListDir(ctx, nat, "//etc/fd-secret")
			return err
		}),
		read("rest/tar-get/symlink", "GET /v1/sandboxes/{id}/files/tar", "file.read of /etc/fd-secret", func() error {
			rc, err := c.DownloadTar(ctx, nat, "/tmp/l/fd-secret")
			if err == nil {
				io.Copy(io.Discard, rc)
				rc.Close()
			}
			return err
		}),
		read("rest/watch/dot", "GET /v1/sandboxes/{id}/files/watch", "file.read of /etc/fd-secret", func() error {
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			return c.WatchDir(wctx, nat, api.WatchRequest{Path: "/./etc/fd-secret"}, func(api.FileEvent) error { return errors.New("a watch of a refused path started") })
		}),
		{name: "rest/exec-stream", route: "POST /v1/sandboxes/{id}/exec/stream", want: fdDeny, sb: nat, deny: fdTouchReason, audit: "exec of touch",
			do: func(t *testing.T) fdOutcome {
				s, err := c.ExecStream(ctx, nat, api.ExecRequest{Cmd: []string{"touch", "/tmp/fd-exec-stream"}}, sdk.AttachOptions{})
				if err == nil {
					s.Close()
				}
				return restOutcome(err)
			},
			after: fd.absent(nat, "/tmp/fd-exec-stream")},
		{name: "rest/command", route: "POST /v1/sandboxes/{id}/commands", want: fdDeny, sb: nat, deny: fdTouchReason, audit: "exec of touch",
			do: func(t *testing.T) fdOutcome {
				_, err := c.CreateCommand(ctx, nat, api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"touch", "/tmp/fd-command"}}, Detached: true})
				return restOutcome(err)
			},
			after: fd.absent(nat, "/tmp/fd-command")},
		{name: "rest/port-public", route: "PUT /v1/sandboxes/{id}/ports/{port}", want: fdDeny, sb: nat, deny: fdPortReason, audit: "port 8000",
			do: func(t *testing.T) fdOutcome {
				_, err := c.SetPortPublic(ctx, nat, 8000, true)
				return restOutcome(err)
			}},
		{name: "rest/port-tcp", route: "GET /v1/sandboxes/{id}/ports/{port}/tcp", want: fdDeny, sb: nat, deny: fdPortReason, audit: "port 8000",
			do: func(t *testing.T) fdOutcome {
				conn, err := c.DialPort(ctx, nat, 8000)
				if err == nil {
					conn.Close()
				}
				return restOutcome(err)
			}},
	}
	for _, method := range []string{"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"} {
		rows = append(rows, fdRow{name: "rest/port-proxy/" + method, route: method + " /v1/sandboxes/{id}/ports/{port}/{path...}",
			want: fdDeny, sb: nat, deny: fdPortReason, audit: "port 8000",
			do: func(t *testing.T) fdOutcome { return fd.proxy(t, method, nat, 8000) }})
	}
	verb := func(name, id, v string, call func() (*api.Operation, error), state string) fdRow {
		return fdRow{name: "rest/" + name, route: "POST /v1/sandboxes/{id}/" + v, want: fdDeny, sb: id, deny: fdChurnReason, audit: "lifecycle " + v,
			do: func(t *testing.T) fdOutcome {
				_, err := call()
				return restOutcome(err)
			},
			after: fd.inState(id, state)}
	}
	rows = append(rows,
		verb("stop", ch.paused, api.OpStop, func() (*api.Operation, error) { return c.Stop(ctx, ch.paused) }, api.StatePaused),
		verb("start", ch.stopped, api.OpStart, func() (*api.Operation, error) { return c.Start(ctx, ch.stopped) }, api.StateStopped),
		verb("resume", ch.paused, api.OpResume, func() (*api.Operation, error) { return c.Resume(ctx, ch.paused) }, api.StatePaused),
		verb("wake", ch.paused, api.OpWake, func() (*api.Operation, error) { return c.Wake(ctx, ch.paused) }, api.StatePaused),
		verb("restore", ch.suspended, api.OpRestore, func() (*api.Operation, error) { return c.Restore(ctx, ch.suspended) }, api.StateSuspended),
	)
	return append(rows, fd.e2bRouteRows(nat, ch)...)
}

// e2bRouteRows reach the E2B routes e2bRows' calls do not: reads through
// the SDK, and the routes its version never calls, raw (as E2B's other
// SDKs and older versions call them).
func (fd *frontDoor) e2bRouteRows(nat string, ch fdChurn) []fdRow {
	js := func(name, op string, args map[string]any) func(t *testing.T) fdOutcome {
		return func(t *testing.T) fdOutcome {
			req := map[string]any{"door": "e2b", "op": op}
			for k, v := range args {
				req[k] = v
			}
			return fd.js.call(t, req)
		}
	}
	read := func(name, route, op, path, audit string) fdRow {
		return fdRow{name: "e2b/" + name, route: route, want: fdDeny, sb: nat, deny: fdSecretReason, audit: audit,
			do: js(name, op, map[string]any{"sandbox": nat, "path": path})}
	}
	fs := "/e2b/envd/filesystem.Filesystem/"
	wake := func(name, route string, do func(t *testing.T) fdOutcome) fdRow {
		return fdRow{name: "e2b/" + name, route: route, want: fdDeny, sb: ch.paused, deny: fdChurnReason, audit: "lifecycle wake",
			do: do, after: fd.inState(ch.paused, api.StatePaused)}
	}
	return []fdRow{
		read("files.read/dotdot", "GET /e2b/envd/files", "read", "/tmp/../etc/fd-secret/s", "file.read of /etc/fd-secret/s"),
		read("files.getInfo/symlink", "POST "+fs+"Stat", "stat", "/tmp/l/fd-secret/s", "file.read of /etc/fd-secret/s"),
		read("files.list/dslash", "POST "+fs+"ListDir", "list", "//etc/fd-secret", "file.read of /etc/fd-secret"),
		read("files.watchDir", "POST "+fs+"WatchDir", "watch", "/etc/./fd-secret", "file.read of /etc/fd-secret"),
		read("downloadUrl", "GET /files", "downloadUrl", "/etc/fd-secret/s", "file.read of /etc/fd-secret/s"),
		{name: "e2b/raw/CreateWatcher", route: "POST " + fs + "CreateWatcher", want: fdDeny, sb: nat, deny: fdSecretReason,
			audit: "file.read of /etc/fd-secret",
			do: func(t *testing.T) fdOutcome {
				return fd.e2bRaw(t, "POST", fs+"CreateWatcher", nat, `{"path":"/tmp/l/fd-secret"}`)
			}},
		// A deadline brought closer decides the verb it will apply.
		{name: "e2b/setTimeout", route: "POST /e2b/sandboxes/{id}/timeout", want: fdDeny, sb: nat, deny: fdKeepReason,
			audit: "lifecycle delete", do: js("setTimeout", "setTimeout", map[string]any{"sandbox": nat, "ms": 10_000})},
		{name: "e2b/raw/refreshes", route: "POST /e2b/sandboxes/{id}/refreshes", want: fdDeny, sb: nat, deny: fdKeepReason,
			audit: "lifecycle delete",
			do: func(t *testing.T) fdOutcome {
				return fd.e2bRaw(t, "POST", "/e2b/sandboxes/"+nat+"/refreshes", "", `{"duration":10}`)
			}},
		wake("Sandbox.connect", "POST /e2b/v2/sandboxes/{id}/connect", js("connect", "connect", map[string]any{"sandbox": ch.paused})),
		wake("raw/resume", "POST /e2b/sandboxes/{id}/resume", func(t *testing.T) fdOutcome {
			return fd.e2bRaw(t, "POST", "/e2b/sandboxes/"+ch.paused+"/resume", "", `{}`)
		}),
	}
}

// e2bRaw makes one E2B call with plain HTTP and the API key (envd calls
// name their sandbox in E2b-Sandbox-Id and act as root), as E2B's SDKs
// other than the JS one do; Connect's unary calls are JSON.
func (fd *frontDoor) e2bRaw(t *testing.T, method, path, sb, body string) fdOutcome {
	req, err := http.NewRequest(method, fd.e.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", fd.e.key)
	req.Header.Set("Content-Type", "application/json")
	if sb != "" {
		req.Header.Set("E2b-Sandbox-Id", sb)
		req.SetBasicAuth("root", "")
	}
	return httpOutcome(req)
}

// proxy sends one request through the path-routed port proxy with the API
// key and reports the answer.
func (fd *frontDoor) proxy(t *testing.T, method, id string, port int) fdOutcome {
	req, err := http.NewRequest(method, fmt.Sprintf("%s/v1/sandboxes/%s/ports/%d/fd", fd.e.url, id, port), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+fd.e.key)
	return httpOutcome(req)
}

// httpOutcome sends req and reports the answer: its status and (the start
// of) its body.
func httpOutcome(req *http.Request) fdOutcome {
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fdOutcome{Message: err.Error()}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode < 300 {
		return fdOutcome{OK: true, Status: resp.StatusCode, Message: string(b)}
	}
	return fdOutcome{Status: resp.StatusCode, Message: string(b), Class: "http"}
}

// inState checks sandbox id is (still) in state.
func (fd *frontDoor) inState(id, state string) func(t *testing.T) {
	return func(t *testing.T) {
		t.Helper()
		sb, err := fd.e.client.GetSandbox(ctxT(t, time.Minute), id)
		if err != nil {
			t.Fatal(err)
		}
		if sb.State != state {
			t.Errorf("sandbox %s is %s after the refusal, want %s", id, sb.State, state)
		}
	}
}

// makeChurn creates the churn sandboxes, puts each in its state and
// attaches fdChurnRules to them.
func makeChurn(t *testing.T, e *env, ctx context.Context, sleeper, tag string) fdChurn {
	t.Helper()
	type want struct {
		rt, verb string
		id       *string
	}
	var ch fdChurn
	wants := []want{{"native", api.OpStop, &ch.stopped}, {"native", api.OpPause, &ch.paused}, {sleeper, api.OpSuspend, &ch.suspended}}
	errs := make(chan error, len(wants))
	for _, w := range wants {
		go func() {
			sb, err := e.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: w.rt, Labels: map[string]string{"frontdoor-churn": tag}})
			if err != nil {
				errs <- err
				return
			}
			*w.id = sb.ID
			t.Cleanup(func() {
				if op, err := e.client.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
					e.client.WaitOperation(context.Background(), op.ID)
				}
			})
			op, err := e.client.Lifecycle(ctx, sb.ID, w.verb)
			if err == nil {
				_, err = e.client.WaitOperation(ctx, op.ID)
			}
			if err != nil {
				errs <- fmt.Errorf("%s of %s: %w", w.verb, sb.ID, err)
				return
			}
			scope := "sandbox:" + sb.ID
			t.Cleanup(func() { e.client.DeletePolicyRuleSet(context.Background(), scope) })
			_, err = e.client.SetPolicyRuleSet(ctx, scope, api.PolicyRuleSet{Rules: fdChurnRules})
			errs <- err
		}()
	}
	for range wants {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	return ch
}
