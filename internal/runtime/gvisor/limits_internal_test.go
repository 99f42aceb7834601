package gvisor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
	"github.com/spacehq/space/internal/testenv"
)

// TestGuardKillsTrustsOnlyRoot: the count is read only from a root-owned,
// not group/world-writable directory and file, with nothing followed;
// whatever sandbox root (IDBase) could have planted reads as 0.
func TestGuardKillsTrustsOnlyRoot(t *testing.T) {
	testenv.RequireRoot(t)
	agent := t.TempDir()
	oom := filepath.Join(agent, oomDirName)
	count := filepath.Join(oom, ginit.OOMCountFile)
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(count, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got := guardKills(agent); got != 0 {
		t.Fatalf("no directory: %d", got)
	}
	if err := os.Mkdir(oom, 0o755); err != nil {
		t.Fatal(err)
	}
	write("3\n")
	if got := guardKills(agent); got != 3 {
		t.Fatalf("root-owned count: %d, want 3", got)
	}
	for _, bad := range []string{"-1\n", "x\n", ""} {
		write(bad)
		if got := guardKills(agent); got != 0 {
			t.Fatalf("count %q read as %d", bad, got)
		}
	}
	write("3\n")
	// A file the sandbox owns.
	if err := os.Chown(count, confine.IDBase, confine.IDBase); err != nil {
		t.Fatal(err)
	}
	if got := guardKills(agent); got != 0 {
		t.Fatalf("sandbox-owned file read as %d", got)
	}
	os.Chown(count, 0, 0)
	// A directory the sandbox owns or may write.
	if err := os.Chown(oom, confine.IDBase, confine.IDBase); err != nil {
		t.Fatal(err)
	}
	if got := guardKills(agent); got != 0 {
		t.Fatalf("sandbox-owned directory read as %d", got)
	}
	os.Chown(oom, 0, 0)
	os.Chmod(oom, 0o777)
	if got := guardKills(agent); got != 0 {
		t.Fatalf("world-writable directory read as %d", got)
	}
	os.Chmod(oom, 0o755)
	// Symlinks, for the directory or the file, are not followed.
	real := filepath.Join(t.TempDir(), "real")
	os.Mkdir(real, 0o755)
	os.WriteFile(filepath.Join(real, ginit.OOMCountFile), []byte("7\n"), 0o644)
	os.RemoveAll(oom)
	if err := os.Symlink(real, oom); err != nil {
		t.Fatal(err)
	}
	if got := guardKills(agent); got != 0 {
		t.Fatalf("symlinked directory read as %d", got)
	}
	os.Remove(oom)
	os.Mkdir(oom, 0o755)
	if err := os.Symlink(filepath.Join(real, ginit.OOMCountFile), count); err != nil {
		t.Fatal(err)
	}
	if got := guardKills(agent); got != 0 {
		t.Fatalf("symlinked file read as %d", got)
	}
}

func TestHostMemoryLimit(t *testing.T) {
	for _, c := range []struct {
		l    api.Limits
		want int64
	}{
		{api.Limits{MemoryMiB: 128, Pids: 64}, (128 + 64 + 16 + 32) << 20},
		{api.Limits{MemoryMiB: 512, Pids: 512}, (512 + 64 + 64 + 256) << 20},
		{api.Limits{MemoryMiB: 1024, Pids: 1 << 20}, (1024 + 64 + 128 + 512) << 20},
	} {
		if got := hostMemoryLimit(c.l); got != c.want {
			t.Errorf("hostMemoryLimit(%+v) = %d MiB, want %d MiB", c.l, got>>20, c.want>>20)
		}
	}
	if env := guardEnv(api.Limits{}); env != nil {
		t.Errorf("guard without a memory limit: %v", env)
	}
}
