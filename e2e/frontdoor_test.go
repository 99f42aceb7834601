package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// One policy decision point beneath every front door (issue 26): the same
// sandbox-scoped rules, and each front door — REST through the Go SDK, MCP
// through the official TypeScript client, E2B through its JS SDK — trying
// every kind of action they refuse, by every spelling of the path. Each
// row checks three things: the caller's refusal names the rule's reason
// (403 policy_denied; an MCP tool error saying policy_denied), the audit
// log holds the denial with the path or verb the policy decided, and the
// sandbox is as it was (the file did not appear, the victim is still
// there, the sandbox still runs and has no fork). An allow row per door
// shows the rules refuse only what they name.
//
// Files, exec, pause and delete run on a native sandbox (fastest). Native
// cannot suspend or fork — the runtime refuses those before the policy is
// asked — so suspend, E2B's pause (which is suspend where the runtime can)
// and fork run on a second sandbox of a runtime that can.

// The rules, attached to both sandboxes.
const (
	fdEtcReason   = "etc is read-only"
	fdKeepReason  = "this sandbox is kept"
	fdAwakeReason = "stay awake"
	fdForkReason  = "no copies of this sandbox"
	fdTouchReason = "touch is not allowed here"
)

var fdRules = []api.PolicyRule{
	{Name: "etc-ro", Verdict: "deny", Reason: fdEtcReason,
		Match: `(action.kind == "file.write" || action.kind == "file.delete") && under(action.path, "/etc")`},
	{Name: "no-delete", Verdict: "deny", Reason: fdKeepReason,
		Match: `action.kind == "lifecycle" && action.verb == "delete"`},
	{Name: "no-sleep", Verdict: "deny", Reason: fdAwakeReason,
		Match: `action.kind == "lifecycle" && (action.verb == "suspend" || action.verb == "pause")`},
	{Name: "no-fork", Verdict: "deny", Reason: fdForkReason,
		Match: `action.kind == "lifecycle" && action.verb == "fork"`},
	// The binary by name wherever it is in the argv: E2B's commands.run
	// and MCP's string cmd reach the policy as a shell's argv.
	{Name: "no-touch", Verdict: "deny", Reason: fdTouchReason,
		Match: `action.kind == "exec" && action.argv.exists(a, a.matches(r"(^|[\s/;&|])touch(\s|$)"))`},
}

// fdOutcome is what a client saw.
type fdOutcome struct {
	OK      bool   `json:"ok"`
	Status  int    `json:"status"`
	Message string `json:"message"`
	Class   string `json:"class"`
}

func (o fdOutcome) String() string {
	if o.OK {
		return "ok " + firstLine(o.Message)
	}
	return fmt.Sprintf("%d %s %q", o.Status, o.Class, o.Message)
}

// restOutcome turns a Go SDK result into an outcome.
func restOutcome(err error) fdOutcome {
	if err == nil {
		return fdOutcome{OK: true}
	}
	var ae *sdk.APIError
	if errors.As(err, &ae) {
		return fdOutcome{Status: ae.Status, Message: ae.Message + " (" + ae.Code + ")", Class: ae.Code}
	}
	return fdOutcome{Message: err.Error(), Class: fmt.Sprintf("%T", err)}
}

const (
	fdAllow     = "allow"     // must succeed
	fdDeny      = "deny"      // refused by a rule, which the audit log records
	fdContained = "contained" // refused, not by the policy (the agent refused a symlink on the way)
)

type fdRow struct {
	name  string // door/action/variant
	route string // the REST route it reaches, when its name does not say (fdRouteOf)
	want  string // fdAllow, fdDeny or fdContained
	sb    string // the sandbox acted on (whose audit is read)
	do    func(t *testing.T) fdOutcome
	deny  string // the reason a refusal names
	audit string // the decided action as the audit log names it, "file.write of /etc/x"
	after func(t *testing.T)
}

