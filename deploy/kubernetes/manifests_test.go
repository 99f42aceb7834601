// Package kubernetes holds the manifests that install space's containerd
// shim on a cluster; its tests apply them to a real kube-apiserver and run
// the installer's script and containerd drop-in against real tools.
package kubernetes

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/internal/shim"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/kubetest"
)

// handlers are the RuntimeClass handlers the shim serves.
var handlers = []string{"space", "space-gvisor", "space-microvm", "space-native"}

var (
	cpOnce sync.Once
	cp     *kubetest.Cluster
	cpErr  error
)

// controlPlane is one etcd + apiserver for the package (no kubelet: these
// tests only need the API), started on first use and closed by TestMain.
func controlPlane(t *testing.T) *kubetest.Cluster {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := kubetest.FindBinaries()
	testenv.Require(t, "kubernetes", err == nil, fmt.Sprint(err))
	cpOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cp, cpErr = kubetest.Start(ctx, kubetest.Options{})
	})
	if cpErr != nil {
		t.Fatal(cpErr)
	}
	return cp
}

func TestMain(m *testing.M) {
	code := m.Run()
	if err := cp.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "closing the control plane:", err)
		code = 1
	}
	os.Exit(code)
}

// TestManifestsApply applies every manifest here to a real apiserver (its
// validation and admission, not a client-side schema) and reads back what
// it stored.
func TestManifestsApply(t *testing.T) {
	c := controlPlane(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := c.Kubectl(ctx, "apply", "--dry-run=server", "-f", "runtimeclasses.yaml"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// The installer's objects live in a namespace the same file makes,
	// which a dry run does not create: apply for real (a throwaway
	// apiserver).
	if out, err := c.Kubectl(ctx, "apply", "-f", "."); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	out, err := c.Kubectl(ctx, "get", "runtimeclass", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var rcs struct {
		Items []struct {
			Metadata   struct{ Name string }
			Handler    string
			Scheduling struct{ NodeSelector map[string]string }
		}
	}
	if err := json.Unmarshal([]byte(out), &rcs); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, rc := range rcs.Items {
		got = append(got, rc.Handler)
		if rc.Metadata.Name != rc.Handler {
			t.Errorf("RuntimeClass %s has handler %s", rc.Metadata.Name, rc.Handler)
		}
		if rc.Scheduling.NodeSelector["space.dev/runtime"] != "enabled" {
			t.Errorf("RuntimeClass %s: nodeSelector %v, want space.dev/runtime=enabled (as the DaemonSet's)", rc.Metadata.Name, rc.Scheduling.NodeSelector)
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, handlers) {
		t.Errorf("RuntimeClass handlers %v, want %v", got, handlers)
	}
	out, err = c.Kubectl(ctx, "-n", "space-system", "get", "daemonset/space-shim-installer", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var ds struct {
		Spec struct {
			Template struct {
				Spec struct {
					NodeSelector   map[string]string
					InitContainers []struct {
						SecurityContext struct{ Privileged bool }
					}
					Volumes []struct {
						HostPath *struct{ Path string }
					}
				}
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &ds); err != nil {
		t.Fatal(err)
	}
	ps := ds.Spec.Template.Spec
	if ps.NodeSelector["space.dev/runtime"] != "enabled" {
		t.Errorf("DaemonSet nodeSelector %v", ps.NodeSelector)
	}
	if len(ps.InitContainers) != 1 || !ps.InitContainers[0].SecurityContext.Privileged {
		t.Errorf("DaemonSet: want one privileged install container, got %+v", ps.InitContainers)
	}
	var paths []string
	for _, v := range ps.Volumes {
		if v.HostPath != nil {
			paths = append(paths, v.HostPath.Path)
		}
	}
	slices.Sort(paths)
	if want := []string{"/etc/containerd", "/etc/space", "/usr/local/bin"}; !slices.Equal(paths, want) {
		t.Errorf("DaemonSet hostPaths %v, want %v", paths, want)
	}
}

// installerConfig is the installer's ConfigMap as the apiserver stored it.
func installerConfig(t *testing.T) map[string]string {
	t.Helper()
	c := controlPlane(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Kubectl(ctx, "apply", "-f", "installer.yaml"); err != nil {
		t.Fatal(err)
	}
	out, err := c.Kubectl(ctx, "-n", "space-system", "get", "configmap/space-shim", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var cm struct{ Data map[string]string }
	if err := json.Unmarshal([]byte(out), &cm); err != nil {
		t.Fatal(err)
	}
	return cm.Data
}

// TestInstallScript runs the installer's script (as the DaemonSet mounts
// it) against a fake host root, then has the real containerd read the
// drop-in it wrote through an imports line, as a node's containerd would.
func TestInstallScript(t *testing.T) {
	data := installerConfig(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config")
	host := filepath.Join(dir, "host")
	for _, d := range []string{cfg, filepath.Join(host, "etc/containerd")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for k, v := range data {
		if err := os.WriteFile(filepath.Join(cfg, k), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	shimBin := filepath.Join(dir, "shim")
	if err := os.WriteFile(shimBin, []byte("#!/bin/sh\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	mainCfg := filepath.Join(host, "etc/containerd/config.toml")
	if err := os.WriteFile(mainCfg, []byte(fmt.Sprintf("version = 2\nimports = [%q]\n", filepath.Join(host, "etc/containerd/conf.d/*.toml"))), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", filepath.Join(cfg, "install.sh"))
	cmd.Env = append(os.Environ(), "HOST="+host, "SHIM="+shimBin, "CONFIG="+cfg)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("install.sh: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "NOTE") {
		t.Errorf("install.sh warned about an imports line that is there:\n%s", out)
	}
	want := map[string]os.FileMode{"usr/local/bin/containerd-shim-space-v2": 0o755, "etc/containerd/conf.d/space.toml": 0o644}
	for _, h := range handlers {
		want["etc/space/shim/"+h+".json"] = 0o644
	}
	for p, mode := range want {
		st, err := os.Stat(filepath.Join(host, p))
		if err != nil {
			t.Error(err)
		} else if st.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", p, st.Mode().Perm(), mode)
		}
	}
	// The shim itself accepts the configs it is given (with the key file
	// they name standing in).
	for _, h := range handlers {
		b, _ := os.ReadFile(filepath.Join(host, "etc/space/shim", h+".json"))
		var cfg struct {
			APIKeyFile string `json:"api_key_file"`
		}
		if err := json.Unmarshal(b, &cfg); err != nil {
			t.Fatalf("%s.json: %v", h, err)
		}
		key := filepath.Join(dir, "api-key")
		os.WriteFile(key, []byte("k\n"), 0o600)
		b = []byte(strings.Replace(string(b), cfg.APIKeyFile, key, 1))
		p := filepath.Join(dir, h+".json")
		os.WriteFile(p, b, 0o600)
		c, err := shim.LoadConfig(p)
		if err != nil {
			t.Errorf("the shim refuses %s.json: %v", h, err)
		} else if want := map[string]string{"space": "auto", "space-gvisor": "gvisor", "space-microvm": "microvm", "space-native": "native"}[h]; c.Runtime != want {
			t.Errorf("%s.json asks for runtime %q, want %q", h, c.Runtime, want)
		}
	}
	// A second run (a DaemonSet pod restarted) replaces the files.
	if out, err := cmd2(cmd).CombinedOutput(); err != nil {
		t.Fatalf("install.sh again: %v\n%s", err, out)
	}
	leftovers, _ := filepath.Glob(filepath.Join(host, "*/*/*.space-new"))
	if len(leftovers) > 0 {
		t.Errorf("temporary files left: %v", leftovers)
	}

	containerd, err := exec.LookPath("containerd")
	testenv.Require(t, "containerd", err == nil, "Debian's containerd package reads the drop-in")
	dump, err := exec.Command(containerd, "--config", mainCfg, "config", "dump").CombinedOutput()
	if err != nil {
		t.Fatalf("containerd config dump: %v\n%s", err, dump)
	}
	for _, h := range handlers {
		body, ok := runtimeSection(string(dump), h)
		if !ok {
			t.Errorf("containerd config dump has no runtime %s:\n%s", h, dump)
			continue
		}
		for _, w := range []string{`runtime_type = "io.containerd.space.v2"`, `ConfigPath = "/etc/space/shim/` + h + `.json"`, `TypeUrl = "io.containerd.space.v1.Config"`, `"space.dev/*"`} {
			if !strings.Contains(body, w) {
				t.Errorf("containerd's runtime %s lacks %s:\n%s", h, w, body)
			}
		}
	}
}

// runtimeSection is the text of CRI runtime h's table and its options
// table in a containerd config dump, up to the next table of another name.
func runtimeSection(dump, h string) (string, bool) {
	const prefix = `[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.`
	i := strings.Index(dump, prefix+h+`]`)
	if i < 0 {
		return "", false
	}
	rest := dump[i+len(prefix)+len(h)+1:]
	for off := 0; ; {
		j := strings.Index(rest[off:], "[plugins.")
		if j < 0 {
			return rest, true
		}
		if !strings.HasPrefix(rest[off+j:], prefix+h+`.options]`) {
			return rest[:off+j], true
		}
		off += j + 1
	}
}

func cmd2(c *exec.Cmd) *exec.Cmd {
	n := exec.Command(c.Path, c.Args[1:]...)
	n.Env = c.Env
	return n
}

// The image the Dockerfile builds must hold the shim where install.sh
// takes it from.
func TestDockerfileMatchesInstaller(t *testing.T) {
	df, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	ds, err := os.ReadFile("installer.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const shim = "/space/containerd-shim-space-v2"
	if !strings.Contains(string(df), "COPY bin/containerd-shim-space-v2 "+shim+"\n") {
		t.Errorf("Dockerfile does not copy the shim to %s", shim)
	}
	if !strings.Contains(string(ds), "SHIM=${SHIM:-"+shim+"}") {
		t.Errorf("install.sh does not take the shim from %s", shim)
	}
}
