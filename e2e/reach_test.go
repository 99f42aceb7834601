package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cli"
	"github.com/spacehq/space/internal/testenv"
)

// The docker-like reach of the CLI over a sandbox's commands: ps, logs,
// attach, kill — on a real (native) sandbox, driven as a user would.

// psCommands is `space ps --all --json ID`.
func psCommands(t *testing.T, e *env, id string) map[string]api.Command {
	t.Helper()
	out, errOut, code := e.spaceCLI(t, "", "ps", "--all", "--json", id)
	if code != 0 {
		t.Fatalf("space ps: %d %s", code, errOut)
	}
	var l api.CommandList
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		t.Fatalf("space ps --json: %v\n%s", err, out)
	}
	m := map[string]api.Command{}
	for _, c := range l.Commands {
		m[c.ID] = c
	}
	return m
}

// startDetached is `space exec -d ID -- argv…`, returning the command id.
func startDetached(t *testing.T, e *env, id string, argv ...string) string {
	t.Helper()
	out, errOut, code := e.spaceCLI(t, "", append([]string{"exec", "-d", id, "--"}, argv...)...)
	cid := strings.TrimSpace(out)
	if code != 0 || !strings.HasPrefix(cid, "cmd") {
		t.Fatalf("space exec -d %v: %d %q %s", argv, code, out, errOut)
	}
	return cid
}

