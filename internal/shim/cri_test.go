package shim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/shim"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/containerdtest"
	"github.com/spacehq/space/sdk"
)

const busyboxImage = "localhost/space/busybox:1"

// criEnv is a space server, a containerd using the shim against it, and the
// two images the tests use.
type criEnv struct {
	c      *containerdtest.Containerd
	client *sdk.Client
	dir    string
}

func startCRI(t *testing.T) *criEnv {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	dir := t.TempDir()
	url, keyFile, client := containerdtest.SpaceServer(t)
	c := containerdtest.Start(t, containerdtest.Options{Server: url, APIKeyFile: keyFile})
	c.ImportImage(t, containerdtest.BusyboxImage(t, dir, containerdtest.PauseImage, []string{"sleep", "infinity"}))
	c.ImportImage(t, containerdtest.BusyboxImage(t, dir, busyboxImage, []string{"sh"}))
	return &criEnv{c: c, client: client, dir: dir}
}

// writeJSON writes v to dir/name and returns the path.
func writeJSON(t *testing.T, dir, name string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func podConfig(name string, ann map[string]string, logDir string) map[string]any {
	return map[string]any{
		"metadata":      map[string]any{"name": name, "namespace": "default", "uid": name + "-uid", "attempt": 0},
		"log_directory": logDir,
		"annotations":   ann,
		// No CNI here: host networking as far as CRI knows; the sandbox
		// has its own NIC anyway.
		"linux": map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	}
}

func (e *criEnv) podSandboxes(t *testing.T, podID string) []api.Sandbox {
	t.Helper()
	sbs, err := e.client.ListSandboxes(context.Background(), sdk.ListOptions{Labels: map[string]string{shim.LabelContainerdID: podID}})
	if err != nil {
		t.Fatal(err)
	}
	return sbs
}

func waitFor(t *testing.T, what string, d time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestCRILifecycle drives a pod through CRI with crictl against the real
// containerd 1.6 and the real shim on gvisor: run, logs, exec (exit
// codes, a TTY), stats, a containerd restart, stop and removal; the
// space sandbox lives exactly as long as the pod and nothing is left.
func TestCRILifecycle(t *testing.T) {
	e := startCRI(t)
	c := e.c
	logDir := filepath.Join(e.dir, "logs")
	os.MkdirAll(logDir, 0o755)

	t.Run("invalid annotation", func(t *testing.T) {
		pod := writeJSON(t, e.dir, "badpod.json", podConfig("bad", map[string]string{"space.dev/runtime": "vmware"}, logDir))
		_, err := c.TryCrictl("runp", "--runtime", "space-gvisor", pod)
		if err == nil || !strings.Contains(err.Error(), "space.dev/runtime") {
			t.Fatalf("runp with a bad annotation: %v", err)
		}
	})

	start := time.Now()
	pod := writeJSON(t, e.dir, "pod.json", podConfig("web", map[string]string{"space.dev/egress": "example.test:443"}, logDir))
	podID := strings.TrimSpace(c.Crictl(t, "runp", "--runtime", "space-gvisor", pod))
	runp := time.Since(start)
	sbs := e.podSandboxes(t, podID)
	if len(sbs) != 1 || sbs[0].Runtime != "gvisor" || sbs[0].Labels[shim.LabelPodName] != "web" || sbs[0].Labels[shim.LabelPodNamespace] != "default" ||
		sbs[0].Network == nil || len(sbs[0].Network.AllowOut) != 1 {
		t.Fatalf("the pod's sandbox: %+v", sbs)
	}
	sbID := sbs[0].ID

	ctr := writeJSON(t, e.dir, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "main"},
		"image":    map[string]any{"image": busyboxImage},
		"command":  []string{"sh", "-c", "echo hello from space; echo to stderr >&2; cat /etc/hostname >/dev/null; exec sleep 3600"},
		"log_path": "main.log",
	})
	t.Run("invalid container annotation", func(t *testing.T) {
		bad := writeJSON(t, e.dir, "badctr.json", map[string]any{
			"metadata":    map[string]any{"name": "bad"},
			"image":       map[string]any{"image": busyboxImage},
			"command":     []string{"true"},
			"annotations": map[string]string{"space.dev/egres": "example.test"},
		})
		// CRI makes the task (the shim's Create) at StartContainer.
		id := strings.TrimSpace(c.Crictl(t, "create", podID, bad, pod))
		_, err := c.TryCrictl("start", id)
		if err == nil || !strings.Contains(err.Error(), "space.dev/egres") {
			t.Fatalf("start with a misspelt annotation: %v", err)
		}
		c.Crictl(t, "rm", id)
	})

	t0 := time.Now()
	cid := strings.TrimSpace(c.Crictl(t, "create", podID, ctr, pod))
	create := time.Since(t0)
	t0 = time.Now()
	c.Crictl(t, "start", cid)
	startDur := time.Since(t0)

	waitFor(t, "the container's output in crictl logs", 10*time.Second, func() bool {
		out, err := c.TryCrictl("logs", cid)
		return err == nil && strings.Contains(out, "hello from space")
	})
	b, _ := os.ReadFile(filepath.Join(logDir, "main.log"))
	if !strings.Contains(string(b), " stderr F to stderr") {
		t.Errorf("CRI log file lacks the stderr line:\n%s", b)
	}

	t0 = time.Now()
	out := c.Crictl(t, "exec", cid, "sh", "-c", "echo exec-out; ls /")
	execDur := time.Since(t0)
	if !strings.Contains(out, "exec-out") || !strings.Contains(out, "busybox") && !strings.Contains(out, "bin") {
		t.Fatalf("exec output %q", out)
	}
	// The container's root is its image: no trace of the template's tree.
	if strings.Contains(out, "usr") || strings.Contains(out, "var") {
		t.Fatalf("the container sees more than its image at /:\n%s", out)
	}
	// crictl exits 1 and names the command's own code.
	for _, c := range []struct {
		args []string
		want string
	}{{[]string{"exec"}, "exit code 7"}, {[]string{"exec", "--sync"}, "exited with 7"}} {
		cmd := e.c.CrictlCmd(append(c.args, cid, "sh", "-c", "echo bye; exit 7")...)
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), c.want) {
			t.Fatalf("crictl %v of exit 7: %v\n%s", c.args, err, out)
		}
	}

	t.Run("exec -i", func(t *testing.T) {
		cmd := c.CrictlCmd("exec", "-i", cid, "sh", "-c", "tr a-z A-Z; echo done")
		cmd.Stdin = strings.NewReader("piped input\n")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "PIPED INPUT\ndone") {
			t.Fatalf("stdin through exec -i: %v\n%s", err, out)
		}
	})

	t.Run("exec -it", func(t *testing.T) {
		script, err := exec.LookPath("script")
		testenv.Require(t, "script", err == nil, "util-linux's script drives a PTY")
		// script's terminal is 33x101: crictl sends that size, which
		// reaches the process through CRI's resize and the shim's ResizePty.
		cmd := exec.Command(script, "-qec", "stty rows 33 cols 101; "+strings.Join([]string{c.CrictlCmd().Path, "--config", c.CrictlConfig, "exec", "-it", cid, "sh", "-c", "'[ -t 0 ] && [ -t 1 ] && echo in-a-tty; sleep 0.5; stty size'"}, " "), "/dev/null")
		// stdin stays open (no EOF for script to pass on as ^D) until
		// the command has ended.
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		cmd.Stdin = r
		out, err := cmd.CombinedOutput()
		r.Close()
		// A terminal of the size crictl's has (the container has no /dev
		// of its own, so tty(1) cannot name it: see docs/cluster.md).
		if err != nil || !strings.Contains(string(out), "in-a-tty") || !strings.Contains(string(out), "33 101") {
			t.Fatalf("exec -it: %v\n%s", err, out)
		}
	})

	t.Run("stats", func(t *testing.T) {
		out := c.Crictl(t, "stats", "-o", "json", cid)
		var st struct {
			Stats []struct {
				CPU struct {
					UsageCoreNanoSeconds struct{ Value string } `json:"usageCoreNanoSeconds"`
				} `json:"cpu"`
				Memory struct {
					WorkingSetBytes struct{ Value string } `json:"workingSetBytes"`
				} `json:"memory"`
			} `json:"stats"`
		}
		if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Stats) != 1 {
			t.Fatalf("stats: %v\n%s", err, out)
		}
		if v := st.Stats[0].Memory.WorkingSetBytes.Value; v == "" || v == "0" {
			t.Errorf("no memory in stats:\n%s", out)
		}
	})

	// CRI never pauses; containerd's task API does (ctr tasks pause): the
	// pod's sandbox is paused and resumed with it.
	t.Run("pause and resume", func(t *testing.T) {
		c.Ctr(t, "tasks", "pause", cid)
		if sb, err := e.client.GetSandbox(context.Background(), sbID); err != nil || sb.State != api.StatePaused {
			t.Fatalf("after pause the sandbox is %+v (%v)", sb, err)
		}
		if out := c.Ctr(t, "tasks", "ls"); !strings.Contains(out, "PAUSED") {
			t.Errorf("ctr tasks ls does not show the task paused:\n%s", out)
		}
		c.Ctr(t, "tasks", "resume", cid)
		if out := c.Crictl(t, "exec", cid, "echo", "resumed"); !strings.Contains(out, "resumed") {
			t.Fatalf("exec after resume: %q", out)
		}
	})

	t.Run("containerd restart", func(t *testing.T) {
		c.Restart(t)
		out := c.Crictl(t, "inspect", "-o", "go-template", "--template", "{{.status.state}}", cid)
		if !strings.Contains(out, "RUNNING") {
			t.Fatalf("after a containerd restart the container is %q", out)
		}
		if out := c.Crictl(t, "exec", cid, "echo", "still-here"); !strings.Contains(out, "still-here") {
			t.Fatalf("exec after restart: %q", out)
		}
	})

	t0 = time.Now()
	c.Crictl(t, "stop", "--timeout", "2", cid)
	c.Crictl(t, "rm", cid)
	c.Crictl(t, "stopp", podID)
	c.Crictl(t, "rmp", podID)
	teardown := time.Since(t0)
	t.Logf("crictl: runp %v, create %v, start %v, exec %v, stop+rm+stopp+rmp %v; whole lifecycle %v",
		runp.Round(time.Millisecond), create.Round(time.Millisecond), startDur.Round(time.Millisecond),
		execDur.Round(time.Millisecond), teardown.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))

	if _, err := e.client.GetSandbox(context.Background(), sbID); err == nil {
		waitFor(t, "the pod's sandbox to go", 20*time.Second, func() bool {
			_, err := e.client.GetSandbox(context.Background(), sbID)
			return err != nil
		})
	}
	waitFor(t, "the shim to exit", 10*time.Second, func() bool { return len(c.ShimProcesses()) == 0 })
	ents, _ := os.ReadDir(c.ShimSockets)
	if len(ents) != 0 {
		t.Errorf("left in the shims' socket dir: %v", ents)
	}
	if m := c.Mounts(); len(m) != 0 {
		t.Errorf("mounts left under containerd's dir: %v", m)
	}

	// A whole pod round on a warm server (the template prepared: what a
	// node pays per pod), on gvisor and on native (whose agent must honour
	// Root too).
	// A shim that dies (kill -9) leaves no sandbox: containerd's cleanup
	// runs the shim binary's delete, which finds the pod's sandbox by its
	// label and deletes it.
	t.Run("shim killed", func(t *testing.T) {
		pod := writeJSON(t, e.dir, "killed-pod.json", podConfig("killed", nil, logDir))
		podID := strings.TrimSpace(c.Crictl(t, "runp", "--runtime", "space-gvisor", pod))
		sbs := e.podSandboxes(t, podID)
		if len(sbs) != 1 {
			t.Fatalf("%d sandboxes for the pod", len(sbs))
		}
		for pid := range c.ShimProcesses() {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		waitFor(t, "the shim to die", 5*time.Second, func() bool { return len(c.ShimProcesses()) == 0 })
		c.TryCrictl("stopp", podID)
		if out, err := c.TryCrictl("rmp", podID); err != nil {
			t.Fatalf("rmp after the shim died: %v\n%s", err, out)
		}
		waitFor(t, "the dead shim's sandbox to be deleted", 20*time.Second, func() bool {
			_, err := e.client.GetSandbox(context.Background(), sbs[0].ID)
			return err != nil
		})
		if m := c.Mounts(); len(m) != 0 {
			t.Errorf("mounts left: %v", m)
		}
	})

	// Native's first pod prepares the template's native form (seconds);
	// the second is what a node pays per pod. microvm (TCG here) shows
	// its agent honours Root too.
	for i, h := range []string{"space-gvisor", "space-native", "space-native", "space-microvm"} {
		t.Run(h, func(t *testing.T) {
			took := e.lifecycle(t, h, fmt.Sprintf("%s-%d", strings.TrimPrefix(h, "space-"), i))
			t.Logf("%s: runp → create → start → exec → logs → stop → rm → stopp → rmp: %v", h, took.Round(time.Millisecond))
		})
	}
}

