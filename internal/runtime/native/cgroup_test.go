package native

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/testenv"
)

// TestCgroupV1 checks what a sandbox's limits become on a v1 host; the
// cgroup mechanics themselves are cgroupfs's tests.
func TestCgroupV1(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.Require(t, "cgroup-v1", cgroupVersion() == 1 && checkCgroups() == nil, "host is not cgroup v1/hybrid")
	id := "sb-cgtest-v1"
	cg := newCgroup(id)
	if err := cg.Create(cgroupLimits(api.Limits{CPUs: 0.5, MemoryMiB: 256, Pids: 100, DiskMiB: 64})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cg.Kill(context.Background()); cg.Remove() })
	mem, _ := cg.Dir("memory")
	if n, _ := cgroupfs.ReadInt(filepath.Join(mem, "memory.limit_in_bytes")); n != 256<<20 {
		t.Fatalf("memory limit %d", n)
	}
	cpu, _ := cg.Dir("cpu")
	if n, _ := cgroupfs.ReadInt(filepath.Join(cpu, "cpu.cfs_quota_us")); n != 50000 {
		t.Fatalf("cpu quota %d", n)
	}
	if d, ok := cg.Dir("devices"); ok {
		list, _ := os.ReadFile(filepath.Join(d, "devices.list"))
		if strings.Contains(string(list), "a *:* rwm") || !strings.Contains(string(list), "c 136:* rwm") {
			t.Fatalf("devices.list:\n%s", list)
		}
	}
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go cmd.Wait()
	t.Cleanup(func() { cmd.Process.Kill() })
	if err := cg.AddProc(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if s, err := cgroupStats(cg); err != nil || s.Pids != 1 {
		t.Fatalf("stats %+v, %v", s, err)
	}
	if removeStaleCgroup(cg, 0) {
		t.Fatal("a cgroup with a process was removed as stale")
	}
	if err := cg.Kill(context.Background()); err != nil {
		t.Fatal(err)
	}
	if removeStaleCgroup(cg, time.Hour) {
		t.Fatal("a new cgroup was removed as stale")
	}
	if !removeStaleCgroup(cg, 0) {
		t.Fatal("an empty old cgroup was not removed")
	}
	for _, d := range cg.Paths() {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("%s still exists", d)
		}
	}
}
