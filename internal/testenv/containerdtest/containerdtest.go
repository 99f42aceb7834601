// Package containerdtest runs a real containerd (Debian's 1.6, CRI
// enabled) for tests, with everything under one temporary directory: root,
// state, the gRPC socket, CNI dirs, the space runtimes' config files and
// the shims' sockets. It never pulls: images come from local OCI tarballs
// (BuildImage, BusyboxImage), and the CRI sandbox image is one of them.
// crictl (bin/crictl, pinned by scripts/setup-test.sh) is wrapped with a config
// naming this containerd only.
//
// Start registers the teardown: containerd and every shim it started are
// killed, every mount under the directory is unmounted, cgroups named after
// the CRI namespace that the run created are removed. With
// SPACE_CONTAINERDTEST_KEEP=1 the directory itself is kept (containerd's
// log, the shims' logs of those that did not exit cleanly).
//
//	c := containerdtest.Start(t, containerdtest.Options{Server: "unix:///…/space.sock", APIKeyFile: key})
//	c.ImportImage(t, containerdtest.BusyboxImage(t, t.TempDir(), containerdtest.PauseImage, []string{"sleep", "infinity"}))
//	out := c.Crictl(t, "pods")
package containerdtest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
	"golang.org/x/sys/unix"
)

// Namespace is the containerd namespace CRI uses.
const Namespace = "k8s.io"

// PauseImage is the CRI sandbox image the config names; import it (e.g.
// BusyboxImage with "sleep infinity") before the first pod. The space
// shim never runs it, but CRI insists that it is present.
const PauseImage = "localhost/space/pause:0.1"

// Handlers are the RuntimeClass handlers (containerd runtime names) the
// config declares, each with its own config file, and the space runtime
// each one asks for.
var Handlers = map[string]string{
	"space":         "auto",
	"space-gvisor":  "gvisor",
	"space-microvm": "microvm",
	"space-native":  "native",
}

// Options configure Start.
type Options struct {
	// Server is the space server the shims use ("unix:///path" or
	// "http://127.0.0.1:port"), APIKeyFile the file holding its key.
	Server, APIKeyFile string
	// Template is the shims' default template ("" = base:latest).
	Template string
	// DefaultRuntime is CRI's default runtime name ("" = "space").
	DefaultRuntime string
	// Shim is the shim binary (default testenv.ShimBinary).
	Shim string
	// ExtraConfig is TOML appended to containerd's config (tables the
	// generated config does not already define).
	ExtraConfig string
}

// Containerd is one running test containerd.
type Containerd struct {
	// Dir holds everything of this containerd.
	Dir string
	// Socket is the CRI/containerd gRPC socket; Endpoint is its URL.
	Socket, Endpoint string
	// ConfigFile is containerd's config; CrictlConfig crictl's.
	ConfigFile, CrictlConfig string
	// ShimSockets is where the shims of this containerd keep their
	// sockets (SPACE_SHIM_SOCKET_DIR in containerd's environment).
	ShimSockets string
	// RuntimeConfigs are the space shim config files by handler.
	RuntimeConfigs map[string]string

	crictl     string
	shimDir    string
	cmd        *exec.Cmd
	exited     chan struct{}
	newCgroups []string
}