func TestCLIPsLogsKill(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})

	cid := startDetached(t, e, sb.ID, "sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo warn >&2; exit 3")
	// Running now: ps lists it (default view) with a pid and no exit.
	out, errOut, code := e.spaceCLI(t, "", "ps", sb.ID)
	if code != 0 || !strings.Contains(out, cid) || !strings.Contains(out, "running") || !strings.Contains(out, "COMMAND") {
		t.Fatalf("space ps while running: %d %q %s", code, out, errOut)
	}
	// logs -f follows to the end and exits with the command's code.
	out, errOut, code = e.spaceCLI(t, "", "logs", "-f", sb.ID, cid)
	if code != 3 || out != "line1\nline2\nline3\n" || errOut != "warn\n" {
		t.Fatalf("space logs -f: code %d, stdout %q, stderr %q", code, out, errOut)
	}
	c := psCommands(t, e, sb.ID)[cid]
	if c.State != api.CommandExited || c.Exit == nil || c.Exit.ExitCode != 3 || c.StartedAt == nil {
		t.Fatalf("ps after exit: %+v", c)
	}
	out, _, _ = e.spaceCLI(t, "", "ps", sb.ID)
	if !strings.Contains(out, cid) || !strings.Contains(out, "exited") {
		t.Fatalf("ps table after exit: %q", out)
	}
	// Without -f: everything, exit 0; --tail 1: the last line of each stream.
	if out, errOut, code = e.spaceCLI(t, "", "logs", sb.ID, cid); code != 0 || out != "line1\nline2\nline3\n" || errOut != "warn\n" {
		t.Fatalf("space logs: %d %q %q", code, out, errOut)
	}
	if out, errOut, code = e.spaceCLI(t, "", "logs", "--tail", "1", sb.ID, cid); code != 0 || out != "line3\n" || errOut != "warn\n" {
		t.Fatalf("space logs --tail 1: %d %q %q", code, out, errOut)
	}

	// logs of a running command prints what is there and returns (it
	// does not follow), and leaves the command running.
	live := startDetached(t, e, sb.ID, "sh", "-c", "echo early; echo e1 >&2; sleep 1000")
	deadline := time.Now().Add(20 * time.Second)
	for {
		out, errOut, code = e.spaceCLI(t, "", "logs", sb.ID, live)
		if code != 0 {
			t.Fatalf("space logs of a running command: %d %s", code, errOut)
		}
		if out == "early\n" && errOut == "e1\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("space logs of a running command: %q %q", out, errOut)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// -f --tail 0 follows only what comes next: here nothing, until kill.
	done := make(chan string, 1)
	go func() {
		out, errOut, code := e.spaceCLI(t, "", "logs", "-f", "--tail", "0", sb.ID, live)
		done <- fmt.Sprintf("%d %q %q", code, out, errOut)
	}()
	time.Sleep(500 * time.Millisecond)
	if p := psCommands(t, e, sb.ID)[live]; p.State != api.CommandRunning {
		t.Fatalf("logs stopped the command: %+v", p)
	}

	// A signal nobody knows is refused, naming it; the command runs on.
	if _, errOut, code = e.spaceCLI(t, "", "kill", "-s", "NOPE", sb.ID, live); code != 1 || !strings.Contains(errOut, "NOPE") {
		t.Fatalf("kill -s NOPE: %d %s", code, errOut)
	}
	// kill: TERM by default; ps shows how it ended.
	if out, errOut, code = e.spaceCLI(t, "", "kill", sb.ID, live); code != 0 || strings.TrimSpace(out) != live {
		t.Fatalf("space kill: %d %q %s", code, out, errOut)
	}
	select {
	case got := <-done:
		if !strings.HasPrefix(got, `143 "" `) {
			t.Fatalf("logs -f --tail 0 of a killed command: %s", got)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("logs -f did not end when the command was killed")
	}
	sl := startDetached(t, e, sb.ID, "sleep", "1000")
	if out, errOut, code = e.spaceCLI(t, "", "kill", "-s", "KILL", sb.ID, sl); code != 0 {
		t.Fatalf("space kill -s KILL: %d %q %s", code, out, errOut)
	}
	deadline = time.Now().Add(20 * time.Second)
	for {
		cmds := psCommands(t, e, sb.ID)
		if cmds[live].State == api.CommandExited && cmds[sl].State == api.CommandExited {
			if x := cmds[live].Exit; x == nil || x.Signal != "TERM" {
				t.Fatalf("killed by TERM: %+v", x)
			}
			if x := cmds[sl].Exit; x == nil || x.Signal != "KILL" {
				t.Fatalf("killed by KILL: %+v", x)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("commands did not end after kill: %+v", cmds)
		}
		time.Sleep(100 * time.Millisecond)
	}
	out, _, _ = e.spaceCLI(t, "", "ps", sb.ID)
	if !strings.Contains(out, "143 (SIGTERM)") || !strings.Contains(out, "137 (SIGKILL)") {
		t.Fatalf("ps does not say the commands were signalled:\n%s", out)
	}
	// Bad input: a signal the agent does not know, an exited command,
	// an unknown command, a bad tail.
	if _, errOut, code = e.spaceCLI(t, "", "kill", sb.ID, sl); code != 1 || !strings.Contains(errOut, "exited") {
		t.Fatalf("kill of an exited command: %d %s", code, errOut)
	}
	if _, errOut, code = e.spaceCLI(t, "", "logs", sb.ID, "cmd-nope"); code != 1 || !strings.Contains(errOut, "not found") {
		t.Fatalf("logs of an unknown command: %d %s", code, errOut)
	}
	if _, errOut, code = e.spaceCLI(t, "", "logs", "--tail", "-5", sb.ID, cid); code != 2 {
		t.Fatalf("logs --tail -5: %d %s", code, errOut)
	}
	if _, errOut, code = e.spaceCLI(t, "", "attach", sb.ID, cid); code != 1 || !strings.Contains(errOut, "has exited") {
		t.Fatalf("attach to an exited command: %d %s", code, errOut)
	}
}

// TestCLIAttach drives the space binary with pipes: attach to a detached
// `cat`, type, see it echoed, detach at the end of input without stopping
// it; then attach with --close-stdin, which ends cat and so the attach.
func TestCLIAttach(t *testing.T) {
	e := setup(t)
	bin := buildSpace(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})
	cid := startDetached(t, e, sb.ID, "cat")

	cmd := exec.Command(bin, "--url", e.url, "--api-key", e.key, "attach", sb.ID, cid)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan string, 10)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	expect := func(want string) {
		t.Helper()
		select {
		case l := <-lines:
			if l != want {
				t.Fatalf("attach printed %q, want %q (stderr %s)", l, want, stderr.String())
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("attach never printed %q (stderr %s)", want, stderr.String())
		}
	}
	io.WriteString(stdin, "hello attach\n")
	expect("hello attach")
	io.WriteString(stdin, "second line\n")
	expect("second line")
	stdin.Close() // end of input: detach
	if err := waitTimeout(cmd, 20*time.Second); err != nil {
		t.Fatalf("attach after EOF: %v (stderr %s)", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "detached") {
		t.Fatalf("attach did not say it detached: %s", stderr.String())
	}
	if c := psCommands(t, e, sb.ID)[cid]; c.State != api.CommandRunning {
		t.Fatalf("detaching stopped the command: %+v", c)
	}
	// Only new output is shown on attach (the two lines above are old);
	// --close-stdin passes EOF on, cat exits 0, and so does attach.
	out, errOut, code := e.spaceCLI(t, "third\n", "attach", "--close-stdin", sb.ID, cid)
	if code != 0 || out != "third\n" {
		t.Fatalf("attach --close-stdin: %d %q %s", code, out, errOut)
	}
	if c := psCommands(t, e, sb.ID)[cid]; c.State != api.CommandExited || c.Exit.ExitCode != 0 {
		t.Fatalf("cat after EOF: %+v", c)
	}
	// --replay shows what was buffered before.
	if out, _, code = e.spaceCLI(t, "", "logs", sb.ID, cid); code != 0 || out != "hello attach\nsecond line\nthird\n" {
		t.Fatalf("logs of cat: %d %q", code, out)
	}
}

func waitTimeout(cmd *exec.Cmd, d time.Duration) error {
	ch := make(chan error, 1)
	go func() { ch <- cmd.Wait() }()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		cmd.Process.Kill()
		return fmt.Errorf("still running after %v", d)
	}
}

// TestCLIAttachTTY re-attaches a terminal to a TTY command started with
// `space exec -d -t`, under tmux: the command gets the terminal's size,
// input and output go through raw mode, and Ctrl-P Ctrl-Q detaches
// without ending it.
func TestCLIAttachTTY(t *testing.T) {
	e := setup(t)
	_, err := exec.LookPath("tmux")
	testenv.Require(t, "tmux", err == nil, "tmux is not installed")
	bin := buildSpace(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})
	out, errOut, code := e.spaceCLI(t, "", "exec", "-d", "-t", sb.ID, "--", "bash", "--norc")
	tcid := strings.TrimSpace(out)
	if code != 0 {
		t.Fatalf("exec -d -t: %d %s", code, errOut)
	}
	if c := psCommands(t, e, sb.ID)[tcid]; !c.TTY || c.State != api.CommandRunning {
		t.Fatalf("exec -d -t did not start a TTY command: %+v", c)
	}
	sess := "space-attach-" + sb.ID
	tmux := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("tmux", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("tmux %v: %v %s", args, err, out)
		}
		return string(out)
	}
	cmd := exec.Command("tmux", "new-session", "-d", "-s", sess, "-x", "90", "-y", "25",
		bin+" --url "+e.url+" --api-key "+e.key+" attach "+sb.ID+" "+tcid+"; echo ATTACH-EXITED-$?; sleep 30")
	cmd.Env = append(os.Environ(), "TERM=xterm")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tmux new-session: %v %s", err, out)
	}
	defer exec.Command("tmux", "kill-session", "-t", sess).Run()
	screen := func() string { return tmux("capture-pane", "-p", "-t", sess) }
	waitFor := func(want string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			if strings.Contains(screen(), want) {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatalf("screen never showed %q:\n%s", want, screen())
	}
	send := func(keys ...string) { tmux(append([]string{"send-keys", "-t", sess}, keys...)...) }
	time.Sleep(500 * time.Millisecond)
	send("stty size; echo sum-$((40+2))", "Enter")
	waitFor("25 90")
	waitFor("sum-42")
	send("C-p", "C-q")
	waitFor("ATTACH-EXITED-0")
	if !strings.Contains(screen(), "detached") {
		t.Fatalf("no detach note:\n%s", screen())
	}
	if c := psCommands(t, e, sb.ID)[tcid]; c.State != api.CommandRunning {
		t.Fatalf("detaching ended the TTY command: %+v", c)
	}
	// Its output so far, from the replay buffer.
	if out, _, code := e.spaceCLI(t, "", "logs", sb.ID, tcid); code != 0 || !strings.Contains(out, "sum-42") {
		t.Fatalf("logs of the TTY command: %d %q", code, out)
	}
}