func TestFrontDoorPolicy(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 10*time.Minute)
	node, err := exec.LookPath("node")
	testenv.Require(t, "node", err == nil, "node is not on PATH (scripts/setup-test.sh checks for it)")
	if _, err := os.Stat("js/node_modules/e2b/package.json"); err != nil {
		t.Fatalf("e2e/js/node_modules is missing: run scripts/setup-test.sh (npm ci from the lockfile): %v", err)
	}
	start := time.Now()
	info, err := e.client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sleeper := ""
	for _, r := range info.Runtimes {
		if r.Available && r.Verbs[api.OpSuspend] && r.Verbs[api.OpFork] && (sleeper == "" || r.Name == "gvisor") {
			sleeper = r.Name
		}
	}
	testenv.Require(t, "suspend+fork", sleeper != "", "no runtime here can suspend and fork")

	// Both sandboxes at once; a label each, which fork children inherit.
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	type made struct {
		sb  *api.Sandbox
		err error
	}
	ch := make(chan made, 2)
	for _, rt := range []string{"native", sleeper} {
		go func() {
			sb, err := e.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: rt, Labels: map[string]string{"frontdoor": rt + "-" + tag}})
			ch <- made{sb, err}
		}()
	}
	var nat, slp string
	for range 2 {
		m := <-ch
		if m.err != nil {
			t.Fatalf("create: %v", m.err)
		}
		id := m.sb.ID
		t.Cleanup(func() {
			if op, err := e.client.DeleteSandbox(context.Background(), id, true); err == nil {
				e.client.WaitOperation(context.Background(), op.ID)
			}
		})
		if m.sb.Runtime == "native" {
			nat = m.sb.ID
		} else {
			slp = m.sb.ID
		}
	}
	t.Logf("native %s, %s %s", nat, sleeper, slp)
	churn := makeChurn(t, e, ctx, sleeper, tag)
	// Before the rules: a victim in /etc and a file to move. (Registered
	// after the sandboxes' cleanups, the rules go first.)
	if out, code := sh(t, e, nat, "mkdir -p /tmp/fd /etc/fd-secret && echo victim > /etc/fd-victim && echo src > /tmp/fd/src && echo s > /etc/fd-secret/s"); code != 0 {
		t.Fatalf("setup: %d %s", code, out)
	}
	for _, id := range []string{nat, slp} {
		scope := "sandbox:" + id
		t.Cleanup(func() { e.client.DeletePolicyRuleSet(context.Background(), scope) })
		if _, err := e.client.SetPolicyRuleSet(ctx, scope, api.PolicyRuleSet{Rules: append(append([]api.PolicyRule{}, fdRules...), fdMoreRules...)}); err != nil {
			t.Fatal(err)
		}
	}
	// With the rules: a symlink into /etc where they allow writing (the
	// link itself is a write of /tmp/l).
	if err := e.client.UploadTar(ctx, nat, "/tmp", fdTar(t, fdEntry{name: "l", link: "/etc", typ: tar.TypeSymlink})); err != nil {
		t.Fatalf("uploading the symlink /tmp/l -> /etc: %v", err)
	}

	js := startFrontDoorJS(t, e, node)
	fd := &frontDoor{e: e, js: js, cursor: map[string]uint64{}, labels: map[string]string{nat: "native-" + tag, slp: sleeper + "-" + tag}}
	for _, id := range []string{nat, slp} {
		fd.cursor[id] = fd.lastPolicySeq(t, id)
	}

	t.Logf("set up in %v", time.Since(start).Round(time.Millisecond))
	defer func() { t.Logf("set up and rows in %v", time.Since(start).Round(time.Millisecond)) }()

	var rows []fdRow
	rows = append(rows, fd.restRows(nat, slp)...)
	rows = append(rows, fd.mcpRows(nat, slp)...)
	rows = append(rows, fd.e2bRows(nat, slp)...)
	rows = append(rows, fd.routeRows(nat, churn)...)
	// The deletes last: a delete that got through would leave the rest
	// nothing to act on.
	rows = append(rows, fd.deleteRows(nat)...)
	checkRouteCoverage(t, rows)
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) { fd.check(t, r) })
	}
}

