package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The suite's host processes (issue 26): after every test, no runsc,
// QEMU, space-agent or space-gateway process the suite started may still
// run. A process is the suite's when it was not there before the suite
// and it descends from the test binary (now, or at any sample taken while
// the suite ran: a daemonised runsc sandbox or the children of a killed
// `space server` end up under init), or its command line, root or working
// directory names a data directory of the suite's servers (the shared
// one, and every `--data` a descendant was started with). A developer's
// own `space server`, or another test binary running beside this one,
// matches none of these.

// procKey names a process across pid reuse.
type procKey struct {
	pid   int
	start uint64 // clock ticks after boot
}

type procInfo struct {
	key     procKey
	ppid    int
	comm    string
	cmdline []string
	exe     string
	root    string
	cwd     string
}

// watchedKind says whether p is a process the suite must not leave
// behind: by its name, the basename of its argv[0] or of its executable
// (a native agent is started through /proc/self/fd/N).
func watchedKind(p procInfo) bool {
	names := []string{p.comm, filepath.Base(strings.TrimSuffix(p.exe, " (deleted)"))}
	if len(p.cmdline) > 0 {
		names = append(names, filepath.Base(p.cmdline[0]))
	}
	for _, n := range names {
		if strings.HasPrefix(n, "runsc") || strings.HasPrefix(n, "qemu-system-") || n == "space-agent" || n == "space-gateway" {
			return true
		}
	}
	return false
}

// readProc reads what procLeaks needs of pid; false if it is gone.
func readProc(pid int, details bool) (procInfo, bool) {
	dir := "/proc/" + strconv.Itoa(pid)
	b, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return procInfo{}, false
	}
	// pid (comm) state ppid … starttime is field 22; comm may hold
	// spaces and parentheses, so split after the last ')'.
	lp, rp := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if lp < 0 || rp < lp {
		return procInfo{}, false
	}
	f := strings.Fields(string(b[rp+1:]))
	if len(f) < 20 {
		return procInfo{}, false
	}
	ppid, _ := strconv.Atoi(f[1])
	start, _ := strconv.ParseUint(f[19], 10, 64)
	p := procInfo{key: procKey{pid, start}, ppid: ppid, comm: string(b[lp+1 : rp])}
	if details {
		if c, err := os.ReadFile(dir + "/cmdline"); err == nil {
			p.cmdline = strings.Split(strings.TrimRight(string(c), "\x00"), "\x00")
		}
		p.exe, _ = os.Readlink(dir + "/exe")
		p.root, _ = os.Readlink(dir + "/root")
		p.cwd, _ = os.Readlink(dir + "/cwd")
	}
	return p, true
}

// scanProcs returns every process, with details for the watched kinds
// and for descendants of self (whose --data arguments matter).
func scanProcs(self int) map[int]procInfo {
	ents, _ := os.ReadDir("/proc")
	all := make(map[int]procInfo, len(ents))
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, ok := readProc(pid, false); ok {
			all[pid] = p
		}
	}
	for pid, p := range all {
		if descends(all, pid, self) || watchedKind(p) {
			if d, ok := readProc(pid, true); ok && d.key == p.key {
				all[pid] = d
			}
		}
	}
	return all
}

// descends says whether pid is a descendant of anc in all (not anc
// itself).
func descends(all map[int]procInfo, pid, anc int) bool {
	for i := 0; i < 128; i++ {
		p, ok := all[pid]
		if !ok || p.ppid <= 1 {
			return false
		}
		if p.ppid == anc {
			return true
		}
		pid = p.ppid
	}
	return false
}

// procWatch follows the suite's processes from before the first test to
// after the last.
type procWatch struct {
	self   int
	before map[procKey]bool // watched kinds already running

	mu   sync.Mutex
	seen map[procKey]bool // watched kinds seen descending from self
	dirs []string         // data directories of the suite's servers

	stop chan struct{} // nil until start
	done chan struct{}
}

// newProcWatch snapshots the watched processes running now.
func newProcWatch(dirs ...string) *procWatch {
	w := &procWatch{self: os.Getpid(), before: map[procKey]bool{}, seen: map[procKey]bool{}}
	for _, p := range scanProcs(w.self) {
		if watchedKind(p) {
			w.before[p.key] = true
		}
	}
	w.addDirs(dirs...)
	return w
}

// startProcWatch is newProcWatch sampling the suite's processes twice a
// second until finish.
func startProcWatch(dirs ...string) *procWatch {
	w := newProcWatch(dirs...)
	w.stop, w.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(w.done)
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-w.stop:
				return
			case <-t.C:
				w.sample()
			}
		}
	}()
	return w
}