// Start starts containerd and registers its teardown with t.Cleanup.
func Start(t testing.TB, o Options) *Containerd {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := exec.LookPath("containerd")
	testenv.Require(t, "containerd", err == nil, "apt-get install containerd (scripts/setup-test.sh)")
	c := &Containerd{crictl: Crictl(t), RuntimeConfigs: map[string]string{}}
	shim := o.Shim
	if shim == "" {
		shim = testenv.ShimBinary(t)
	}
	c.shimDir = filepath.Dir(shim)
	if filepath.Base(shim) != "containerd-shim-space-v2" {
		t.Fatalf("containerdtest: the shim binary must be named containerd-shim-space-v2, got %s", shim)
	}
	// A short directory: unix socket paths are limited to 108 bytes.
	c.Dir, err = os.MkdirTemp("", "cdt-")
	if err != nil {
		t.Fatal(err)
	}
	c.Socket = filepath.Join(c.Dir, "c.sock")
	c.Endpoint = "unix://" + c.Socket
	c.ShimSockets = filepath.Join(c.Dir, "s")
	for _, d := range []string{"root", "state", "cni/bin", "cni/conf", "s", "etc"} {
		if err := os.MkdirAll(filepath.Join(c.Dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	tmpl := o.Template
	if tmpl == "" {
		tmpl = "base:latest"
	}
	def := o.DefaultRuntime
	if def == "" {
		def = "space"
	}
	var rt strings.Builder
	names := make([]string, 0, len(Handlers))
	for h := range Handlers {
		names = append(names, h)
	}
	sort.Strings(names)
	for _, h := range names {
		cfg := filepath.Join(c.Dir, "etc", h+".json")
		body := fmt.Sprintf(`{"server": %q, "api_key_file": %q, "runtime": %q, "template": %q}`+"\n", o.Server, o.APIKeyFile, Handlers[h], tmpl)
		if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		c.RuntimeConfigs[h] = cfg
		fmt.Fprintf(&rt, `
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%q]
  runtime_type = "io.containerd.space.v2"
  pod_annotations = ["space.dev/*"]
  container_annotations = ["space.dev/*"]
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%q.options]
    TypeUrl = "io.containerd.space.v1.Config"
    ConfigPath = %q
`, h, h, cfg)
	}
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %q

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = %q
%s
%s`, filepath.Join(c.Dir, "root"), filepath.Join(c.Dir, "state"), c.Socket, PauseImage,
		filepath.Join(c.Dir, "cni/bin"), filepath.Join(c.Dir, "cni/conf"), def, rt.String(), o.ExtraConfig)
	c.ConfigFile = filepath.Join(c.Dir, "config.toml")
	if err := os.WriteFile(c.ConfigFile, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	c.CrictlConfig = filepath.Join(c.Dir, "crictl.yaml")
	cy := fmt.Sprintf("runtime-endpoint: %s\nimage-endpoint: %s\ntimeout: 60\npull-image-on-create: false\n", c.Endpoint, c.Endpoint)
	if err := os.WriteFile(c.CrictlConfig, []byte(cy), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, ctrl := range cgroupControllers() {
		p := filepath.Join("/sys/fs/cgroup", ctrl, Namespace)
		if _, err := os.Stat(p); os.IsNotExist(err) {
			c.newCgroups = append(c.newCgroups, p)
		}
	}
	t.Cleanup(func() { c.teardown(t) })
	c.start(t)
	return c
}

// Crictl returns the crictl binary: $SPACE_CRICTL_BIN, else bin/crictl of
// the repository (scripts/setup-test.sh builds it), else one on PATH.
func Crictl(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("SPACE_CRICTL_BIN"); p != "" {
		return p
	}
	if root := repoRoot(); root != "" {
		if p := filepath.Join(root, "bin", "crictl"); fileExists(p) {
			return p
		}
	}
	p, err := exec.LookPath("crictl")
	testenv.Require(t, "crictl", err == nil, "run scripts/setup-test.sh (builds bin/crictl) or set SPACE_CRICTL_BIN")
	return p
}

func repoRoot() string {
	d, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if fileExists(filepath.Join(d, "go.mod")) {
			return d
		}
		p := filepath.Dir(d)
		if p == d {
			return ""
		}
		d = p
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func (c *Containerd) start(t testing.TB) {
	t.Helper()
	logf, err := os.OpenFile(filepath.Join(c.Dir, "containerd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command("containerd", "--config", c.ConfigFile)
	cmd.Dir = c.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "PATH="+c.shimDir+":"+os.Getenv("PATH"), "SPACE_SHIM_SOCKET_DIR="+c.ShimSockets)
	// containerd dies with the test process; its shims are killed by the
	// teardown (they outlive containerd by design).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting containerd: %v", err)
	}
	c.cmd = cmd
	c.exited = make(chan struct{})
	go func() { cmd.Wait(); close(c.exited) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if conn, err := net.Dial("unix", c.Socket); err == nil {
			conn.Close()
			if _, err := c.run("info"); err == nil {
				return
			}
		}
		select {
		case <-c.exited:
			t.Fatalf("containerd exited at start:\n%s", c.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd not ready after 20 s:\n%s", c.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Log is containerd's log so far (its shims' stderr goes to their own
// log files beside their sockets).
func (c *Containerd) Log() string {
	b, _ := os.ReadFile(filepath.Join(c.Dir, "containerd.log"))
	return string(b)
}

// Restart stops containerd (SIGTERM; its shims keep running) and starts it
// again with the same config: running pods must be reconnected.
func (c *Containerd) Restart(t testing.TB) {
	t.Helper()
	c.stop()
	c.start(t)
}

func (c *Containerd) stop() {
	if c.cmd == nil {
		return
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-c.exited
	}
	c.cmd = nil
}

// CrictlCmd is a crictl command for this containerd.
func (c *Containerd) CrictlCmd(args ...string) *exec.Cmd {
	cmd := exec.Command(c.crictl, append([]string{"--config", c.CrictlConfig}, args...)...)
	cmd.Env = os.Environ()
	return cmd
}

// run runs crictl and returns its stdout; an error carries stderr.
func (c *Containerd) run(args ...string) (string, error) {
	cmd := c.CrictlCmd(args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		return "", err
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return out.String(), fmt.Errorf("crictl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
		}
		return out.String(), nil
	case <-ctx.Done():
		cmd.Process.Kill()
		<-done
		return out.String(), fmt.Errorf("crictl %s: timed out: %s", strings.Join(args, " "), errb.String())
	}
}

// Crictl runs crictl and fails t on error.
func (c *Containerd) Crictl(t testing.TB, args ...string) string {
	t.Helper()
	out, err := c.run(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TryCrictl runs crictl and returns its stdout and error (stderr inside).
func (c *Containerd) TryCrictl(args ...string) (string, error) { return c.run(args...) }

// Ctr runs ctr against this containerd in the CRI namespace.
func (c *Containerd) Ctr(t testing.TB, args ...string) string {
	t.Helper()
	cmd := exec.Command("ctr", append([]string{"--address", c.Socket, "--namespace", Namespace}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// ImportImage imports an OCI image tarball (its index names the image
// with io.containerd.image.name) into the CRI namespace and unpacks it.
func (c *Containerd) ImportImage(t testing.TB, tarball string) {
	t.Helper()
	c.Ctr(t, "images", "import", tarball)
}

// ShimProcesses lists the shim processes of this containerd (pid →
// command line).
func (c *Containerd) ShimProcesses() map[int]string {
	out := map[int]string{}
	for pid, cmd := range testenv.ProcsNaming(c.Socket) {
		if strings.Contains(cmd, "containerd-shim") {
			out[pid] = cmd
		}
	}
	return out
}

// Mounts lists the mount points under the directory.
func (c *Containerd) Mounts() []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && (f[4] == c.Dir || strings.HasPrefix(f[4], c.Dir+"/")) {
			out = append(out, f[4])
		}
	}
	return out
}

func (c *Containerd) teardown(t testing.TB) {
	if t.Failed() {
		// What the shims said (a shim that exited cleanly removed its log).
		logs, _ := filepath.Glob(filepath.Join(c.ShimSockets, "*.log"))
		for _, l := range logs {
			if b, err := os.ReadFile(l); err == nil && len(b) > 0 {
				t.Logf("containerdtest: shim log %s:\n%s", filepath.Base(l), tail(b, 8<<10))
			}
		}
		t.Logf("containerdtest: containerd log (tail):\n%s", tail([]byte(c.Log()), 8<<10))
	}
	// Pods first, while containerd and the shims run (best effort), so
	// the shims delete their sandboxes.
	if c.cmd != nil {
		c.run("rmp", "-fa")
	}
	c.stop()
	for pid := range c.ShimProcesses() {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	for pid := range testenv.ProcsNaming(c.Dir) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	mounts := c.Mounts()
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
	for _, m := range mounts {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			t.Logf("containerdtest: unmount %s: %v", m, err)
		}
	}
	for _, p := range c.newCgroups {
		removeCgroupTree(p)
	}
	if os.Getenv("SPACE_CONTAINERDTEST_KEEP") != "" {
		t.Logf("containerdtest: keeping %s (SPACE_CONTAINERDTEST_KEEP)", c.Dir)
		return
	}
	if err := os.RemoveAll(c.Dir); err != nil {
		t.Logf("containerdtest: removing %s: %v", c.Dir, err)
	}
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func cgroupControllers() []string {
	ents, _ := os.ReadDir("/sys/fs/cgroup")
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

// removeCgroupTree removes a cgroup directory and its children, leaves
// first (cgroup directories are removed with rmdir).
func removeCgroupTree(p string) {
	ents, err := os.ReadDir(p)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.IsDir() {
			removeCgroupTree(filepath.Join(p, e.Name()))
		}
	}
	syscall.Rmdir(p)
}
