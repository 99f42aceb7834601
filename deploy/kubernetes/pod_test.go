package kubernetes

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/shim"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/containerdtest"
	"github.com/spacehq/space/internal/testenv/kubetest"
	"github.com/spacehq/space/sdk"
)

const busyboxImage = "localhost/space/busybox:1"

func waitUntil(t *testing.T, what string, d time.Duration, ok func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		done, state := ok()
		if done {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s (last: %s)", d, what, state)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

const podYAML = `apiVersion: v1
kind: Pod
metadata:
  name: hello
  namespace: default
spec:
  nodeName: localhost # no scheduler in the test cluster
  runtimeClassName: space-gvisor
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: ` + busyboxImage + `
    imagePullPolicy: Never
    command: [sh, -c, 'echo hello from space; echo to stderr >&2; trap "exit 0" TERM; while :; do sleep 1; done']
`

// TestPodOnSpaceGvisor is issue 15's end-to-end test with the real pieces:
// kube-apiserver, kubelet, Debian's containerd with CRI, the space shim and
// a space server. The RuntimeClasses of this directory are applied; a Pod
// with runtimeClassName space-gvisor becomes Ready in a gVisor sandbox;
// kubectl logs, exec (output, exit code) and exec -it (a PTY of the size
// kubectl sent) work through the apiserver and kubelet; deleting the Pod
// leaves nothing on the node — no sandbox in space, no shim process, no
// mount, no pod cgroup, no network namespace.
func TestPodOnSpaceGvisor(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	_, err := kubetest.FindBinaries()
	testenv.Require(t, "kubernetes", err == nil, errString(err))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	t0 := time.Now()
	url, key, client := containerdtest.SpaceServer(t)
	dir := t.TempDir()
	cd := containerdtest.Start(t, containerdtest.Options{Server: url, APIKeyFile: key})
	cd.ImportImage(t, containerdtest.BusyboxImage(t, dir, containerdtest.PauseImage, []string{"sleep", "infinity"}))
	cd.ImportImage(t, containerdtest.BusyboxImage(t, dir, busyboxImage, []string{"sh"}))
	netnsBefore := netnsEntries()
	t.Logf("space server and containerd up in %v", time.Since(t0).Round(time.Millisecond))

	t0 = time.Now()
	k, err := kubetest.Start(ctx, kubetest.Options{
		CRIEndpoint: cd.Endpoint,
		CNIConfDir:  filepath.Join(cd.Dir, "cni", "conf"),
		CNIBinDir:   filepath.Join(cd.Dir, "cni", "bin"),
		Log:         t.Logf,
	})
	if err != nil {
		t.Fatal(err)
	}
	// Registered after containerd's teardown, so it runs before it: the
	// kubelet stops before the runtime it drives.
	t.Cleanup(func() {
		if err := k.Close(); err != nil {
			t.Error(err)
		}
	})
	if err := k.WaitNodeReady(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	t.Logf("node Ready %v after kubetest.Start", time.Since(t0).Round(time.Millisecond))
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := k.Kubectl(ctx, args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	kubectl("label", "node", kubetest.NodeName, "space.dev/runtime=enabled")
	kubectl("apply", "-f", "runtimeclasses.yaml")

	t0 = time.Now()
	apply := k.KubectlCmd(ctx, "apply", "-f", "-")
	apply.Stdin = strings.NewReader(podYAML)
	if out, err := apply.CombinedOutput(); err != nil {
		t.Fatalf("apply pod: %v\n%s", err, out)
	}
	if out, err := k.Kubectl(ctx, "wait", "--for=condition=Ready", "pod/hello", "--timeout=120s"); err != nil {
		desc, _ := k.Kubectl(ctx, "describe", "pod/hello")
		t.Fatalf("%v\n%s\n%s\nkubelet log:\n%s", err, out, desc, k.LogTail("kubelet", 3000))
	}
	t.Logf("pod Ready %v after apply", time.Since(t0).Round(time.Millisecond))

	sbs, err := client.ListSandboxes(ctx, sdk.ListOptions{Labels: map[string]string{shim.LabelPodName: "hello", shim.LabelPodNamespace: "default"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(sbs) != 1 || sbs[0].Runtime != "gvisor" {
		t.Fatalf("the pod's space sandbox: %+v", sbs)
	}
	podUID := strings.TrimSpace(kubectl("get", "pod/hello", "-o", "jsonpath={.metadata.uid}"))
	// The pod network: an address from the test network (the sandbox's
	// own NIC is space's; this namespace is only CRI's).
	if ip := kubectl("get", "pod/hello", "-o", "jsonpath={.status.podIP}"); !strings.HasPrefix(ip, "198.19.255.") {
		t.Errorf("pod IP %q is not from the test pod network", ip)
	}

	t.Run("logs", func(t *testing.T) {
		waitUntil(t, "kubectl logs", 20*time.Second, func() (bool, string) {
			out, err := k.Kubectl(ctx, "logs", "hello")
			return err == nil && strings.Contains(out, "hello from space") && strings.Contains(out, "to stderr"), out + errString(err)
		})
	})

	t.Run("exec", func(t *testing.T) {
		t0 := time.Now()
		out := kubectl("exec", "hello", "--", "sh", "-c", "echo exec-out; ls /")
		t.Logf("kubectl exec %v", time.Since(t0).Round(time.Millisecond))
		if !strings.Contains(out, "exec-out") || !strings.Contains(out, "bin") {
			t.Fatalf("exec output %q", out)
		}
		cmd := k.KubectlCmd(ctx, "exec", "hello", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 3 {
			t.Fatalf("kubectl exec of exit 3: %v (stderr %q)", err, stderr.String())
		}
		if stdout.String() != "out\n" || !strings.Contains(stderr.String(), "err\n") {
			t.Errorf("exec streams: stdout %q, stderr %q", stdout.String(), stderr.String())
		}
	})

	t.Run("exec -it", func(t *testing.T) {
		cmd := k.KubectlCmd(ctx, "exec", "-it", "hello", "--", "sh", "-c", `[ -t 0 ] && [ -t 1 ] && echo in-a-tty; i=0; while [ "$(stty size)" = "24 80" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done; stty size`)
		f, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 33, Cols: 101})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var out bytes.Buffer
		io.Copy(&out, f) // ends with EIO once kubectl exits
		if err := cmd.Wait(); err != nil {
			t.Fatalf("kubectl exec -it: %v\n%s", err, out.String())
		}
		// The process starts at CRI's default size; kubectl's first
		// resize follows at once (the same race as with runc), so the
		// script waits for it up to 5 s.
		if !strings.Contains(out.String(), "in-a-tty") || !strings.Contains(out.String(), "33 101") {
			t.Fatalf("kubectl exec -it: want a TTY of 33x101:\n%q", out.String())
		}
	})

	t0 = time.Now()
	kubectl("delete", "pod/hello", "--wait=true", "--timeout=60s")
	t.Logf("kubectl delete returned after %v", time.Since(t0).Round(time.Millisecond))
	gone := []struct {
		what  string
		check func() (bool, string)
	}{
		{"the pod's space sandbox", func() (bool, string) {
			sbs, err := client.ListSandboxes(ctx, sdk.ListOptions{Labels: map[string]string{shim.LabelPodName: "hello"}})
			return err == nil && len(sbs) == 0, errString(err)
		}},
		{"the shim process", func() (bool, string) {
			p := cd.ShimProcesses()
			return len(p) == 0, strings.Join(slices.Collect(mapValues(p)), "; ")
		}},
		{"the pod's cgroups", func() (bool, string) {
			left := podCgroups(k.CgroupDirs(), podUID)
			return len(left) == 0, strings.Join(left, " ")
		}},
		{"the pod's network namespace", func() (bool, string) {
			var added []string
			for _, e := range netnsEntries() {
				if !slices.Contains(netnsBefore, e) {
					added = append(added, e)
				}
			}
			return len(added) == 0, strings.Join(added, " ")
		}},
		{"the pod's mounts", func() (bool, string) {
			m, _ := hostfs.MountsUnder(filepath.Join(k.Dir, "kubelet", "pods"))
			m = append(m, cd.Mounts()...)
			return len(m) == 0, strings.Join(m, " ")
		}},
	}
	for _, g := range gone {
		waitUntil(t, g.what+" to go", 30*time.Second, g.check)
		t.Logf("%s gone %v after kubectl delete", g.what, time.Since(t0).Round(time.Millisecond))
	}
	t.Logf("CRI after the delete:\n%s", cd.Crictl(t, "pods"))
}

// netnsEntries lists the named network namespaces (CRI's are cni-…).
func netnsEntries() []string {
	ents, err := os.ReadDir("/var/run/netns")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return []string{err.Error()}
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// podCgroups lists the cgroups of pod uid below the cluster's cgroup
// roots (the kubelet names them pod<uid> under kubepods/<qos>/).
func podCgroups(roots []string, uid string) []string {
	var out []string
	for _, r := range roots {
		filepath.WalkDir(r, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() && strings.Contains(d.Name(), uid) {
				out = append(out, p)
			}
			return nil
		})
	}
	return out
}

func mapValues(m map[int]string) func(func(string) bool) {
	return func(yield func(string) bool) {
		for _, v := range m {
			if !yield(v) {
				return
			}
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