// addDirs marks dirs as the suite's data directories.
func (w *procWatch) addDirs(dirs ...string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range dirs {
		if d != "" && d != "/" && !slices.Contains(w.dirs, d) {
			w.dirs = append(w.dirs, filepath.Clean(d))
		}
	}
}

// sample records the watched processes descending from the test binary
// now, and the --data directories of every descendant.
func (w *procWatch) sample() map[int]procInfo {
	all := scanProcs(w.self)
	var dirs []string
	w.mu.Lock()
	for pid, p := range all {
		if !descends(all, pid, w.self) {
			continue
		}
		if watchedKind(p) && !w.before[p.key] {
			w.seen[p.key] = true
		}
		for i, a := range p.cmdline {
			if v, ok := strings.CutPrefix(a, "--data="); ok {
				dirs = append(dirs, v)
			} else if a == "--data" && i+1 < len(p.cmdline) {
				dirs = append(dirs, p.cmdline[i+1])
			}
		}
	}
	w.mu.Unlock()
	w.addDirs(dirs...)
	return all
}

// leaks returns the suite's watched processes running now.
func (w *procWatch) leaks() []procInfo {
	all := w.sample()
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []procInfo
	for pid, p := range all {
		if !watchedKind(p) || w.before[p.key] {
			continue
		}
		if w.seen[p.key] || descends(all, pid, w.self) || w.mentionsDir(p) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b procInfo) int { return a.key.pid - b.key.pid })
	return out
}

// mentionsDir says whether p's command line, root or working directory
// names one of the suite's data directories (the caller holds w.mu).
func (w *procWatch) mentionsDir(p procInfo) bool {
	for _, d := range w.dirs {
		in := func(s string) bool {
			s = strings.TrimSuffix(s, " (deleted)")
			return s == d || strings.Contains(s, d+"/")
		}
		if in(p.root) || in(p.cwd) || slices.ContainsFunc(p.cmdline, in) {
			return true
		}
	}
	return false
}

// finish stops sampling and waits up to grace for the suite's watched
// processes to exit; it returns those that did not, one line each.
func (w *procWatch) finish(grace time.Duration) []string {
	if w.stop != nil {
		close(w.stop)
		<-w.done
	}
	deadline := time.Now().Add(grace)
	for {
		left := w.leaks()
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			var lines []string
			for _, p := range left {
				cmd := strings.Join(p.cmdline, " ")
				if len(cmd) > 300 {
					cmd = cmd[:300] + "…"
				}
				lines = append(lines, fmt.Sprintf("pid %d (%s, parent %d): %s", p.key.pid, p.comm, p.ppid, cmd))
			}
			return lines
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// TestProcWatch: the leak check names a watched process the suite started
// (a child; an orphan naming a suite data directory), and neither one that
// ran before the suite nor an orphan of somebody else's; once they exit it
// names nothing.
func TestProcWatch(t *testing.T) {
	dir := t.TempDir()
	suiteData := filepath.Join(dir, "suite-data")
	copyAs := func(prog, name string) string {
		src, err := exec.LookPath(prog)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, name)
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
		return dst
	}
	gw, agent := copyAs("sleep", "space-gateway"), copyAs("sh", "space-agent")
	var pids []int
	t.Cleanup(func() {
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	start := func(bin string, args ...string) int {
		cmd := exec.Command(bin, args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go cmd.Wait()
		pids = append(pids, cmd.Process.Pid)
		return cmd.Process.Pid
	}
	// orphan starts shell bin in the background of a shell that exits at
	// once, so init (or a subreaper) adopts it; path is in its command
	// line, as runsc's --root or QEMU's sockets are.
	orphan := func(bin, path string) int {
		out, err := exec.Command("sh", "-c", bin+" -c 'sleep 300; :' "+path+" >/dev/null 2>&1 & echo $!").Output()
		if err != nil {
			t.Fatal(err)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
		if err != nil {
			t.Fatal(err)
		}
		pids = append(pids, pid)
		return pid
	}
	before := start(gw, "300")
	w := newProcWatch(suiteData)
	child := start(gw, "301")
	mine := orphan(agent, suiteData+"/runtimes/x")
	theirs := orphan(agent, filepath.Join(dir, "elsewhere"))
	time.Sleep(200 * time.Millisecond) // let the orphans' exec land
	var got []int
	for _, p := range w.leaks() {
		got = append(got, p.key.pid)
	}
	want := []int{child, mine}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("leaks %v, want %v (child %d, orphan naming the suite's data %d; not %d from before, nor %d of someone else)",
			got, want, child, mine, before, theirs)
	}
	syscall.Kill(child, syscall.SIGKILL)
	syscall.Kill(mine, syscall.SIGKILL)
	if left := w.finish(10 * time.Second); len(left) != 0 {
		t.Fatalf("after they exited: %v", left)
	}
}
