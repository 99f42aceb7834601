package cgroupfs

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/testenv"
)

// TestStartIn starts children in a group, v1 (the host's hierarchies, when
// it has them) and v2 (the host's unified mount), and checks each is a
// member of every hierarchy from the start while no thread of this process
// is left in the group.
func TestStartIn(t *testing.T) {
	testenv.RequireRoot(t)
	ctrls := []string{"memory", "pids", "cpu", "cpuacct", "freezer", "devices"}
	t.Run("host", func(t *testing.T) {
		g := Host().Group("space-cgroupfs-test", fmt.Sprintf("s-%d", os.Getpid()), ctrls)
		if err := g.Create(Limits{MemoryBytes: 64 << 20, Pids: 64, Devices: []string{"c 1:3 rwm"}}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			g.Kill(context.Background())
			g.Remove()
			for _, d := range Host().Group("space-cgroupfs-test", "x", ctrls).Paths() {
				unix.Rmdir(filepath.Dir(d))
			}
		})
		checkStartIn(t, g)
	})
	t.Run("unified", func(t *testing.T) {
		root := Root
		if !Host().Unified {
			root = filepath.Join(Root, "unified")
			var st unix.Statfs_t
			err := unix.Statfs(root, &st)
			testenv.Require(t, "cgroup2", err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC, "no cgroup2 mount at "+root)
		}
		g := Layout{Root: root, Unified: true}.Group("space-cgroupfs-test", fmt.Sprintf("s-%d", os.Getpid()), nil)
		dir, _ := g.Dir("")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { g.Kill(context.Background()); os.Remove(dir); os.Remove(filepath.Dir(dir)) })
		checkStartIn(t, g)
	})
}

func checkStartIn(t *testing.T, g *Group) {
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	// Enough starts that the starting goroutine lands on several threads.
	for i := 0; i < 20; i++ {
		cmd := &exec.Cmd{Path: "/bin/sleep", Args: []string{"sleep", "60"}, Stdin: null, Stdout: null, Stderr: null}
		if err := g.StartIn(cmd); err != nil {
			t.Fatal(err)
		}
		pid := cmd.Process.Pid
		listing, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range g.Paths() {
			if !strings.Contains(string(listing), ":"+groupPathIn(d)+"\n") {
				t.Fatalf("child %d is not in %s:\n%s", pid, d, listing)
			}
			members := "cgroup.threads"
			if !g.unified {
				members = "tasks"
			}
			b, err := os.ReadFile(filepath.Join(d, members))
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range strings.Fields(string(b)) {
				if f != strconv.Itoa(pid) {
					t.Fatalf("%s has thread %s besides the child %d (a thread of this process stayed?)", d, f, pid)
				}
			}
		}
		cmd.Process.Kill()
		cmd.Wait()
	}
	// No thread of this process is in the group.
	tasks, _ := os.ReadDir("/proc/self/task")
	for _, tk := range tasks {
		b, _ := os.ReadFile(filepath.Join("/proc/self/task", tk.Name(), "cgroup"))
		for _, d := range g.Paths() {
			if strings.Contains(string(b), ":"+groupPathIn(d)+"\n") {
				t.Fatalf("thread %s of this process is in %s", tk.Name(), d)
			}
		}
	}
}

// groupPathIn is a group directory's path as /proc/…/cgroup shows it: the
// last two elements (parent/name), which is how every test group is named.
func groupPathIn(dir string) string {
	return "/" + filepath.Base(filepath.Dir(dir)) + "/" + filepath.Base(dir)
}
