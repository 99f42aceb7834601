package ginit

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// The memory guard is the sandbox's OOM killer. gVisor does not enforce a
// memory limit inside the sandbox (its cgroupfs memory files are stubs),
// and the host's memory cgroup cannot stand in for one: every page of the
// sandbox is the sentry's, so a host OOM kill picks the sentry (or a
// systrap stub, whose death makes the sentry kill itself) and the whole
// sandbox dies. So the host gives its cgroup headroom above the limit, and
// this guard, running in the outer init stage — root of the sentry's root
// user namespace, outside the agent's pid namespace, out of reach of
// anything the sandbox runs — kills a process inside when the sentry's own
// memory accounting reaches the sandbox's limit, as Linux's memory cgroup
// OOM killer would.
const (
	// EnvMemoryLimit is the sandbox's memory limit in bytes; no guard
	// runs without it.
	EnvMemoryLimit = "SPACE_GINIT_MEMORY"
	// EnvOOMDir is a directory on a host mount where the guard keeps its
	// kill count, in the file OOMCountFile, for the host's Stats. The
	// guard makes it, owned by the sentry's root: the sandbox cannot write
	// there, and the host trusts only a directory and file owned by root.
	EnvOOMDir    = "SPACE_GINIT_OOM_DIR"
	OOMCountFile = "kills"
)

// Each look costs a wake-up of the guard, which under gVisor is far dearer
// than on Linux (measured here: ~5 ms of CPU per wake-up on a loaded host,
// in Python as in Go), so the guard looks as rarely as it safely can: the
// next look comes before the sandbox could have allocated its way through
// what is left below the limit plus the slack the host's headroom keeps
// for the guard (limit/8, limits.go) at allocRate, several times what a
// sandbox reaches here (a Python allocating 16 MiB chunks: ~70 MiB/s on a
// loaded host; page faults go through the sentry). Beyond that slack the
// host limit still has 64 MiB and 512 KiB per task before it kills.
const (
	allocRate = 512 << 20 // bytes per second
	pollMin   = 5 * time.Millisecond
	pollMax   = time.Second
	// victimWait bounds the wait for a killed process to release its
	// memory before the guard looks again.
	victimWait = 500 * time.Millisecond
	// settleWait bounds the wait for a big victim's memory to show as
	// released (settle); settleSlack is the least growth settle takes for
	// more allocation (gVisor's allocation unit).
	settleWait  = 2 * time.Second
	settleSlack = 2 << 20
)

// pollInterval is how long the guard may sleep with used bytes in use.
func (g *memoryGuard) pollInterval(used uint64) time.Duration {
	room := g.limit + g.limit/8
	if used >= room {
		return pollMin
	}
	d := time.Duration(float64(room-used) / allocRate * float64(time.Second))
	return min(max(d, pollMin), pollMax)
}

type memoryGuard struct {
	limit   uint64
	exclude map[int]bool // this process and the agent
	dir     string       // where the count goes; "" for nowhere
	kills   int64
}

// newMemoryGuard makes the guard and writes its count (0) into dir, before
// the agent exists, so nothing in the sandbox races that first write.
func newMemoryGuard(limit uint64, dir string) *memoryGuard {
	g := &memoryGuard{limit: limit, exclude: map[int]bool{os.Getpid(): true}, dir: dir}
	g.report()
	return g
}

// start runs the guard for the rest of the process's life. agentPid is
// never killed: the sandbox without its agent is unusable, and the agent's
// own memory is small and bounded.
func (g *memoryGuard) start(agentPid int) {
	g.exclude[agentPid] = true
	go g.run()
}

// report writes the kill count to dir/OOMCountFile. It opens the file
// anew each time rather than keeping a descriptor: a checkpointed sandbox
// may be restored (or forked) onto another host directory, where a kept
// descriptor could not be reopened. The sandbox can rename entries of
// the agent's directory, so dir is replaced when it is not the guard's
// own (root-owned, not group/world writable), and nothing is followed.
func (g *memoryGuard) report() {
	if g.dir == "" {
		return
	}
	if err := g.writeCount(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: gvisor init: OOM count:", err)
	}
}

