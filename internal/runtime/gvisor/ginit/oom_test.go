package ginit

import (
	"bytes"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"testing"
	"time"
)

func TestMeminfoAndStat(t *testing.T) {
	data := []byte("MemTotal:         131072 kB\nMemFree:           65536 kB\nMemAvailable:      65536 kB\nSwapCached:  7 kB\nCached:  9 kB\n")
	if v, ok := meminfoKB(data, "MemTotal:"); !ok || v != 131072 {
		t.Fatalf("MemTotal %d %v", v, ok)
	}
	if v, ok := meminfoKB(data, "Cached:"); !ok || v != 9 {
		t.Fatalf("Cached %d %v (SwapCached must not match)", v, ok)
	}
	if _, ok := meminfoKB(data, "Nope:"); ok {
		t.Fatal("missing key found")
	}
	if used, err := memoryUsed(); err != nil || used == 0 {
		t.Fatalf("memoryUsed on this host: %d %v", used, err)
	}
	// A command name with spaces and parentheses does not shift fields.
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("needs bash")
	}
	cmd := exec.Command(bash, "-c", "exec -a 'a) (b' sleep 5")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	time.Sleep(100 * time.Millisecond)
	p, ok := readProcStat(cmd.Process.Pid)
	self, ok2 := readProcStat(os.Getpid())
	if !ok || !ok2 || p.rssPgs == 0 || p.start < self.start || p.state == 'Z' {
		t.Fatalf("stat of sleep: %+v %v; self %+v", p, ok, self)
	}
}

// TestVictimIsNewestOfTheLargest runs the guard's choice over this host's
// processes, all excluded but a parent and its two children of nearly the
// same size (any process started meanwhile is excluded before each choice): the newest child is chosen, not the (larger) parent; a hog
// twice their size is chosen over all of them.
func TestVictimIsNewestOfTheLargest(t *testing.T) {
	start := func(args ...string) *exec.Cmd {
		t.Helper()
		c := exec.Command(args[0], args[1:]...)
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		return c
	}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("needs python3")
	}
	// The parent touches 40 MiB, forks two children 50 ms apart that
	// touch nothing more; all sleep.
	parent := start(py, "-c", "import os, time\nb = bytearray(40 << 20)\nfor i in range(2):\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)\n    time.sleep(0.05)\ntime.sleep(30)\n")
	var kids []int
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if kids = childrenOf(t, parent.Process.Pid); len(kids) == 2 {
			break
		}
	}
	if len(kids) != 2 {
		t.Fatalf("children of %d: %v", parent.Process.Pid, kids)
	}
	g := &memoryGuard{limit: 1 << 30, exclude: map[int]bool{}}
	allowed := map[int]bool{parent.Process.Pid: true, kids[0]: true, kids[1]: true}
	restrict := func(extra ...int) {
		for _, e := range extra {
			allowed[e] = true
		}
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			var n int
			if _, err := fmtSscan(e.Name(), &n); err == nil && !allowed[n] {
				g.exclude[n] = true
			}
		}
	}
	restrict()
	newest := kids[0]
	if a, _ := readProcStat(kids[1]); a.start > mustStat(t, kids[0]).start || (a.start == mustStat(t, kids[0]).start && kids[1] > kids[0]) {
		newest = kids[1]
	}
	if pid, _, ok := g.victim(); !ok || pid != newest {
		t.Fatalf("victim %d %v, want the newest child %d (parent %d, children %v)", pid, ok, newest, parent.Process.Pid, kids)
	}
	hog := start(py, "-c", "import time\nb = bytearray(100 << 20)\ntime.sleep(30)\n")
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if p, ok := readProcStat(hog.Process.Pid); ok && p.rssPgs > 90<<20/uint64(os.Getpagesize()) {
			break
		}
	}
	delete(g.exclude, hog.Process.Pid)
	restrict(hog.Process.Pid)
	if pid, _, ok := g.victim(); !ok || pid != hog.Process.Pid {
		t.Fatalf("victim %d %v, want the hog %d", pid, ok, hog.Process.Pid)
	}
	// A negative oom_score_adj does not exempt the hog; a positive one
	// makes a child outweigh it.
	os.WriteFile("/proc/"+itoa(hog.Process.Pid)+"/oom_score_adj", []byte("-1000"), 0)
	restrict()
	if pid, _, _ := g.victim(); pid != hog.Process.Pid {
		t.Fatalf("oom_score_adj -1000 exempted the hog: victim %d", pid)
	}
	os.WriteFile("/proc/"+itoa(kids[0])+"/oom_score_adj", []byte("1000"), 0)
	restrict()
	if pid, _, _ := g.victim(); pid != kids[0] {
		t.Fatalf("oom_score_adj 1000: victim %d, want %d", pid, kids[0])
	}
}

func TestPollInterval(t *testing.T) {
	g := &memoryGuard{limit: 512 << 20}
	if d := g.pollInterval(20 << 20); d < 400*time.Millisecond || d > pollMax {
		t.Errorf("idle 512 MiB sandbox looks every %v", d)
	}
	if d := g.pollInterval(g.limit); d > 200*time.Millisecond {
		t.Errorf("at the limit: every %v", d)
	}
	if d := g.pollInterval(2 * g.limit); d != pollMin {
		t.Errorf("far above the limit: every %v", d)
	}
	if d := (&memoryGuard{limit: 64 << 40}).pollInterval(0); d != pollMax {
		t.Errorf("huge limit: every %v", d)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

func fmtSscan(s string, n *int) (int, error) {
	v, err := strconv.Atoi(s)
	*n = v
	return 1, err
}

func mustStat(t *testing.T, pid int) procInfo {
	t.Helper()
	p, ok := readProcStat(pid)
	if !ok {
		t.Fatalf("no stat for %d", pid)
	}
	return p
}

// childrenOf lists pid's children, oldest first.
func childrenOf(t *testing.T, pid int) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(data, ')')
		f := bytes.Fields(data[i+1:])
		if len(f) > 1 && string(f[1]) == strconv.Itoa(pid) {
			out = append(out, n)
		}
	}
	sort.Ints(out)
	return out
}
