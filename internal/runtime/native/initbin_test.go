package native_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/testenv"
)

// TestInitBinaries starts a sandbox with each init the runtime can use:
// space-nsinit next to the agent binary, and the agent binary's own
// init-native role when there is none. Either way init.log names the init
// that built the sandbox and the process serving is the agent binary.
func TestInitBinaries(t *testing.T) {
	testenv.RequireRoot(t)
	root := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	nsinitBin := filepath.Join(filepath.Dir(agent), native.InitBinaryName)
	if _, err := os.Stat(nsinitBin); err != nil {
		nsinitBin = filepath.Join(t.TempDir(), native.InitBinaryName)
		cmd := exec.Command("go", "build", "-trimpath", "-o", nsinitBin, "github.com/spacehq/space/cmd/space-nsinit")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("building space-nsinit: %v: %s", err, out)
		}
	}
	for _, c := range []struct {
		name     string
		withInit bool
	}{{"space-nsinit", true}, {"space-agent", false}} {
		t.Run(c.name, func(t *testing.T) {
			bins := t.TempDir()
			if err := os.Chmod(bins, 0o755); err != nil {
				t.Fatal(err)
			}
			copyExe(t, agent, filepath.Join(bins, "space-agent"))
			if c.withInit {
				copyExe(t, nsinitBin, filepath.Join(bins, native.InitBinaryName))
			}
			dir := shortTempDir(t)
			if sharedRootfs == "" {
				d, err := os.MkdirTemp("", "nt-rootfs-")
				if err != nil {
					t.Fatal(err)
				}
				sharedRootfs = d
			}
			if err := os.Symlink(sharedRootfs, filepath.Join(dir, "rootfs")); err != nil {
				t.Fatal(err)
			}
			rt, err := runtime.New(native.Name, runtime.Config{DataDir: dir, AgentBinary: filepath.Join(bins, "space-agent"), Logger: testLogger})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { rt.(*native.Runtime).Close() })
			ctx := context.Background()
			inst, err := rt.Create(ctx, runtime.Spec{ID: "initbin", RootFS: root, TemplateDigest: "sha256:base-bookworm-test",
				Limits: api.Limits{CPUs: 1, MemoryMiB: 256, Pids: 256, DiskMiB: 256}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { inst.Destroy(context.Background()) })
			if err := inst.Start(ctx); err != nil {
				t.Fatal(err)
			}
			cl, err := firstHealth(ctx, inst)
			if err != nil {
				t.Fatal(err)
			}
			cl.Close()
			log, err := os.ReadFile(filepath.Join(inst.(interface{ Dir() string }).Dir(), "rw", "init.log"))
			if err != nil {
				t.Fatal(err)
			}
			if want := fmt.Sprintf("sandbox ready (init %s)", c.name); !strings.Contains(string(log), want) {
				t.Fatalf("init.log does not say %q:\n%s", want, log)
			}
			pid := inst.(interface{ Pid() int }).Pid()
			exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
			if err != nil || exe != filepath.Join(bins, "space-agent") {
				t.Fatalf("the sandbox's init runs %q (%v), want the agent binary", exe, err)
			}
		})
	}
}

func copyExe(t *testing.T, from, to string) {
	t.Helper()
	src, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
}
