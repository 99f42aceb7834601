package sandbox

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// derive makes a template with defaults cfg from parent, without building.
func derive(t *testing.T, ts *template.Store, parent, tag string, cfg api.TemplateConfig) {
	t.Helper()
	if _, err := ts.Derive(context.Background(), parent, template.DeriveOptions{Config: cfg, Tags: []string{tag}}); err != nil {
		t.Fatalf("derive %s: %v", tag, err)
	}
}

// createFails runs a create that must fail and returns its operation and
// the sandbox it left, after checking the failure is recorded on both.
func createFails(t *testing.T, m *Manager, req api.CreateSandboxRequest) (api.Operation, api.Sandbox, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	sb, op, err := m.creates.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	op, err = m.verbs.Wait(ctx, op.ID)
	took := time.Since(t0)
	if err != nil || op.State != api.OpFailed || op.Error == nil {
		t.Fatalf("create should fail: %v %+v", err, op)
	}
	t.Logf("create failed after %s (phases %+v): %s: %s", took.Round(time.Millisecond), op.Phases, op.Error.Code, op.Error.Message)
	sb, err = m.Get(ctx, sb.ID)
	if err != nil || sb.State != api.StateError || sb.Error != op.Error.Message {
		t.Fatalf("sandbox after a failed create: %v %+v (op error %q)", err, sb, op.Error.Message)
	}
	return op, sb, took
}

func wantAll(t *testing.T, what, s string, parts ...string) {
	t.Helper()
	for _, p := range parts {
		if !strings.Contains(s, p) {
			t.Errorf("%s does not contain %q:\n%s", what, p, s)
		}
	}
}

// readyWait is how long the create's ready phase took.
func readyWait(t *testing.T, op api.Operation) time.Duration {
	t.Helper()
	for _, p := range op.Phases {
		if p.Name == "ready" {
			return time.Duration(p.DurationMS * float64(time.Millisecond))
		}
	}
	t.Fatalf("no ready phase in %+v", op.Phases)
	return 0
}

func phaseNames(op api.Operation) string {
	var names []string
	for _, p := range op.Phases {
		names = append(names, p.Name)
	}
	return strings.Join(names, ",")
}

func TestPlanStartGuardsTemplateConfig(t *testing.T) {
	bad := []*api.StartCommand{
		{},
		{Cmd: []string{""}},
		{Cmd: []string{"a\x00b"}},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyTimeoutSeconds: 601},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyTimeoutSeconds: -1},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyTimeoutSeconds: math.NaN()},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyTimeoutSeconds: math.Inf(1)},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyIntervalMS: -5},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyIntervalMS: 3_600_000},
		{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyIntervalMS: math.MaxInt64},
		{Cmd: []string{"srv"}, Ready: []string{""}},
	}
	for _, st := range bad {
		if _, err := planStart(st); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("planStart(%+v): want invalid argument, got %v", st, err)
		}
	}
	p, err := planStart(&api.StartCommand{Cmd: []string{"srv"}, Ready: []string{"check"}})
	if err != nil || p.timeout != 60*time.Second || p.interval != 100*time.Millisecond {
		t.Fatalf("defaults: %v %+v", err, p)
	}
	p, err = planStart(&api.StartCommand{Cmd: []string{"srv"}, Ready: []string{"check"}, ReadyTimeoutSeconds: 0.5, ReadyIntervalMS: 1})
	if err != nil || p.timeout != 500*time.Millisecond || p.interval != minReadyInterval {
		t.Fatalf("explicit: %v %+v", err, p)
	}
	if p, err := planStart(nil); p != nil || err != nil {
		t.Fatalf("nil start: %v %+v", err, p)
	}
}

func TestApplyTemplateDefaults(t *testing.T) {
	sb := api.Sandbox{Env: map[string]string{"B": "req"}, User: "1000"}
	tc := api.TemplateConfig{Env: map[string]string{"A": "tmpl", "B": "tmpl"}, Workdir: "/srv", User: "nobody"}
	for range 2 { // a re-driven create applies them again
		if err := applyTemplateDefaults(&sb, tc); err != nil {
			t.Fatal(err)
		}
		if sb.Env["A"] != "tmpl" || sb.Env["B"] != "req" || len(sb.Env) != 2 || sb.Workdir != "/srv" || sb.User != "1000" {
			t.Fatalf("%+v", sb)
		}
	}
	big := map[string]string{}
	for i := range maxEnv {
		big["T"+strings.Repeat("x", i%7)+string(rune('a'+i%26))+strings.Repeat("y", i/26)] = "1"
	}
	sb = api.Sandbox{Env: map[string]string{"EXTRA": "1"}}
	if err := applyTemplateDefaults(&sb, api.TemplateConfig{Env: big}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("merged env over the limit: %v", err)
	}
	for _, tc := range []api.TemplateConfig{{Workdir: "rel"}, {User: "Bad User"}, {User: "0:0:0"}} {
		sb := api.Sandbox{}
		if err := applyTemplateDefaults(&sb, tc); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%+v: %v", tc, err)
		}
	}
}

