package cgroupfs

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/testenv"
)

func TestCPUQuotaUS(t *testing.T) {
	for _, c := range []struct {
		cpus float64
		want int64
	}{
		{0.5, 50000},
		{1.5, 150000},
		{0.7, 70000}, // 0.7*100000 is 70000.00000000001 in float64
		{2, 200000},
		{1.0 / 3, 33334}, // rounded up, never tighter than asked
		{0.0123, 1230},
		{0.012345, 1235},
		{0.01, MinCPUQuotaUS},
		{0.001, MinCPUQuotaUS}, // below the kernel's minimum
		{1e-12, MinCPUQuotaUS},
	} {
		if got := CPUQuotaUS(c.cpus); got != c.want {
			t.Errorf("CPUQuotaUS(%v) = %d, want %d", c.cpus, got, c.want)
		}
	}
	// Every quota a user can write with two decimals is exact.
	for i := 1; i <= 100000; i++ {
		if got := CPUQuotaUS(float64(i) / 100); got != int64(i)*1000 {
			t.Fatalf("CPUQuotaUS(%v) = %d, want %d", float64(i)/100, got, i*1000)
		}
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Errorf("%v", err)
	}
	return strings.TrimSpace(string(b))
}

// TestLayoutV1 builds a scratch hybrid-style tree: per-controller
// hierarchies, cpu and cpuacct co-mounted behind symlinks, no freezer.
func TestLayoutV1(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"memory", "pids", "cpu,cpuacct", "devices"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, l := range []string{"cpu", "cpuacct"} {
		if err := os.Symlink("cpu,cpuacct", filepath.Join(root, l)); err != nil {
			t.Fatal(err)
		}
	}
	l := Layout{Root: root}
	g := l.Group("space", "sb-1", []string{"memory", "pids", "cpu", "cpuacct", "freezer", "devices"})
	want := []string{
		filepath.Join(root, "cpu,cpuacct", "space", "sb-1"),
		filepath.Join(root, "devices", "space", "sb-1"),
		filepath.Join(root, "memory", "space", "sb-1"),
		filepath.Join(root, "pids", "space", "sb-1"),
	}
	if got := g.Paths(); !slices.Equal(got, want) {
		t.Fatalf("Paths = %v, want %v", got, want)
	}
	if d, _ := g.Dir("cpuacct"); d != want[0] {
		t.Errorf("cpuacct dir %s", d)
	}
	if _, ok := g.Dir("freezer"); ok {
		t.Error("a controller the host lacks has a directory")
	}
	if err := g.Create(Limits{MemoryBytes: 1 << 30, Pids: 128, CPUs: 1.5, Devices: []string{"c 1:3 rwm"}, CPUWeight: BackgroundCPUWeight}); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(want[0], "cpu.shares")); got != "10" {
		t.Errorf("background cpu.shares = %q, want 10", got)
	}
	if err := g.SetCPUWeight(DefaultCPUWeight); err != nil {
		t.Fatal(err)
	}
	if err := g.SetCPUWeight(0); err == nil {
		t.Error("SetCPUWeight(0) accepted")
	}
	for file, want := range map[string]string{
		filepath.Join(want[0], "cpu.shares"):            "1024",
		filepath.Join(want[2], "memory.limit_in_bytes"): "1073741824",
		filepath.Join(want[2], "memory.swappiness"):     "0",
		filepath.Join(want[3], "pids.max"):              "128",
		filepath.Join(want[0], "cpu.cfs_period_us"):     "100000",
		filepath.Join(want[0], "cpu.cfs_quota_us"):      "150000",
		filepath.Join(want[1], "devices.deny"):          "a",
		filepath.Join(want[1], "devices.allow"):         "c 1:3 rwm",
	} {
		if got := readFile(t, file); got != want {
			t.Errorf("%s = %q, want %q", file, got, want)
		}
	}
	if err := l.Group("space", "sb-2", []string{"memory"}).Create(Limits{}); err != nil {
		t.Fatal(err)
	}
	names := l.Names("space", []string{"memory", "pids"})
	slices.Sort(names)
	if !slices.Equal(names, []string{"sb-1", "sb-2"}) {
		t.Errorf("Names = %v", names)
	}
}