func (g *memoryGuard) writeCount() error {
	dfd, err := unix.Open(g.dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		dfd = -1
	} else {
		var st unix.Stat_t
		if unix.Fstat(dfd, &st) != nil || st.Uid != 0 || st.Mode&0o022 != 0 {
			unix.Close(dfd)
			dfd = -1
		}
	}
	if dfd < 0 {
		if err := os.RemoveAll(g.dir); err != nil {
			return err
		}
		if err := unix.Mkdir(g.dir, 0o755); err != nil {
			return err
		}
		if dfd, err = unix.Open(g.dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); err != nil {
			return err
		}
	}
	defer unix.Close(dfd)
	// Write a new file and rename it over the count: the host never reads
	// a half-written number.
	const tmp = ".kills.tmp"
	_ = unix.Unlinkat(dfd, tmp, 0)
	fd, err := unix.Openat(dfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return err
	}
	b := strconv.AppendInt(nil, g.kills, 10)
	_, err = unix.Write(fd, append(b, '\n'))
	unix.Close(fd)
	if err != nil {
		return err
	}
	return unix.Renameat(dfd, tmp, dfd, OOMCountFile)
}

func (g *memoryGuard) run() {
	for {
		used, err := memoryUsed()
		if err != nil {
			time.Sleep(time.Second)
			continue
		}
		if used >= g.limit {
			if pid, start, ok := g.victim(); ok {
				// Counted before the kill, as Linux counts oom_kill: the
				// victim's exit status reaches the host through the agent
				// at once, and the host's Stats must already show it.
				g.kills++
				g.report()
				// Whether the victim's release alone brings the sandbox
				// back under the limit: read before the kill.
				vp, _ := readProcStat(pid)
				enough := vp.rssPgs*uint64(os.Getpagesize()) >= used-g.limit
				if killProcess(pid, start) {
					waitGone(pid, start, victimWait)
					if enough {
						g.settle(used, settleWait)
					}
					continue
				}
				g.kills--
				g.report()
			}
		}
		time.Sleep(g.pollInterval(used))
	}
}

// settle waits, after a kill at used bytes of a victim big enough to bring
// the sandbox under the limit, until the accounting shows its memory
// released (or d passes). On a loaded host the release lags the exit by
// far more than a tick, and looking again too early kills a second,
// innocent process (the next command's shell) for memory the first still
// seems to hold. Growth of more than settleSlack above the lowest reading
// since the kill is the sandbox still allocating: the guard looks at once.
func (g *memoryGuard) settle(used uint64, d time.Duration) {
	slack := max(settleSlack, g.limit/32)
	deadline := time.Now().Add(d)
	low := used
	for time.Now().Before(deadline) {
		now, err := memoryUsed()
		if err != nil || now < g.limit || now > low+slack {
			return
		}
		low = min(low, now)
		time.Sleep(pollMin)
	}
}

// memoryUsed is the sentry's accounting of the sandbox's memory (anonymous,
// page cache, tmpfs, its own). MemTotal − MemFree says it only up to the
// limit: the sentry reports MemTotal as the limit and clamps MemFree at 0.
// AnonPages + Cached is the same sum without the clamp, so an overrun reads
// as how far over it is (what settle and the victim's sufficiency need).
func memoryUsed() (uint64, error) {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	total, ok1 := meminfoKB(data, "MemTotal:")
	free, ok2 := meminfoKB(data, "MemFree:")
	if !ok1 || !ok2 {
		return 0, errors.New("/proc/meminfo without MemTotal/MemFree")
	}
	used := uint64(0)
	if free <= total {
		used = total - free
	}
	anon, ok1 := meminfoKB(data, "AnonPages:")
	cached, ok2 := meminfoKB(data, "Cached:")
	if ok1 && ok2 {
		used = max(used, anon+cached)
	}
	return used * 1024, nil
}