func TestQuoteTailIsBoundedAndClean(t *testing.T) {
	long := strings.Repeat("é", 3000) + "\x1b[31mEND\x00\n"
	q := quoteTail(long)
	if len(q) > failureTailBytes+2*1024 || !strings.HasSuffix(q, `END\n"`) || strings.Contains(q, "\\x1b") || strings.Contains(q, "\\x00") {
		t.Fatalf("quoteTail: %d bytes: %s", len(q), q[len(q)-40:])
	}
	if quoteTail(" \n") != "(none)" {
		t.Fatal(quoteTail(" \n"))
	}
	buf := appendTail(nil, []byte("hello "), 8)
	buf = appendTail(buf, []byte("world"), 8)
	if string(buf) != "lo world" {
		t.Fatalf("appendTail: %q", buf)
	}
	if buf = appendTail(buf, []byte("0123456789"), 8); string(buf) != "23456789" {
		t.Fatalf("appendTail: %q", buf)
	}
}

// worldDir is a host directory every uid can write (the fake runtime runs
// processes on the host).
func worldDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "sb-defaults-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(d, 0o777)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func waitFile(t *testing.T, path string) string {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if b, err := os.ReadFile(path); err == nil && strings.HasSuffix(string(b), "\n") {
			return string(b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared", path)
		}
	}
}