type frontDoor struct {
	e      *env
	js     *frontDoorJS
	cursor map[string]uint64 // per sandbox: the last policy record seen
	labels map[string]string // per sandbox: its frontdoor label
}

// etcSpellings are the ways of writing "/etc/" before a file name that
// each door is tried with.
func etcSpellings() [][2]string {
	return [][2]string{
		{"clean", "/etc/"},
		{"dotdot", "/tmp/../etc/"},
		{"dslash", "//etc/"},
		{"dot", "/./etc/"},
		{"symlink", "/tmp/l/"}, // /tmp/l -> /etc
	}
}

func (fd *frontDoor) restRows(nat, slp string) []fdRow {
	c := fd.e.client
	ctx := context.Background()
	var rows []fdRow
	for _, v := range etcSpellings() {
		variant, p := v[0], v[1]
		wname := "fd-rest-write-" + variant
		rows = append(rows, fdRow{name: "rest/write/" + variant, want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + wname,
			do: func(t *testing.T) fdOutcome {
				_, err := c.WriteFile(ctx, nat, p+wname, strings.NewReader("x"), 0o644)
				return restOutcome(err)
			},
			after: fd.absent(nat, "/etc/"+wname)})
		mname := "fd-rest-mkdir-" + variant
		rows = append(rows, fdRow{name: "rest/mkdir/" + variant, want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + mname,
			do: func(t *testing.T) fdOutcome {
				_, err := c.Mkdir(ctx, nat, p+mname, 0o755)
				return restOutcome(err)
			},
			after: fd.absent(nat, "/etc/"+mname)})
		rname := "fd-rest-rename-" + variant
		rows = append(rows, fdRow{name: "rest/rename-into/" + variant, want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + rname,
			do:    func(t *testing.T) fdOutcome { return restOutcome(c.Rename(ctx, nat, "/tmp/fd/src", p+rname)) },
			after: fd.all(fd.absent(nat, "/etc/"+rname), fd.present(nat, "/tmp/fd/src", "src\n"))})
		rows = append(rows, fdRow{name: "rest/delete/" + variant, want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.delete of /etc/fd-victim",
			do:    func(t *testing.T) fdOutcome { return restOutcome(c.RemoveFile(ctx, nat, p+"fd-victim", false)) },
			after: fd.present(nat, "/etc/fd-victim", "victim\n")})
	}
	rows = append(rows,
		fdRow{name: "rest/rename-out", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.delete of /etc/fd-victim",
			do: func(t *testing.T) fdOutcome {
				return restOutcome(c.Rename(ctx, nat, "/tmp/../etc/fd-victim", "/tmp/fd/stolen"))
			},
			after: fd.all(fd.present(nat, "/etc/fd-victim", "victim\n"), fd.absent(nat, "/tmp/fd/stolen"))},
		fdRow{name: "rest/tar/at-root", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/fd-rest-tar",
			do: func(t *testing.T) fdOutcome {
				return restOutcome(c.UploadTar(ctx, nat, "/", fdTar(t, fdEntry{name: "tmp/fd-rest-tar-first", data: "a"}, fdEntry{name: "etc/fd-rest-tar", data: "x"})))
			},
			// One refused entry refuses the whole upload.
			after: fd.all(fd.absent(nat, "/etc/fd-rest-tar"), fd.absent(nat, "/tmp/fd-rest-tar-first"))},
		fdRow{name: "rest/tar/hardlink", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/fd-victim",
			do: func(t *testing.T) fdOutcome {
				return restOutcome(c.UploadTar(ctx, nat, "/", fdTar(t, fdEntry{name: "tmp/fd-rest-hardlink", link: "etc/fd-victim", typ: tar.TypeLink})))
			},
			after: fd.absent(nat, "/tmp/fd-rest-hardlink")},
		fdRow{name: "rest/tar/into-symlink", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc",
			do: func(t *testing.T) fdOutcome {
				return restOutcome(c.UploadTar(ctx, nat, "/tmp/l", fdTar(t, fdEntry{name: "fd-rest-tar-sym", data: "x"})))
			},
			after: fd.absent(nat, "/etc/fd-rest-tar-sym")},
		// A symlink and an entry through it in one archive: the link is a
		// write of /tmp (allowed), the entry's path is clean; the agent
		// refuses the symlink on its way.
		fdRow{name: "rest/tar/planted-symlink", want: fdContained, sb: nat,
			do: func(t *testing.T) fdOutcome {
				return restOutcome(c.UploadTar(ctx, nat, "/tmp", fdTar(t,
					fdEntry{name: "fd-l2", link: "/etc", typ: tar.TypeSymlink}, fdEntry{name: "fd-l2/fd-rest-tar-plant", data: "x"})))
			},
			after: fd.absent(nat, "/etc/fd-rest-tar-plant")},
		fdRow{name: "rest/exec/argv", want: fdDeny, sb: nat, deny: fdTouchReason, audit: "exec of touch",
			do: func(t *testing.T) fdOutcome {
				_, err := c.Exec(ctx, nat, api.ExecRequest{Cmd: []string{"touch", "/tmp/fd-exec-rest"}})
				return restOutcome(err)
			},
			after: fd.absent(nat, "/tmp/fd-exec-rest")},
		fdRow{name: "rest/exec/shell", want: fdDeny, sb: nat, deny: fdTouchReason, audit: "exec of sh",
			do: func(t *testing.T) fdOutcome {
				_, err := c.Exec(ctx, nat, api.ExecRequest{Cmd: []string{"sh", "-c", "touch /tmp/fd-exec-rest-sh"}})
				return restOutcome(err)
			},
			after: fd.absent(nat, "/tmp/fd-exec-rest-sh")},
		fdRow{name: "rest/pause", want: fdDeny, sb: nat, deny: fdAwakeReason, audit: "lifecycle pause",
			do: func(t *testing.T) fdOutcome {
				_, err := c.Pause(ctx, nat)
				return restOutcome(err)
			},
			after: fd.running(nat)},
		fdRow{name: "rest/suspend", want: fdDeny, sb: slp, deny: fdAwakeReason, audit: "lifecycle suspend",
			do: func(t *testing.T) fdOutcome {
				_, err := c.Suspend(ctx, slp)
				return restOutcome(err)
			},
			after: fd.running(slp)},
		fdRow{name: "rest/fork", want: fdDeny, sb: slp, deny: fdForkReason, audit: "lifecycle fork",
			do: func(t *testing.T) fdOutcome {
				_, err := c.Fork(ctx, slp, api.ForkRequest{Count: 1})
				return restOutcome(err)
			},
			after: fd.noFork(slp)},
		fdRow{name: "rest/allow/write-tmp", want: fdAllow, sb: nat,
			do: func(t *testing.T) fdOutcome {
				_, err := c.WriteFile(ctx, nat, "/tmp/fd-allow-rest", strings.NewReader("rest"), 0o644)
				return restOutcome(err)
			},
			after: fd.present(nat, "/tmp/fd-allow-rest", "rest")},
	)
	return rows
}