// meminfoKB reads the value of the line starting with key ("Cached:" must
// not match "SwapCached:").
func meminfoKB(data []byte, key string) (uint64, bool) {
	i := 0
	if !bytes.HasPrefix(data, []byte(key)) {
		i = bytes.Index(data, []byte("\n"+key))
		if i < 0 {
			return 0, false
		}
		i++
	}
	f := bytes.Fields(data[i+len(key):])
	if len(f) == 0 {
		return 0, false
	}
	n, err := strconv.ParseUint(string(f[0]), 10, 64)
	return n, err == nil
}

// procInfo is what the guard reads from /proc/<pid>/stat.
type procInfo struct {
	pid    int
	state  byte
	start  uint64 // start time in clock ticks since boot
	rssPgs uint64
}

func readProcStat(pid int) (procInfo, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procInfo{}, false
	}
	// The command name is in parentheses and may hold anything, spaces
	// and parentheses included: the fields start after the last ')'.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return procInfo{}, false
	}
	f := bytes.Fields(data[i+1:])
	// f[0] is field 3 (state); starttime is field 22, rss field 24.
	if len(f) < 22 {
		return procInfo{}, false
	}
	start, err1 := strconv.ParseUint(string(f[19]), 10, 64)
	rss, err2 := strconv.ParseUint(string(f[21]), 10, 64)
	if err1 != nil || err2 != nil || len(f[0]) != 1 {
		return procInfo{}, false
	}
	return procInfo{pid: pid, state: f[0][0], start: start, rssPgs: rss}, true
}

// victimShare: among the processes whose badness is at least this share of
// the largest, the guard kills the newest. Linux kills the largest (the
// newest on a tie). Under gVisor a forked child breaks copy-on-write in
// 2 MiB units, so a parent and its children weigh nearly the same while
// the children are what grew: killing the newest of the near-largest frees
// what the latest fork cost and spares the long-running parent (a shell, a
// server's master process), while a single hog still stands alone.
const victimShare = 0.75

// victim picks the process to kill, by Linux's badness (resident memory
// plus oom_score_adj's share of the limit). A negative oom_score_adj counts
// as 0: gVisor lets any process lower its own, which Linux allows only with
// CAP_SYS_RESOURCE, so a process could otherwise exempt itself.
func (g *memoryGuard) victim() (pid int, start uint64, ok bool) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, 0, false
	}
	type cand struct {
		procInfo
		score float64
	}
	var cands []cand
	best := 0.0
	page := float64(os.Getpagesize())
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil || g.exclude[n] {
			continue
		}
		p, ok := readProcStat(n)
		if !ok || p.state == 'Z' || p.state == 'X' || p.rssPgs == 0 {
			continue
		}
		score := float64(p.rssPgs) * page
		if b, err := os.ReadFile("/proc/" + e.Name() + "/oom_score_adj"); err == nil {
			if adj, err := strconv.Atoi(string(bytes.TrimSpace(b))); err == nil && adj > 0 {
				score += float64(min(adj, 1000)) / 1000 * float64(g.limit)
			}
		}
		cands = append(cands, cand{p, score})
		best = max(best, score)
	}
	var chosen *cand
	for k := range cands {
		c := &cands[k]
		if c.score < victimShare*best {
			continue
		}
		if chosen == nil || c.start > chosen.start || (c.start == chosen.start && c.pid > chosen.pid) {
			chosen = c
		}
	}
	if chosen == nil {
		return 0, 0, false
	}
	return chosen.pid, chosen.start, true
}

// killProcess sends SIGKILL to pid if it is still the process that started
// at start (through a pidfd, so a reused pid is never hit).
func killProcess(pid int, start uint64) bool {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	if p, ok := readProcStat(pid); !ok || p.start != start {
		return false
	}
	return unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0) == nil
}

// waitGone waits until the killed process has exited (a zombie holds no
// memory) or d passed.
func waitGone(pid int, start uint64, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		p, ok := readProcStat(pid)
		if !ok || p.start != start || p.state == 'Z' || p.state == 'X' {
			// The sentry updates its accounting when the address space
			// is released; give it a tick.
			time.Sleep(pollMin)
			return
		}
		time.Sleep(time.Millisecond)
	}
}