func TestTemplateDefaultsApplyToExecAndCommands(t *testing.T) {
	h := newHarness(t)
	derive(t, h.tmpl, "tiny:latest", "dflt:1", api.TemplateConfig{
		Env: map[string]string{"A": "tmpl", "B": "tmpl"}, Workdir: "/usr", User: "65534:65534",
	})
	sb := h.create(api.CreateSandboxRequest{Template: "dflt:1", Env: map[string]string{"B": "req"}})
	if sb.Env["A"] != "tmpl" || sb.Env["B"] != "req" || sb.Workdir != "/usr" || sb.User != "65534:65534" {
		t.Fatalf("sandbox record: %+v", sb)
	}
	script := []string{"sh", "-c", "echo $A $B $C; pwd; id -u; id -g"}
	res, err := h.m.cmds.Exec(h.ctx(), sb.ID, api.ExecRequest{Cmd: script, Env: map[string]string{"C": "exec"}})
	if err != nil || res.Stdout != "tmpl req exec\n/usr\n65534\n65534\n" {
		t.Fatalf("exec with defaults: %v %+v", err, res)
	}
	res, err = h.m.cmds.Exec(h.ctx(), sb.ID, api.ExecRequest{Cmd: script, User: "0", Workdir: "/etc", Env: map[string]string{"A": "exec"}})
	if err != nil || res.Stdout != "exec req\n/etc\n0\n0\n" {
		t.Fatalf("exec overriding the defaults: %v %+v", err, res)
	}
	// A command session follows the same defaults.
	out := filepath.Join(worldDir(t), "cmd")
	cmd, err := h.m.cmds.CreateCommand(h.ctx(), sb.ID, api.CreateCommandRequest{Detached: true,
		ExecRequest: api.ExecRequest{Cmd: []string{"sh", "-c", "{ echo $A; pwd; id -u; } > " + out + ".tmp && mv " + out + ".tmp " + out}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := waitFile(t, out); got != "tmpl\n/usr\n65534\n" {
		t.Fatalf("command %s with defaults wrote %q", cmd.ID, got)
	}

	// The request's workdir and user win over the template's.
	sb2 := h.create(api.CreateSandboxRequest{Template: "dflt:1", Workdir: "/var", User: "1234"})
	res, err = h.m.cmds.Exec(h.ctx(), sb2.ID, api.ExecRequest{Cmd: script})
	if err != nil || res.Stdout != "tmpl tmpl\n/var\n1234\n1234\n" {
		t.Fatalf("exec in a sandbox with request defaults: %v %+v", err, res)
	}
	if _, _, err := h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{User: "not a user"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad request user: %v", err)
	}
}

func TestStartCommandFailuresOnFake(t *testing.T) {
	h := newHarness(t)
	fakeLeft := func(id string) {
		t.Helper()
		if _, err := os.Stat(filepath.Join(h.dir, "fake", id)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("instance of %s left behind: %v", id, err)
		}
	}

	// Exits 3 at once: fails long before the 30 s timeout, naming the code.
	derive(t, h.tmpl, "tiny:latest", "exit3:1", api.TemplateConfig{Start: &api.StartCommand{
		Cmd: []string{"sh", "-c", "echo boom >&2; exit 3"}, Ready: []string{"false"}, ReadyTimeoutSeconds: 30}})
	op, sb, _ := createFails(t, h.m, api.CreateSandboxRequest{Template: "exit3:1"})
	// Far below the 30 s timeout, with room for a loaded 2-core CI host.
	if d := readyWait(t, op); d > 10*time.Second {
		t.Errorf("a start command that exits at once took %s to fail the ready wait", d)
	}
	wantAll(t, "error", op.Error.Message, "exit code 3", `"boom\n"`)
	if op.Error.Code != "unprocessable" {
		t.Errorf("code %s", op.Error.Code)
	}
	fakeLeft(sb.ID)
	cmds, err := h.m.cmds.ListCommands(h.ctx(), sb.ID)
	if err != nil || len(cmds) != 1 || !strings.HasPrefix(cmds[0].ID, StartCommandIDPrefix) || cmds[0].State != api.CommandExited || cmds[0].Exit.ExitCode != 3 {
		t.Fatalf("start command record: %v %+v", err, cmds)
	}

	// Never ready: fails at the timeout with the check's and the command's output.
	derive(t, h.tmpl, "tiny:latest", "never:1", api.TemplateConfig{Start: &api.StartCommand{
		Cmd: []string{"sh", "-c", "echo starting; exec sleep 3"}, Ready: []string{"sh", "-c", "echo not yet; exit 1"},
		ReadyTimeoutSeconds: 1, ReadyIntervalMS: 50}})
	op, sb, _ = createFails(t, h.m, api.CreateSandboxRequest{Template: "never:1"})
	if d := readyWait(t, op); d < time.Second || d > 15*time.Second {
		t.Errorf("a 1 s ready timeout failed after %s", d)
	}
	wantAll(t, "error", op.Error.Message, "did not pass within 1s", "exit code 1", `"not yet\n"`, `"starting\n"`)
	if op.Error.Code != "timeout" || !strings.Contains(phaseNames(op), "start_command,ready") {
		t.Errorf("op %+v", op)
	}
	fakeLeft(sb.ID)

	// A build step's sandbox does not run its template's start command.
	step := h.create(api.CreateSandboxRequest{Template: "exit3:1", Labels: map[string]string{BuildLabel: BuildLabelStep}})
	if cmds, err := h.m.cmds.ListCommands(h.ctx(), step.ID); err != nil || len(cmds) != 0 {
		t.Fatalf("build step sandbox ran the start command: %v %+v", err, cmds)
	}

	// A start command that exits 0 (it started a daemon) is waited for.
	flag := filepath.Join(worldDir(t), "ready")
	derive(t, h.tmpl, "tiny:latest", "daemon:1", api.TemplateConfig{Start: &api.StartCommand{
		Cmd: []string{"sh", "-c", "(sleep 0.3; touch " + flag + ") >/dev/null 2>&1 & exit 0"}, Ready: []string{"test", "-f", flag}}})
	h.create(api.CreateSandboxRequest{Template: "daemon:1"})
	if _, err := os.Stat(flag); err != nil {
		t.Fatalf("create returned before the daemon was ready: %v", err)
	}
}

// nativeHarness is a manager over the real native runtime and a template
// store holding the Debian base.
type nativeHarness struct {
	m    *Manager
	tmpl *template.Store
	rt   runtime.Runtime
	db   *store.DB
}

func newNativeHarness(t *testing.T) *nativeHarness {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "sbn-") // short: native puts sockets below it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ts, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), testenv.CacheDir(), log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := ts.EnsureBase(ctx, nil); err != nil {
		t.Fatal(err)
	}
	rt, err := runtime.New(native.Name, runtime.Config{DataDir: filepath.Join(dir, "native"), AgentBinary: agent, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	if c := rt.Probe(ctx); !c.Available {
		testenv.Require(t, "native-runtime", false, c.Reason)
	}
	m := New(Config{DB: db, Templates: ts, Runtimes: map[string]runtime.Runtime{native.Name: rt}, Logger: log})
	t.Cleanup(func() {
		ctx := context.Background()
		sbs, _ := db.ListSandboxes(ctx, store.SandboxFilter{})
		for _, sb := range sbs {
			if op, err := m.verbs.Lifecycle(ctx, sb.ID, api.OpDelete, true); err == nil {
				m.verbs.Wait(ctx, op.ID)
			}
		}
		m.Close()
		if c, ok := rt.(io.Closer); ok {
			c.Close()
		}
		ts.Close()
		db.Close()
	})
	return &nativeHarness{m: m, tmpl: ts, rt: rt, db: db}
}

func (h *nativeHarness) exec(t *testing.T, id string, req api.ExecRequest) api.ExecResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := h.m.cmds.Exec(ctx, id, req)
	if err != nil {
		t.Fatalf("exec %q: %v", req.Cmd, err)
	}
	return res
}

func (h *nativeHarness) do(t *testing.T, id, verb string) api.Operation {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	op, err := h.m.verbs.Lifecycle(ctx, id, verb, false)
	if err == nil {
		op, err = h.m.verbs.Wait(ctx, op.ID)
	}
	if err != nil || op.State != api.OpSucceeded {
		t.Fatalf("%s: %v %+v", verb, err, op.Error)
	}
	return op
}

func (h *nativeHarness) create(t *testing.T, req api.CreateSandboxRequest) (api.Sandbox, api.Operation) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, op, err := h.m.creates.Create(ctx, req)
	if err == nil {
		op, err = h.m.verbs.Wait(ctx, op.ID)
	}
	if err != nil || op.State != api.OpSucceeded {
		t.Fatalf("create: %v %+v", err, op.Error)
	}
	return sb, op
}

// noInstanceLeft checks the runtime holds nothing of sandbox id.
func (h *nativeHarness) noInstanceLeft(t *testing.T, id string) {
	t.Helper()
	removed, err := h.rt.Sweep(context.Background(), func(x string) bool { return x != id })
	if err != nil || len(removed) != 0 {
		t.Errorf("host resources of %s left after its failed create: %v %v", id, removed, err)
	}
}

func startCommands(t *testing.T, m *Manager, id string) []api.Command {
	t.Helper()
	cmds, err := m.cmds.ListCommands(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var out []api.Command
	for _, c := range cmds {
		if strings.HasPrefix(c.ID, StartCommandIDPrefix) {
			out = append(out, c)
		}
	}
	return out
}

func TestTemplateDefaultsOnNative(t *testing.T) {
	h := newNativeHarness(t)
	const base = "base:latest"

	t.Run("env-workdir-user", func(t *testing.T) {
		derive(t, h.tmpl, base, "dflt:1", api.TemplateConfig{
			Env: map[string]string{"A": "tmpl", "B": "tmpl"}, Workdir: "/tmp", User: "nobody"})
		sb, _ := h.create(t, api.CreateSandboxRequest{Template: "dflt:1", Env: map[string]string{"B": "req"}})
		script := []string{"sh", "-c", "echo $A $B; pwd; id -un"}
		if res := h.exec(t, sb.ID, api.ExecRequest{Cmd: script}); res.Stdout != "tmpl req\n/tmp\nnobody\n" {
			t.Fatalf("defaults: %+v", res)
		}
		if res := h.exec(t, sb.ID, api.ExecRequest{Cmd: script, User: "root", Workdir: "/"}); res.Stdout != "tmpl req\n/\nroot\n" {
			t.Fatalf("overrides: %+v", res)
		}
		sb2, _ := h.create(t, api.CreateSandboxRequest{Template: "dflt:1", User: "0:0", Workdir: "/etc"})
		if res := h.exec(t, sb2.ID, api.ExecRequest{Cmd: script}); res.Stdout != "tmpl tmpl\n/etc\nroot\n" {
			t.Fatalf("request defaults: %+v", res)
		}
	})

	t.Run("start-and-ready", func(t *testing.T) {
		// The disk outlives a stop, /dev/shm does not: the ready marker
		// must not be found from the previous boot.
		start := []string{"sh", "-c", "echo run >> /var/tmp/runs; echo started; sleep 0.3; echo up > /dev/shm/ready; exec sleep 1000"}
		derive(t, h.tmpl, base, "srv:1", api.TemplateConfig{User: "nobody", Workdir: "/var/tmp",
			Start: &api.StartCommand{Cmd: start, Ready: []string{"test", "-f", "/dev/shm/ready"}}})
		t0 := time.Now()
		sb, op := h.create(t, api.CreateSandboxRequest{Template: "srv:1"})
		if took := time.Since(t0); took < 300*time.Millisecond {
			t.Errorf("create took %s, less than the start command needs", took)
		}
		if got := phaseNames(op); got != "resolve_template,prepare,start_runtime,agent_ready,start_command,ready" {
			t.Fatalf("phases %s", got)
		}
		if res := h.exec(t, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "cat /dev/shm/ready; stat -c %U /dev/shm/ready"}}); res.Stdout != "up\nnobody\n" {
			t.Fatalf("ready file right after create: %+v", res)
		}
		cmds := startCommands(t, h.m, sb.ID)
		if len(cmds) != 1 || cmds[0].State != api.CommandRunning || strings.Join(cmds[0].Cmd, " ") != strings.Join(start, " ") {
			t.Fatalf("start command not listed as running: %+v", cmds)
		}
		// Its output replays like any command's.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		rec, err := h.db.GetCommand(ctx, sb.ID, cmds[0].ID)
		if err != nil {
			t.Fatal(err)
		}
		a, err := h.m.cmds.Attach(ctx, rec, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		var out []byte
		for !strings.Contains(string(out), "started\n") {
			typ, data, err := a.Conn.Read(ctx)
			if err != nil {
				t.Fatalf("attach to the start command: %v (got %q)", err, out)
			}
			if typ == websocket.MessageBinary && len(data) > 0 && data[0] == api.FrameStdout {
				_, b, _ := api.DecodeOutput(data[1:])
				out = append(out, b...)
			}
		}
		a.Close()

		runs := func() string {
			return h.exec(t, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "wc -l < /var/tmp/runs; cat /dev/shm/ready"}}).Stdout
		}
		// A resume finds its processes where they were: no re-run.
		h.do(t, sb.ID, api.OpPause)
		if op := h.do(t, sb.ID, api.OpResume); strings.Contains(phaseNames(op), "start_command") {
			t.Fatalf("resume re-ran the start command: %s", phaseNames(op))
		}
		if got := runs(); got != "1\nup\n" {
			t.Fatalf("after resume: %q", got)
		}
		// A cold start runs it again and waits for ready again.
		h.do(t, sb.ID, api.OpStop)
		if op := h.do(t, sb.ID, api.OpStart); !strings.HasSuffix(phaseNames(op), "start_command,ready") {
			t.Fatalf("start phases: %s", phaseNames(op))
		}
		if got := runs(); got != "2\nup\n" {
			t.Fatalf("after stop+start: %q", got)
		}
		// So does a transparent wake from stopped.
		h.do(t, sb.ID, api.OpStop)
		if got := runs(); got != "3\nup\n" {
			t.Fatalf("after a wake from stopped: %q", got)
		}
		cmds = startCommands(t, h.m, sb.ID)
		running := 0
		for _, c := range cmds {
			if c.State == api.CommandRunning {
				running++
			}
		}
		if len(cmds) != 3 || running != 1 {
			t.Fatalf("start command sessions after three cold boots: %+v", cmds)
		}
	})

	t.Run("never-ready", func(t *testing.T) {
		derive(t, h.tmpl, base, "never:1", api.TemplateConfig{Start: &api.StartCommand{
			Cmd:   []string{"sh", "-c", "echo starting server; exec sleep 1000"},
			Ready: []string{"sh", "-c", "echo connection refused >&2; exit 7"}, ReadyTimeoutSeconds: 1}})
		op, sb, _ := createFails(t, h.m, api.CreateSandboxRequest{Template: "never:1"})
		if d := readyWait(t, op); d < time.Second || d > 15*time.Second {
			t.Errorf("1 s ready timeout: the ready wait failed after %s", d)
		}
		wantAll(t, "error", op.Error.Message, "did not pass within 1s", "exit code 7", `"connection refused\n"`, `"starting server\n"`)
		if op.Error.Code != "timeout" {
			t.Errorf("code %s", op.Error.Code)
		}
		h.noInstanceLeft(t, sb.ID)
	})

	t.Run("exits-at-once", func(t *testing.T) {
		derive(t, h.tmpl, base, "exit3:1", api.TemplateConfig{Start: &api.StartCommand{
			Cmd:   []string{"sh", "-c", "echo cannot bind >&2; exit 3"},
			Ready: []string{"sh", "-c", "exit 1"}, ReadyTimeoutSeconds: 60}})
		op, sb, _ := createFails(t, h.m, api.CreateSandboxRequest{Template: "exit3:1"})
		if d := readyWait(t, op); d > 2*time.Second {
			t.Errorf("a start command that exits at once took %s to fail the ready wait (timeout 60 s)", d)
		}
		wantAll(t, "error", op.Error.Message, "exit code 3", `"cannot bind\n"`)
		h.noInstanceLeft(t, sb.ID)
	})
}