func (fd *frontDoor) mcpRows(nat, slp string) []fdRow {
	tool := func(name string, args map[string]any) func(t *testing.T) fdOutcome {
		return func(t *testing.T) fdOutcome {
			return fd.js.call(t, map[string]any{"door": "mcp", "op": "tool", "tool": name, "arguments": args})
		}
	}
	var rows []fdRow
	for _, v := range etcSpellings() {
		name := "fd-mcp-write-" + v[0]
		rows = append(rows, fdRow{name: "mcp/file_write/" + v[0], want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + name,
			do:    tool("file_write", map[string]any{"id": nat, "path": v[1] + name, "content": "x"}),
			after: fd.absent(nat, "/etc/"+name)})
	}
	return append(rows,
		fdRow{name: "mcp/command_run", want: fdDeny, sb: nat, deny: fdTouchReason, audit: "exec of /bin/sh",
			do:    tool("command_run", map[string]any{"id": nat, "cmd": "touch /tmp/fd-exec-mcp"}),
			after: fd.absent(nat, "/tmp/fd-exec-mcp")},
		fdRow{name: "mcp/sandbox_suspend", want: fdDeny, sb: slp, deny: fdAwakeReason, audit: "lifecycle suspend",
			do: tool("sandbox_suspend", map[string]any{"id": slp}), after: fd.running(slp)},
		fdRow{name: "mcp/sandbox_fork", want: fdDeny, sb: slp, deny: fdForkReason, audit: "lifecycle fork",
			do: tool("sandbox_fork", map[string]any{"id": slp, "count": 1}), after: fd.noFork(slp)},
		fdRow{name: "mcp/allow/file_write-tmp", want: fdAllow, sb: nat,
			do:    tool("file_write", map[string]any{"id": nat, "path": "/tmp/fd-allow-mcp", "content": "mcp"}),
			after: fd.present(nat, "/tmp/fd-allow-mcp", "mcp")},
	)
}