// TestLayoutV2 checks what a unified host's cgroup gets, on a scratch tree.
func TestLayoutV2(t *testing.T) {
	root := t.TempDir()
	l := Layout{Root: root, Unified: true}
	g := l.Group("space-jail", "sb", []string{"memory"})
	dir := filepath.Join(root, "space-jail", "sb")
	if got := g.Paths(); !slices.Equal(got, []string{dir}) {
		t.Fatalf("Paths = %v", got)
	}
	if d, ok := g.Dir("freezer"); !ok || d != dir {
		t.Errorf("Dir(freezer) = %s %v", d, ok)
	}
	if err := g.Create(Limits{MemoryBytes: 1 << 30, Pids: 128, CPUs: 1.5, Devices: []string{"c 1:3 rwm"}, CPUWeight: 7}); err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{
		filepath.Join(dir, "cpu.weight"):                            "7",
		filepath.Join(root, "cgroup.subtree_control"):               "+memory +pids +cpu",
		filepath.Join(root, "space-jail", "cgroup.subtree_control"): "+memory +pids +cpu",
		filepath.Join(dir, "memory.max"):                            "1073741824",
		filepath.Join(dir, "pids.max"):                              "128",
		filepath.Join(dir, "cpu.max"):                               "150000 100000",
	} {
		if got := readFile(t, file); got != want {
			t.Errorf("%s = %q, want %q", file, got, want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "devices.allow")); err == nil {
		t.Error("device rules written on v2")
	}
	if names := l.Names("space-jail", nil); !slices.Equal(names, []string{"sb"}) {
		t.Errorf("Names = %v", names)
	}
}

// exercise puts three shells with two children each into g, freezes and
// thaws it where it can, kills everything (frozen, where it can) and
// removes it.
func exercise(t *testing.T, g *Group) {
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
		if err := g.AddProc(cmd.Process.Pid); err != nil {
			t.Fatal(err)
		}
		stdin.Close()
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			c.Process.Kill()
		}
	})
	// Children forked after joining are in the group too.
	if err := poll(ctx, "children", func() (bool, error) {
		p, err := g.Procs()
		return len(p) >= 9, err
	}); err != nil {
		t.Fatal(err)
	}
	if g.canFreeze() {
		if err := g.Freeze(ctx); err != nil {
			t.Fatalf("freeze: %v", err)
		}
		if err := g.Thaw(ctx); err != nil {
			t.Fatalf("thaw: %v", err)
		}
		// Kill must work on a frozen group.
		if err := g.Freeze(ctx); err != nil {
			t.Fatalf("freeze: %v", err)
		}
	}
	if err := g.Kill(ctx); err != nil {
		t.Fatalf("kill: %v", err)
	}
	if p, _ := g.Procs(); len(p) != 0 {
		t.Fatalf("processes left after kill: %v", p)
	}
	if err := g.Remove(); err != nil {
		t.Fatalf("remove: %v", err)
	}
	for _, d := range g.Paths() {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("%s still exists", d)
		}
	}
	if err := g.Kill(ctx); err != nil {
		t.Errorf("kill of a removed group: %v", err)
	}
	if err := g.Remove(); err != nil {
		t.Errorf("remove of a removed group: %v", err)
	}
}

