package native

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/testenv"
)

// testCgroupKillFreeze runs the controller-independent part of a cgroup
// implementation: join, freeze, thaw, kill everything, remove.
func testCgroupKillFreeze(t *testing.T, cg cgroup) {
	ctx := context.Background()
	var cmds []*exec.Cmd
	for i := 0; i < 3; i++ {
		// The shell forks only once stdin closes, after it joined.
		cmd := exec.Command("sh", "-c", "read x; sleep 600 & sleep 600 & wait")
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go cmd.Wait()
		cmds = append(cmds, cmd)
		if err := cg.addProc(cmd.Process.Pid); err != nil {
			t.Fatal(err)
		}
		stdin.Close()
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			c.Process.Kill()
		}
	})
	// Children forked after joining are in the cgroup too.
	if err := poll(ctx, "children", func() (bool, error) {
		p, err := cg.procs()
		return len(p) >= 9, err
	}); err != nil {
		t.Fatal(err)
	}
	if err := cg.freeze(ctx); err != nil {
		t.Fatalf("freeze: %v", err)
	}
	if err := cg.thaw(ctx); err != nil {
		t.Fatalf("thaw: %v", err)
	}
	if err := cg.freeze(ctx); err != nil {
		t.Fatalf("freeze: %v", err)
	}
	// kill must work on a frozen cgroup.
	if err := cg.kill(ctx); err != nil {
		t.Fatalf("kill: %v", err)
	}
	if p, _ := cg.procs(); len(p) != 0 {
		t.Fatalf("processes left after kill: %v", p)
	}
	if err := cg.remove(); err != nil {
		t.Fatalf("remove: %v", err)
	}
	for _, d := range cg.paths() {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("%s still exists", d)
		}
	}
}

func TestCgroupV1(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.Require(t, "cgroup-v1", cgroupVersion() == 1 && checkCgroups() == nil, "host is not cgroup v1/hybrid")
	id := "sb-cgtest-v1"
	cg := newCgroup(id)
	if err := cg.create(api.Limits{CPUs: 0.5, MemoryMiB: 256, Pids: 100, DiskMiB: 64}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cg.kill(context.Background()); cg.remove() })
	mem := cg.(*cgroupV1).dirs["memory"]
	if n, _ := cgroupfs.ReadInt(filepath.Join(mem, "memory.limit_in_bytes")); n != 256<<20 {
		t.Fatalf("memory limit %d", n)
	}
	if n, _ := cgroupfs.ReadInt(filepath.Join(cg.(*cgroupV1).dirs["cpu"], "cpu.cfs_quota_us")); n != 50000 {
		t.Fatalf("cpu quota %d", n)
	}
	if d, ok := cg.(*cgroupV1).dirs["devices"]; ok {
		list, _ := os.ReadFile(filepath.Join(d, "devices.list"))
		if strings.Contains(string(list), "a *:* rwm") || !strings.Contains(string(list), "c 136:* rwm") {
			t.Fatalf("devices.list:\n%s", list)
		}
	}
	testCgroupKillFreeze(t, cg)
}

// TestCgroupV2 exercises the v2 implementation where this host has a
// cgroup2 mount: without controllers on a hybrid host, but cgroup.kill,
// cgroup.freeze and cgroup.events work on any v2 cgroup.
func TestCgroupV2(t *testing.T) {
	testenv.RequireRoot(t)
	root := cgroupRoot
	var st unix.Statfs_t
	if cgroupVersion() != 2 {
		root = filepath.Join(cgroupRoot, "unified")
		if err := unix.Statfs(root, &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
			t.Skip("no cgroup2 mount")
		}
	}
	dir := filepath.Join(root, "space-test", "sb-cgtest-v2")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir); os.Remove(filepath.Dir(dir)) })
	if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err != nil {
		t.Skip("kernel without cgroup.kill")
	}
	testCgroupKillFreeze(t, &cgroupV2{dir: dir})
}