func (fd *frontDoor) e2bRows(nat, slp string) []fdRow {
	op := func(name string, args map[string]any) func(t *testing.T) fdOutcome {
		return func(t *testing.T) fdOutcome {
			req := map[string]any{"door": "e2b", "op": name}
			for k, v := range args {
				req[k] = v
			}
			return fd.js.call(t, req)
		}
	}
	// E2B's own spellings on top: relative to the user's home (root's,
	// /root) and through ~.
	spellings := append(etcSpellings(), [2]string{"relative", "../etc/"}, [2]string{"tilde", "~/../etc/"})
	var rows []fdRow
	for _, v := range spellings {
		name := "fd-e2b-write-" + v[0]
		rows = append(rows, fdRow{name: "e2b/files.write/" + v[0], want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + name,
			do:    op("write", map[string]any{"sandbox": nat, "path": v[1] + name, "data": "x"}),
			after: fd.absent(nat, "/etc/"+name)})
	}
	for _, v := range etcSpellings()[1:] {
		name := "fd-e2b-mkdir-" + v[0]
		rows = append(rows, fdRow{name: "e2b/files.makeDir/" + v[0], want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + name,
			do:    op("makeDir", map[string]any{"sandbox": nat, "path": v[1] + name}),
			after: fd.absent(nat, "/etc/"+name)})
	}
	for _, v := range [][2]string{etcSpellings()[0], etcSpellings()[4]} {
		name := "fd-e2b-rename-" + v[0]
		rows = append(rows, fdRow{name: "e2b/files.rename-into/" + v[0], want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/" + name,
			do:    op("rename", map[string]any{"sandbox": nat, "from": "/tmp/fd/src", "to": v[1] + name}),
			after: fd.all(fd.absent(nat, "/etc/"+name), fd.present(nat, "/tmp/fd/src", "src\n"))})
	}
	for _, v := range [][2]string{etcSpellings()[0], etcSpellings()[1], etcSpellings()[4]} {
		rows = append(rows, fdRow{name: "e2b/files.remove/" + v[0], want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.delete of /etc/fd-victim",
			do:    op("remove", map[string]any{"sandbox": nat, "path": v[1] + "fd-victim"}),
			after: fd.present(nat, "/etc/fd-victim", "victim\n")})
	}
	return append(rows,
		fdRow{name: "e2b/files.write/multiple", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/fd-e2b-many",
			do: op("writeMany", map[string]any{"sandbox": nat, "files": []map[string]string{
				{"path": "/etc/fd-e2b-many", "data": "x"}, {"path": "/tmp/fd-e2b-many-after", "data": "y"}}}),
			after: fd.all(fd.absent(nat, "/etc/fd-e2b-many"), fd.absent(nat, "/tmp/fd-e2b-many-after"))},
		// Each part of a multi-file write is decided as it comes: a part
		// before the refused one is written (as envd writes them in turn).
		fdRow{name: "e2b/files.write/multiple-allowed-first", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/fd-e2b-many2",
			do: op("writeMany", map[string]any{"sandbox": nat, "files": []map[string]string{
				{"path": "/tmp/fd-e2b-many2-before", "data": "y"}, {"path": "/tmp/../etc/fd-e2b-many2", "data": "x"}}}),
			after: fd.all(fd.absent(nat, "/etc/fd-e2b-many2"), fd.note(nat, "/tmp/fd-e2b-many2-before"))},
		fdRow{name: "e2b/uploadUrl/clean", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/fd-e2b-url",
			do: op("uploadUrl", map[string]any{"sandbox": nat, "path": "/etc/fd-e2b-url", "data": "x"}), after: fd.absent(nat, "/etc/fd-e2b-url")},
		fdRow{name: "e2b/uploadUrl/symlink", want: fdDeny, sb: nat, deny: fdEtcReason, audit: "file.write of /etc/fd-e2b-url-sym",
			do: op("uploadUrl", map[string]any{"sandbox": nat, "path": "/tmp/l/fd-e2b-url-sym", "data": "x"}), after: fd.absent(nat, "/etc/fd-e2b-url-sym")},
		fdRow{name: "e2b/commands.run", want: fdDeny, sb: nat, deny: fdTouchReason, audit: "exec of /bin/bash",
			do: op("run", map[string]any{"sandbox": nat, "cmd": "touch /tmp/fd-exec-e2b"}), after: fd.absent(nat, "/tmp/fd-exec-e2b")},
		// Native cannot suspend: E2B's pause falls back to pause, decided too.
		fdRow{name: "e2b/pause/native", want: fdDeny, sb: nat, deny: fdAwakeReason, audit: "lifecycle pause",
			do: op("pause", map[string]any{"sandbox": nat}), after: fd.running(nat)},
		fdRow{name: "e2b/pause/suspend", want: fdDeny, sb: slp, deny: fdAwakeReason, audit: "lifecycle suspend",
			do: op("pause", map[string]any{"sandbox": slp}), after: fd.running(slp)},
		fdRow{name: "e2b/fork", want: fdDeny, sb: slp, deny: fdForkReason, audit: "lifecycle fork",
			do: op("fork", map[string]any{"sandbox": slp}), after: fd.noFork(slp)},
		fdRow{name: "e2b/allow/files.write-tmp", want: fdAllow, sb: nat,
			do: op("write", map[string]any{"sandbox": nat, "path": "/tmp/fd-allow-e2b", "data": "e2b"}), after: fd.present(nat, "/tmp/fd-allow-e2b", "e2b")},
	)
}

