package kubetest

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/containerdtest"
)

// The harness looks for the builds setup-test.sh makes: the versions must agree.
func TestVersionsMatchSetup(t *testing.T) {
	b, err := os.ReadFile("../../../scripts/setup-test.sh")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"KUBE_VERSION": KubeVersion, "ETCD_VERSION": EtcdVersion} {
		m := regexp.MustCompile(`(?m)^` + name + `=(\S+)$`).FindSubmatch(b)
		if m == nil || string(m[1]) != want {
			t.Errorf("scripts/setup-test.sh %s = %q, kubetest wants %q", name, m, want)
		}
	}
}

// TestControlPlane starts etcd and the apiserver alone and checks the
// version the build stamped and what Start prepares in a namespace.
func TestControlPlane(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := FindBinaries()
	testenv.Require(t, "kubernetes", err == nil, errString(err))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	c, err := Start(ctx, Options{Log: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("control plane up in %v", time.Since(t0).Round(time.Millisecond))
	dir := c.Dir
	defer func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", dir, err)
		}
	}()
	out, err := c.Kubectl(ctx, "version", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(out, `"gitVersion": "`+KubeVersion+`"`); n != 2 {
		t.Errorf("kubectl version: want client and server %s:\n%s", KubeVersion, out)
	}
	for _, ns := range []string{"default", "kube-system"} {
		if _, err := c.Kubectl(ctx, "-n", ns, "get", "serviceaccount/default", "configmap/kube-root-ca.crt"); err != nil {
			t.Error(err)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestKilledTestLeavesNothing starts a cluster in a child test process,
// kills that process with SIGKILL, and checks that its components died
// with it (Pdeathsig) and that Sweep removes what it left.
func TestKilledTestLeavesNothing(t *testing.T) {
	if os.Getenv("KUBETEST_CHILD") == "1" {
		c, err := Start(context.Background(), Options{})
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("DIR=%s\n", c.Dir)
		time.Sleep(time.Minute) // killed before this ends
		return
	}
	testenv.RequireRoot(t)
	_, err := FindBinaries()
	testenv.Require(t, "kubernetes", err == nil, errString(err))
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledTestLeavesNothing$", "-test.v")
	cmd.Env = append(os.Environ(), "KUBETEST_CHILD=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var dir string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "DIR="); ok {
			dir = d
			break
		}
	}
	if dir == "" {
		t.Fatal("the child printed no cluster directory")
	}
	if len(testenv.ProcsNaming(dir)) < 2 {
		t.Fatalf("etcd and kube-apiserver of %s are not running: %v", dir, testenv.ProcsNaming(dir))
	}
	cmd.Process.Kill()
	cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for len(testenv.ProcsNaming(dir)) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("processes outlived their test: %v", testenv.ProcsNaming(dir))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("the killed test's directory is already gone: %v", err)
	}
	Sweep()
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("Sweep left %s: %v", dir, err)
	}
}

// TestNodeReady is the harness's self-test with a kubelet: against
// Debian's containerd (containerdtest; no space server needed until a pod
// runs) the node registers and becomes Ready with the test pod network,
// and Close puts the host back as it was.
func TestNodeReady(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := FindBinaries()
	testenv.Require(t, "kubernetes", err == nil, errString(err))
	cd := containerdtest.Start(t, containerdtest.Options{Server: "unix:///nonexistent/space.sock"})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sysctls := readSysctls(t)
	t0 := time.Now()
	c, err := Start(ctx, Options{
		CRIEndpoint: cd.Endpoint,
		CNIConfDir:  filepath.Join(cd.Dir, "cni", "conf"),
		CNIBinDir:   filepath.Join(cd.Dir, "cni", "bin"),
		Log:         t.Logf,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.WaitNodeReady(ctx, time.Minute); err != nil {
		c.Close()
		t.Fatal(err)
	}
	t.Logf("node Ready %v after Start", time.Since(t0).Round(time.Millisecond))
	out, err := c.Kubectl(ctx, "get", "node", NodeName, "-o", "jsonpath={.status.nodeInfo.kubeletVersion} {.status.nodeInfo.containerRuntimeVersion}")
	if err != nil || !strings.HasPrefix(out, KubeVersion+" containerd://1.") {
		t.Errorf("node info %q: %v", out, err)
	}
	roots := c.CgroupDirs()
	if len(roots) == 0 {
		t.Error("no cgroup roots recorded")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	for _, r := range roots {
		if _, err := os.Stat(r); !os.IsNotExist(err) {
			t.Errorf("cgroup %s left: %v", r, err)
		}
	}
	if after := readSysctls(t); !maps.Equal(after, sysctls) {
		t.Errorf("kernel settings %v, were %v", after, sysctls)
	}
	for _, p := range hostPaths {
		if _, err := os.Stat(p); err == nil && !slices.Contains(preexisting, p) {
			t.Errorf("%s left", p)
		}
	}
}

// preexisting are the hostPaths there before this test binary ran.
var preexisting = func() []string {
	var out []string
	for _, p := range hostPaths {
		if _, err := os.Stat(p); err == nil {
			out = append(out, p)
		}
	}
	return out
}()

func readSysctls(t *testing.T) map[string]string {
	m := map[string]string{}
	for _, k := range kubeletSysctls {
		b, err := os.ReadFile("/proc/sys/" + k)
		if err != nil {
			t.Fatal(err)
		}
		m[k] = strings.TrimSpace(string(b))
	}
	return m
}