// TestCLIStatsOutput: the stats command's table, JSON lines and stream on
// a pipe (no terminal codes), for a running sandbox.
func TestCLIStatsOutput(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})
	out, errOut, code := e.spaceCLI(t, "", "stats", "--no-stream", sb.ID)
	if code != 0 || !strings.Contains(out, "CPU %") || !strings.Contains(out, sb.ID) || !strings.Contains(out, "512.0 MiB") {
		t.Fatalf("space stats --no-stream: %d %q %s", code, out, errOut)
	}
	// Without IDs: every running sandbox, this one among them.
	if out, _, code = e.spaceCLI(t, "", "stats", "--no-stream"); code != 0 || !strings.Contains(out, sb.ID) {
		t.Fatalf("space stats --no-stream (all): %d %q", code, out)
	}
	out, _, code = e.spaceCLI(t, "", "--json", "stats", "--no-stream", sb.ID)
	var st api.SandboxStats
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil || st.SandboxID != sb.ID || st.State != api.StateRunning || st.MemUsedBytes <= 0 {
		t.Fatalf("space stats --json: %d %q", code, out)
	}
	// Streaming to a pipe: one table per interval, no terminal codes.
	ctx, cancel := context.WithTimeout(context.Background(), 2200*time.Millisecond)
	defer cancel()
	var o, eb strings.Builder
	code = cli.Execute(ctx, []string{"--url", e.url, "--api-key", e.key, "stats", "--interval", "500ms", sb.ID}, strings.NewReader(""), &o, &eb)
	if code != 0 || strings.Count(o.String(), "CPU %") < 3 || strings.Contains(o.String(), "\x1b") {
		t.Fatalf("space stats streamed to a pipe: %d %q %s", code, o.String(), eb.String())
	}
	if _, errOut, code = e.spaceCLI(t, "", "stats", "--no-stream", "sb-nope"); code != 1 || !strings.Contains(errOut, "not found") {
		t.Fatalf("stats of an unknown sandbox: %d %s", code, errOut)
	}
	// The route's bad inputs are 400s naming the parameter.
	for q, want := range map[string]string{"follow=1&interval=1ms": "interval", "interval=1s": "interval", "follow=maybe": "follow"} {
		req, _ := http.NewRequest("GET", e.url+"/v1/sandboxes/"+sb.ID+"/stats?"+q, nil)
		req.Header.Set("Authorization", "Bearer "+e.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(b), want) {
			t.Errorf("stats?%s: %d %s", q, resp.StatusCode, b)
		}
	}
}