func (fd *frontDoor) deleteRows(nat string) []fdRow {
	return []fdRow{
		{name: "rest/delete-sandbox", want: fdDeny, sb: nat, deny: fdKeepReason, audit: "lifecycle delete",
			do: func(t *testing.T) fdOutcome {
				_, err := fd.e.client.DeleteSandbox(context.Background(), nat, true)
				return restOutcome(err)
			},
			after: fd.running(nat)},
		{name: "mcp/sandbox_delete", want: fdDeny, sb: nat, deny: fdKeepReason, audit: "lifecycle delete",
			do: func(t *testing.T) fdOutcome {
				return fd.js.call(t, map[string]any{"door": "mcp", "op": "tool", "tool": "sandbox_delete", "arguments": map[string]any{"id": nat}})
			},
			after: fd.running(nat)},
		{name: "e2b/Sandbox.kill", want: fdDeny, sb: nat, deny: fdKeepReason, audit: "lifecycle delete",
			do: func(t *testing.T) fdOutcome {
				return fd.js.call(t, map[string]any{"door": "e2b", "op": "kill", "sandbox": nat})
			},
			after: fd.running(nat)},
	}
}

// check runs one row and checks the outcome, the audit log and the
// sandbox afterwards.
func (fd *frontDoor) check(t *testing.T, r fdRow) {
	o := r.do(t)
	t.Logf("%s: %s", r.name, o)
	mcpDoor := strings.HasPrefix(r.name, "mcp/")
	switch r.want {
	case fdAllow:
		if !o.OK {
			t.Errorf("refused: %s", o)
		}
	case fdDeny:
		switch {
		case o.OK:
			t.Errorf("allowed, want a refusal naming %q", r.deny)
		case mcpDoor && !strings.Contains(o.Message, "policy_denied"):
			t.Errorf("tool error %q does not say policy_denied", o.Message)
		case !mcpDoor && o.Status != 403:
			t.Errorf("status %d, want 403: %s", o.Status, o)
		case !strings.Contains(o.Message, r.deny):
			t.Errorf("refusal %q does not name the rule's reason %q", o.Message, r.deny)
		}
	case fdContained:
		if o.OK {
			t.Errorf("allowed, want a refusal")
		}
	}
	fd.checkAudit(t, r)
	if r.after != nil {
		r.after(t)
	}
}