// lifecycle runs one pod with one container through crictl on handler
// (runp, create, start, logs, exec, stop, rm, stopp, rmp), checks the
// container's root is its image and the sandbox goes with the pod, and
// returns how long the whole round took.
func (e *criEnv) lifecycle(t *testing.T, handler, name string) time.Duration {
	t.Helper()
	c := e.c
	logDir := filepath.Join(e.dir, "logs-"+name)
	os.MkdirAll(logDir, 0o755)
	pod := writeJSON(t, e.dir, name+"-pod.json", podConfig(name, nil, logDir))
	ctr := writeJSON(t, e.dir, name+"-ctr.json", map[string]any{
		"metadata": map[string]any{"name": "main"},
		"image":    map[string]any{"image": busyboxImage},
		"command":  []string{"sh", "-c", "echo started; exec sleep 3600"},
		"log_path": "main.log",
	})
	start := time.Now()
	var steps []string
	step := func(name string, t0 time.Time) {
		steps = append(steps, name+" "+time.Since(t0).Round(time.Millisecond).String())
	}
	t0 := time.Now()
	podID := strings.TrimSpace(c.Crictl(t, "runp", "--runtime", handler, pod))
	step("runp", t0)
	t0 = time.Now()
	cid := strings.TrimSpace(c.Crictl(t, "create", podID, ctr, pod))
	step("create", t0)
	t0 = time.Now()
	c.Crictl(t, "start", cid)
	step("start", t0)
	t0 = time.Now()
	out := c.Crictl(t, "exec", cid, "sh", "-c", "ls /; id -u")
	step("exec", t0)
	if !strings.Contains(out, "busybox") && !strings.Contains(out, "bin\n") || strings.Contains(out, "usr") {
		t.Fatalf("%s: the container's / is not its image:\n%s", handler, out)
	}
	waitFor(t, "crictl logs", 10*time.Second, func() bool {
		out, err := c.TryCrictl("logs", cid)
		return err == nil && strings.Contains(out, "started")
	})
	sbs := e.podSandboxes(t, podID)
	if len(sbs) != 1 {
		t.Fatalf("%s: %d sandboxes for the pod", handler, len(sbs))
	}
	t0 = time.Now()
	c.Crictl(t, "stop", "--timeout", "2", cid)
	step("stop", t0)
	t0 = time.Now()
	c.Crictl(t, "rm", cid)
	c.Crictl(t, "stopp", podID)
	c.Crictl(t, "rmp", podID)
	step("rm+stopp+rmp", t0)
	took := time.Since(start)
	t.Logf("%s steps: %s", handler, strings.Join(steps, ", "))
	if len(e.podSandboxes(t, podID)) != 0 {
		t.Fatalf("%s: the pod's sandbox outlived the pod", handler)
	}
	waitFor(t, "the shim to exit", 10*time.Second, func() bool { return len(c.ShimProcesses()) == 0 })
	return took
}
