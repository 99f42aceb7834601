package kubetest

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
)

// The harness looks for the builds setup.sh makes: the versions must agree.
func TestVersionsMatchSetup(t *testing.T) {
	b, err := os.ReadFile("../../../scripts/setup.sh")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"KUBE_VERSION": KubeVersion, "ETCD_VERSION": EtcdVersion} {
		m := regexp.MustCompile(`(?m)^` + name + `=(\S+)$`).FindSubmatch(b)
		if m == nil || string(m[1]) != want {
			t.Errorf("scripts/setup.sh %s = %q, kubetest wants %q", name, m, want)
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