// checkAudit finds the row's denial among the policy records written since
// the last row on its sandbox (none for a row that must not be denied).
func (fd *frontDoor) checkAudit(t *testing.T, r fdRow) {
	t.Helper()
	var seen []string
	// The log is written in order: once other records of the row are in,
	// its denial is not far behind, or not coming.
	deadline := time.Now().Add(5 * time.Second)
	graced := false
	for {
		recs, err := fd.e.client.AuditRecords(ctxT(t, time.Minute), sdk.AuditFilter{Sandbox: r.sb, Kind: "policy", After: fd.cursor[r.sb], Limit: 1000})
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, rec := range recs {
			fd.cursor[r.sb] = max(fd.cursor[r.sb], rec.Seq)
			seen = append(seen, fmt.Sprintf("%s %q %q", rec.Action, rec.Target, rec.Result))
			if r.want == fdDeny && rec.Action == "deny" && rec.Target == r.audit && rec.Result == r.deny {
				found = true
			}
		}
		switch {
		case r.want != fdDeny:
			for _, s := range seen {
				if strings.HasPrefix(s, "deny ") {
					t.Errorf("the audit log holds a denial for a row the rules allow: %s", s)
				}
			}
			return
		case found:
			return
		case time.Now().After(deadline):
			t.Errorf("no audit record deny %q %q; policy records since the last row: %v", r.audit, r.deny, seen)
			return
		case len(seen) > 0 && !graced:
			graced = true
			if soon := time.Now().Add(time.Second); soon.Before(deadline) {
				deadline = soon
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (fd *frontDoor) lastPolicySeq(t *testing.T, id string) uint64 {
	recs, err := fd.e.client.AuditRecords(ctxT(t, time.Minute), sdk.AuditFilter{Sandbox: id, Kind: "policy", Limit: 10000})
	if err != nil {
		t.Fatal(err)
	}
	var last uint64
	for _, r := range recs {
		last = max(last, r.Seq)
	}
	return last
}

func (fd *frontDoor) all(fs ...func(t *testing.T)) func(t *testing.T) {
	return func(t *testing.T) {
		for _, f := range fs {
			f(t)
		}
	}
}

// absent: nothing at p.
func (fd *frontDoor) absent(id, p string) func(t *testing.T) {
	return func(t *testing.T) {
		t.Helper()
		fi, err := fd.e.client.StatFile(ctxT(t, time.Minute), id, p)
		if !errors.Is(err, sdk.ErrNotFound) {
			t.Errorf("%s: want nothing there, got %+v %v", p, fi, err)
		}
	}
}

// note logs whether p exists (what a refused request left behind that
// the rules allowed).
func (fd *frontDoor) note(id, p string) func(t *testing.T) {
	return func(t *testing.T) {
		_, err := fd.e.client.StatFile(ctxT(t, time.Minute), id, p)
		t.Logf("%s after the refusal: exists %v (%v)", p, err == nil, err)
	}
}

// present: p holds content.
func (fd *frontDoor) present(id, p, content string) func(t *testing.T) {
	return func(t *testing.T) {
		t.Helper()
		rc, err := fd.e.client.ReadFile(ctxT(t, time.Minute), id, p)
		if err != nil {
			t.Errorf("%s: %v", p, err)
			return
		}
		b, _ := io.ReadAll(rc)
		rc.Close()
		if string(b) != content {
			t.Errorf("%s holds %q, want %q", p, b, content)
		}
	}
}

// running: the sandbox is still there and running.
func (fd *frontDoor) running(id string) func(t *testing.T) {
	return func(t *testing.T) {
		t.Helper()
		sb, err := fd.e.client.GetSandbox(ctxT(t, time.Minute), id)
		if err != nil || sb.State != api.StateRunning {
			t.Errorf("sandbox %s after the row: %+v %v", id, sb, err)
		}
	}
}

// noFork: the sandbox has no children (they would carry its label); any
// found are deleted.
func (fd *frontDoor) noFork(id string) func(t *testing.T) {
	return func(t *testing.T) {
		t.Helper()
		ctx := ctxT(t, time.Minute)
		sbs, err := fd.e.client.ListSandboxes(ctx, sdk.ListOptions{Labels: map[string]string{"frontdoor": fd.labels[id]}})
		if err != nil {
			t.Fatal(err)
		}
		for _, sb := range sbs {
			if sb.ID != id {
				t.Errorf("a fork of %s exists: %s", id, sb.ID)
				if op, err := fd.e.client.DeleteSandbox(ctx, sb.ID, true); err == nil {
					fd.e.client.WaitOperation(ctx, op.ID)
				}
			}
		}
	}
}

type fdEntry struct {
	name, data, link string
	typ              byte
}

func fdTar(t *testing.T, entries ...fdEntry) io.Reader {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, en := range entries {
		h := &tar.Header{Name: en.name, Mode: 0o644, Typeflag: en.typ, Linkname: en.link, Size: int64(len(en.data))}
		if en.typ == 0 {
			h.Typeflag = tar.TypeReg
		} else {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if en.data != "" && h.Size > 0 {
			tw.Write([]byte(en.data))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return &buf
}

// frontDoorJS is e2e/js/frontdoor.mjs under node: the real E2B and MCP
// clients, one call per request.
type frontDoorJS struct {
	in    io.WriteCloser
	lines chan string
	n     int
}

func startFrontDoorJS(t *testing.T, e *env, node string) *frontDoorJS {
	t.Helper()
	cmd := exec.Command(node, "frontdoor.mjs")
	cmd.Dir = "js"
	cmd.Env = append(os.Environ(),
		"SPACE_URL="+e.url,
		"SPACE_API_KEY="+e.key,
		"E2B_API_URL="+e.url+"/e2b",
		"E2B_SANDBOX_URL="+e.url+"/e2b/envd",
		"E2B_API_KEY="+e.key,
		"E2B_DOMAIN=localhost:"+strconv.Itoa(e.apiPort),
	)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &frontDoorJS{in: in, lines: make(chan string)}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			d.lines <- sc.Text()
		}
		close(d.lines)
	}()
	t.Cleanup(func() {
		in.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("frontdoor.mjs: %v\n%s", err, stderr.String())
			}
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			t.Errorf("frontdoor.mjs did not exit\n%s", stderr.String())
		}
	})
	return d
}

func (d *frontDoorJS) call(t *testing.T, req map[string]any) fdOutcome {
	t.Helper()
	d.n++
	req["id"] = d.n
	b, _ := json.Marshal(req)
	if _, err := d.in.Write(append(b, '\n')); err != nil {
		t.Fatalf("writing to frontdoor.mjs: %v", err)
	}
	select {
	case l, ok := <-d.lines:
		if !ok {
			t.Fatal("frontdoor.mjs exited")
		}
		var o struct {
			ID int `json:"id"`
			fdOutcome
		}
		if err := json.Unmarshal([]byte(l), &o); err != nil || o.ID != d.n {
			t.Fatalf("frontdoor.mjs answered %q to request %d", l, d.n)
		}
		return o.fdOutcome
	case <-time.After(3 * time.Minute):
		t.Fatalf("frontdoor.mjs: no answer to %s", b)
	}
	return fdOutcome{}
}
