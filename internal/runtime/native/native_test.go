package native_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/runtime/runtimetest"
	"github.com/spacehq/space/internal/testenv"
)

// shortTempDir keeps DataDir short: the agent socket path must fit in
// sockaddr_un, and t.TempDir paths include the (long) test name.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nt-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// sharedRootfs is one DataDir/rootfs cache for every subtest, so the
// template is uid-shifted once per test binary rather than once per runtime.
var sharedRootfs string

func harness(t *testing.T) runtimetest.Harness {
	testenv.RequireRoot(t)
	root := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	if sharedRootfs == "" {
		dir, err := os.MkdirTemp("", "nt-rootfs-")
		if err != nil {
			t.Fatal(err)
		}
		// Sandbox uids must be able to search it.
		if err := os.Chmod(dir, 0o711); err != nil {
			t.Fatal(err)
		}
		sharedRootfs = dir
	}
	return runtimetest.Harness{
		RootFS:         root,
		TemplateDigest: "sha256:base-bookworm-test",
		New: func(t *testing.T) runtime.Runtime {
			dir := shortTempDir(t)
			// Share the shifted rootfs across subtests through a symlink.
			if err := os.Symlink(sharedRootfs, filepath.Join(dir, "rootfs")); err != nil {
				t.Fatal(err)
			}
			rt, err := runtime.New(native.Name, runtime.Config{DataDir: dir, AgentBinary: agent})
			if err != nil {
				t.Fatal(err)
			}
			return rt
		},
	}
}

func TestConformance(t *testing.T) {
	runtimetest.Run(t, harness(t))
}