// TestGroupHost creates a real cgroup on this host (v1 or v2), sets
// limits, reads them back, puts processes in, kills and removes it.
func TestGroupHost(t *testing.T) {
	testenv.RequireRoot(t)
	parent := "space-cgroupfs-test"
	name := fmt.Sprintf("g-%d", os.Getpid())
	l := Host()
	ctrls := []string{"memory", "pids", "cpu", "cpuacct", "freezer", "devices"}
	g := l.Group(parent, name, ctrls)
	_, ok := g.Dir("memory")
	testenv.Require(t, "memory-cgroup", ok, "no memory cgroup hierarchy on this host")
	if err := g.Create(Limits{MemoryBytes: 64 << 20, Pids: 64, CPUs: 0.25, Devices: []string{"c 1:3 rwm", "c 1:5 rwm"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		g.Kill(context.Background())
		g.Remove()
		for _, d := range l.Group(parent, "x", ctrls).Paths() {
			unix.Rmdir(filepath.Dir(d))
		}
	})
	dir := func(c string) string { d, _ := g.Dir(c); return d }
	if l.Unified {
		for file, want := range map[string]string{
			"memory.max": "67108864", "pids.max": "64", "cpu.max": "25000 100000",
		} {
			if got := readFile(t, filepath.Join(dir(""), file)); got != want {
				t.Errorf("%s = %q, want %q", file, got, want)
			}
		}
	} else {
		if n, _ := ReadInt(filepath.Join(dir("memory"), "memory.limit_in_bytes")); n != 64<<20 {
			t.Errorf("memory limit %d", n)
		}
		if n, _ := ReadInt(filepath.Join(dir("pids"), "pids.max")); n != 64 {
			t.Errorf("pids limit %d", n)
		}
		if n, _ := ReadInt(filepath.Join(dir("cpu"), "cpu.cfs_quota_us")); n != 25000 {
			t.Errorf("cpu quota %d", n)
		}
		if d, ok := g.Dir("devices"); ok {
			list := readFile(t, filepath.Join(d, "devices.list"))
			if strings.Contains(list, "a *:* rwm") || !strings.Contains(list, "c 1:5 rwm") {
				t.Errorf("devices.list:\n%s", list)
			}
		}
		// Raising the limit (gVisor does after runsc applied it) works
		// with memory+swap accounting on.
		if err := g.SetMemoryLimit(128 << 20); err != nil {
			t.Errorf("raising the memory limit: %v", err)
		}
		if err := g.SetMemoryLimit(96 << 20); err != nil {
			t.Errorf("lowering the memory limit: %v", err)
		}
		if n, _ := ReadInt(filepath.Join(dir("memory"), "memory.limit_in_bytes")); n != 96<<20 {
			t.Errorf("memory limit %d after raising and lowering", n)
		}
	}
	if names := l.Names(parent, ctrls); !slices.Contains(names, name) {
		t.Errorf("Names = %v, no %s", names, name)
	}
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go cmd.Wait()
	if err := g.AddProc(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if n, err := g.Pids(); err != nil || n < 1 {
		t.Errorf("Pids = %d, %v", n, err)
	}
	if _, err := g.MemoryBytes(); err != nil {
		t.Errorf("MemoryBytes: %v", err)
	}
	if _, err := g.OOMKills(); err != nil {
		t.Errorf("OOMKills: %v", err)
	}
	if _, err := g.CPUNanos(); err != nil {
		t.Errorf("CPUNanos: %v", err)
	}
	exercise(t, g)
	if _, err := g.MemoryBytes(); !os.IsNotExist(err) {
		t.Errorf("MemoryBytes of a removed group: %v", err)
	}
}

// TestGroupUnifiedKill runs the kill path of a v2 group where this host
// has a cgroup2 mount: without controllers on a hybrid host, but
// cgroup.kill, cgroup.freeze and cgroup.events work on any v2 cgroup.
func TestGroupUnifiedKill(t *testing.T) {
	testenv.RequireRoot(t)
	root := Root
	if !Host().Unified {
		root = filepath.Join(Root, "unified")
		var st unix.Statfs_t
		err := unix.Statfs(root, &st)
		testenv.Require(t, "cgroup2", err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC, "no cgroup2 mount at "+root)
	}
	g := Layout{Root: root, Unified: true}.Group("space-cgroupfs-test", fmt.Sprintf("k-%d", os.Getpid()), nil)
	dir, _ := g.Dir("")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir); os.Remove(filepath.Dir(dir)) })
	_, err := os.Stat(filepath.Join(dir, "cgroup.kill"))
	testenv.Require(t, "cgroup.kill", err == nil, "kernel without cgroup.kill")
	exercise(t, g)
}

// TestOOMCounter reads the count through the kept file as it changes,
// agrees with OOMKills, and reopens after the group is made again.
func TestOOMCounter(t *testing.T) {
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "memory"), 0o755); err != nil {
		t.Fatal(err)
	}
	g := Layout{Root: root}.Group("space", "sb-1", []string{"memory"})
	dir, _ := g.Dir("memory")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "memory.oom_control")
	set := func(n int) {
		t.Helper()
		// In place, as the kernel's file changes under an open descriptor.
		f, err := os.OpenFile(file, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(f, "oom_kill_disable 0\nunder_oom 0\noom_kill %d\n", n)
		f.Close()
	}
	set(0)
	c := g.OOMCounter()
	defer c.Close()
	for _, n := range []int{0, 3, 12} {
		set(n)
		got, err := c.Read()
		want, err2 := g.OOMKills()
		if err != nil || err2 != nil || got != int64(n) || want != int64(n) {
			t.Fatalf("after %d kills: Read = %d, %v; OOMKills = %d, %v", n, got, err, want, err2)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	set(5) // read again after Close: reopened
	if got, err := c.Read(); err != nil || got != 5 {
		t.Fatalf("after Close: %d, %v", got, err)
	}
	if err := os.Remove(file); err != nil {
		t.Fatal(err)
	}
	if _, err := (Layout{Root: root}).Group("space", "sb-1", nil).OOMCounter().Read(); err != nil {
		t.Errorf("no memory controller: %v, want 0 and no error", err)
	}
}
