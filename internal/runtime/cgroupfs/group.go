package cgroupfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The host side of the runtimes' cgroups: one cgroup per sandbox (or per
// jailed QEMU) named <hierarchy>/<parent>/<name>, where parent is the
// runtime's own ("space", "space-gvisor", "space-jail"). On a unified (v2)
// host that is one directory; on a legacy or hybrid (v1) host it is one
// directory per controller, co-mounted controllers (cpu,cpuacct) sharing
// one. Group creates it with limits, moves processes in, freezes, kills,
// reads its counters and removes it; which runtime sweeps which cgroups
// when stays with the runtime.

// Root is where the host mounts its cgroup hierarchies.
const Root = "/sys/fs/cgroup"

// CFS bandwidth: every CPU limit is a quota per CPUPeriodUS.
const (
	CPUPeriodUS = 100000
	// MinCPUQuotaUS is the smallest quota the kernel takes (1 ms), 1% of
	// the period.
	MinCPUQuotaUS = 1000
)

// CPUQuotaUS is the CFS quota per CPUPeriodUS for cpus cores: rounded up to
// a whole microsecond (a limit is never tighter than asked), and never
// below MinCPUQuotaUS. Float noise below a nanosecond (0.7 cores is
// 70000.00000000001 µs) does not round up.
func CPUQuotaUS(cpus float64) int64 {
	q := math.Ceil(math.Round(cpus*CPUPeriodUS*1000) / 1000)
	if !(q >= MinCPUQuotaUS) { // also NaN
		return MinCPUQuotaUS
	}
	if q > math.MaxInt64/2 {
		return math.MaxInt64 / 2
	}
	return int64(q)
}

// Layout says where a host's hierarchies are and which kind they are.
type Layout struct {
	Root    string
	Unified bool // cgroup v2: one hierarchy with every controller
}

// Host is this host's layout: unified when Root is a cgroup2 mount, v1 for
// legacy and hybrid hosts (v1 controllers, maybe an empty cgroup2 mount at
// Root/unified).
func Host() Layout {
	var st unix.Statfs_t
	v2 := unix.Statfs(Root, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
	return Layout{Root: Root, Unified: v2}
}

// Version is 2 on a unified host, 1 otherwise.
func Version() int {
	if Host().Unified {
		return 2
	}
	return 1
}

// Group is the cgroup parent/name in layout l. On v1 it joins the given
// controllers' hierarchies that the host has (controllers are ignored on
// v2, where the one directory has them all).
func (l Layout) Group(parent, name string, controllers []string) *Group {
	g := &Group{unified: l.Unified, dirs: map[string]string{}, mounts: map[string]string{}}
	if l.Unified {
		g.dirs[""] = filepath.Join(l.Root, parent, name)
		return g
	}
	for _, c := range controllers {
		// cpu and cpuacct are often one co-mounted hierarchy behind two
		// symlinks: both resolve to the same directory.
		real, err := filepath.EvalSymlinks(filepath.Join(l.Root, c))
		if err != nil {
			continue
		}
		g.dirs[c] = filepath.Join(real, parent, name)
		g.mounts[c] = real
	}
	return g
}

// Names lists the cgroups below parent in any of the hierarchies, each
// once.
func (l Layout) Names(parent string, controllers []string) []string {
	seen := map[string]bool{}
	var names []string
	for _, d := range l.Group(parent, "x", controllers).Paths() {
		ents, _ := os.ReadDir(filepath.Dir(d))
		for _, e := range ents {
			if e.IsDir() && !seen[e.Name()] {
				seen[e.Name()] = true
				names = append(names, e.Name())
			}
		}
	}
	return names
}

// Group is one cgroup on every hierarchy it joins.
type Group struct {
	unified bool
	dirs    map[string]string // controller → directory; "" on v2
	mounts  map[string]string // v1: controller → its hierarchy's mount
}

// Unified reports whether the group is a v2 one.
func (g *Group) Unified() bool { return g.unified }

// Dir is the directory that holds controller's files: the one directory
// on v2, the controller's hierarchy on v1 (false if the host lacks it).
func (g *Group) Dir(controller string) (string, bool) {
	if g.unified {
		return g.dirs[""], true
	}
	d, ok := g.dirs[controller]
	return d, ok
}

// Paths lists the group's directories, each once, in a stable order.
func (g *Group) Paths() []string {
	seen := map[string]bool{}
	var out []string
	for _, d := range g.dirs {
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	slices.Sort(out)
	return out
}

// Limits are what Create applies; zero fields are left unlimited.
type Limits struct {
	// MemoryBytes limits memory, with no swap on top.
	MemoryBytes int64
	Pids        int64
	// CPUs is a quota in cores (CPUQuotaUS).
	CPUs float64
	// Devices, when not nil, are the only devices.allow rules ("c 1:3
	// rwm") on a v1 host: everything else is denied. Ignored on v2.
	Devices []string
	// CPUWeight is the group's share of CPU time under contention on the
	// v2 scale (1..10000, DefaultCPUWeight); 0 leaves the kernel's default.
	CPUWeight int
}

// CPU weights on the v2 scale; v1 cpu.shares are CPUShares of them.
const (
	DefaultCPUWeight = 100
	// BackgroundCPUWeight is the lowest weight: work made ahead of
	// demand (a warm pool's members) runs on what others leave idle.
	BackgroundCPUWeight = 1
)

// CPUShares is v1's cpu.shares for a v2 weight (1024 per 100, at least
// the kernel's minimum of 2).
func CPUShares(weight int) int64 { return max(2, int64(weight)*1024/DefaultCPUWeight) }

// SetCPUWeight changes the group's CPU weight (cpu.weight on v2,
// cpu.shares on v1; a v1 host without the cpu controller is left alone).
func (g *Group) SetCPUWeight(weight int) error {
	if weight < 1 || weight > 10000 {
		return fmt.Errorf("cpu weight %d: must be 1..10000", weight)
	}
	if g.unified {
		return writeFile(filepath.Join(g.dirs[""], "cpu.weight"), strconv.Itoa(weight))
	}
	if d, ok := g.dirs["cpu"]; ok {
		return writeFile(filepath.Join(d, "cpu.shares"), strconv.FormatInt(CPUShares(weight), 10))
	}
	return nil
}

// v2Controllers are the ones a v2 parent delegates to its children.
const v2Controllers = "+memory +pids +cpu"

func writeFile(path, value string) error {
	if err := os.WriteFile(path, []byte(value), 0); err != nil {
		return fmt.Errorf("cgroup write %q to %s: %w", value, path, err)
	}
	return nil
}

// Create makes the group's directories and applies l. It is idempotent: a
// leftover of the same name gets l written again.
func (g *Group) Create(l Limits) error {
	create := g.createV1
	if g.unified {
		create = g.createV2
	}
	if err := create(l); err != nil {
		return err
	}
	if l.CPUWeight > 0 {
		return g.SetCPUWeight(l.CPUWeight)
	}
	return nil
}

func (g *Group) createV1(l Limits) error {
	for _, d := range g.Paths() {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("create cgroup: %w", err)
		}
	}
	if d, ok := g.dirs["memory"]; ok && l.MemoryBytes > 0 {
		if err := g.SetMemoryLimit(l.MemoryBytes); err != nil {
			return err
		}
		// No swapping: the memory limit is a real limit.
		_ = writeFile(filepath.Join(d, "memory.swappiness"), "0")
	}
	if d, ok := g.dirs["devices"]; ok && l.Devices != nil {
		if err := writeFile(filepath.Join(d, "devices.deny"), "a"); err != nil {
			return err
		}
		for _, dev := range l.Devices {
			if err := writeFile(filepath.Join(d, "devices.allow"), dev); err != nil {
				return err
			}
		}
	}
	if d, ok := g.dirs["pids"]; ok && l.Pids > 0 {
		if err := writeFile(filepath.Join(d, "pids.max"), strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	if d, ok := g.dirs["cpu"]; ok && l.CPUs > 0 {
		if err := writeFile(filepath.Join(d, "cpu.cfs_period_us"), strconv.Itoa(CPUPeriodUS)); err != nil {
			return err
		}
		if err := writeFile(filepath.Join(d, "cpu.cfs_quota_us"), strconv.FormatInt(CPUQuotaUS(l.CPUs), 10)); err != nil {
			return err
		}
	}
	return nil
}

func (g *Group) createV2(l Limits) error {
	dir := g.dirs[""]
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("create cgroup parent: %w", err)
	}
	// The root may already delegate them (systemd) or refuse because it
	// holds processes (a server in a container's cgroup namespace): then
	// enabling them on the parent below reports the real problem.
	_ = writeFile(filepath.Join(filepath.Dir(parent), "cgroup.subtree_control"), v2Controllers)
	if err := writeFile(filepath.Join(parent, "cgroup.subtree_control"), v2Controllers); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create cgroup: %w", err)
	}
	if l.MemoryBytes > 0 {
		if err := g.SetMemoryLimit(l.MemoryBytes); err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(dir, "memory.swap.max")); err == nil {
			if err := writeFile(filepath.Join(dir, "memory.swap.max"), "0"); err != nil {
				return err
			}
		}
	}
	if l.Pids > 0 {
		if err := writeFile(filepath.Join(dir, "pids.max"), strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	if l.CPUs > 0 {
		if err := writeFile(filepath.Join(dir, "cpu.max"), fmt.Sprintf("%d %d", CPUQuotaUS(l.CPUs), CPUPeriodUS)); err != nil {
			return err
		}
	}
	return nil
}

// SetMemoryLimit sets the group's memory limit to n bytes; on v1 memory
// plus swap too (when the kernel accounts swap), in the order the kernel
// accepts — memory+swap may never be below memory. A v1 host without a
// memory hierarchy is left alone.
func (g *Group) SetMemoryLimit(n int64) error {
	v := strconv.FormatInt(n, 10)
	if g.unified {
		return writeFile(filepath.Join(g.dirs[""], "memory.max"), v)
	}
	d, ok := g.dirs["memory"]
	if !ok {
		return nil
	}
	mem := filepath.Join(d, "memory.limit_in_bytes")
	memsw := filepath.Join(d, "memory.memsw.limit_in_bytes")
	if _, err := os.Stat(memsw); err != nil {
		return writeFile(mem, v)
	}
	order := []string{mem, memsw}
	if cur, err := ReadInt(mem); err == nil && n > cur {
		order = []string{memsw, mem} // raising
	}
	for _, f := range order {
		if err := writeFile(f, v); err != nil {
			return err
		}
	}
	return nil
}

// AddProc moves process pid (all its threads) into the group.
func (g *Group) AddProc(pid int) error {
	for _, d := range g.Paths() {
		if err := writeFile(filepath.Join(d, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// Procs lists the pids in the group; none when it does not exist.
func (g *Group) Procs() ([]int, error) {
	seen := map[int]bool{}
	var out []int
	for _, d := range g.Paths() {
		data, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, f := range strings.Fields(string(data)) {
			if n, err := strconv.Atoi(f); err == nil && !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	return out, nil
}

// waitTimeout bounds every wait of Kill, Freeze and Thaw when the caller's
// context has no earlier deadline.
const waitTimeout = 15 * time.Second

// poll runs cond every few milliseconds until it is true or ctx ends.
func poll(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, waitTimeout)
	defer cancel()
	delay := time.Millisecond
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-time.After(delay):
		}
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

// Kill SIGKILLs every process in the group and waits until it is empty: on
// v2 with cgroup.kill (kernel 5.14+); otherwise frozen first where a
// freezer is at hand, so nothing forks away, and killed again until
// nothing is left. A missing group is empty.
func (g *Group) Kill(ctx context.Context) error {
	if g.unified {
		dir := g.dirs[""]
		if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if writeFile(filepath.Join(dir, "cgroup.kill"), "1") == nil {
			return poll(ctx, "cgroup to empty", func() (bool, error) {
				n, err := ReadKey(filepath.Join(dir, "cgroup.events"), "populated")
				return n == 0, err
			})
		}
	}
	killAll := func() (bool, error) {
		pids, err := g.Procs()
		for _, p := range pids {
			_ = unix.Kill(p, unix.SIGKILL)
		}
		return len(pids) == 0, err
	}
	// SIGKILL reaches frozen tasks as soon as they thaw; while frozen
	// they cannot fork children this pass misses.
	frozen := g.canFreeze() && g.Freeze(ctx) == nil
	_, err := killAll()
	if frozen {
		err = errors.Join(err, g.Thaw(ctx))
	}
	if err != nil {
		return err
	}
	return poll(ctx, "cgroup to empty", killAll)
}

func (g *Group) canFreeze() bool {
	_, ok := g.Dir("freezer")
	return ok
}

// Freeze stops every process in the group (v1 freezer, v2 cgroup.freeze).
func (g *Group) Freeze(ctx context.Context) error { return g.setFrozen(ctx, true) }

// Thaw lets a frozen group run again.
func (g *Group) Thaw(ctx context.Context) error { return g.setFrozen(ctx, false) }

func (g *Group) setFrozen(ctx context.Context, frozen bool) error {
	if g.unified {
		dir := g.dirs[""]
		v := int64(0)
		if frozen {
			v = 1
		}
		if err := writeFile(filepath.Join(dir, "cgroup.freeze"), strconv.FormatInt(v, 10)); err != nil {
			return err
		}
		return poll(ctx, "cgroup.freeze", func() (bool, error) {
			n, err := ReadKey(filepath.Join(dir, "cgroup.events"), "frozen")
			return n == v, err
		})
	}
	d, ok := g.dirs["freezer"]
	if !ok {
		return errors.New("freezer controller not mounted")
	}
	state := "THAWED"
	if frozen {
		state = "FROZEN"
	}
	f := filepath.Join(d, "freezer.state")
	if err := writeFile(f, state); err != nil {
		return err
	}
	return poll(ctx, "freezer "+state, func() (bool, error) {
		data, err := os.ReadFile(f)
		if err != nil {
			return false, err
		}
		cur := strings.TrimSpace(string(data))
		if cur == "FREEZING" && frozen {
			// A task stuck in an uninterruptible sleep can stall freezing;
			// writing the state again retries it.
			_ = writeFile(f, state)
		}
		return cur == state, nil
	})
}

// Remove deletes the group's (empty) directories; missing ones are fine.
// The kernel may still be releasing a task that just left cgroup.procs:
// a busy directory is retried for a second.
func (g *Group) Remove() error {
	var errs []error
	for _, d := range g.Paths() {
		var err error
		for i := 0; i < 100; i++ {
			if err = unix.Rmdir(d); err == nil || errors.Is(err, unix.ENOENT) {
				err = nil
				break
			}
			if !errors.Is(err, unix.EBUSY) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// The counters read 0 on a v1 host without the controller; a missing
// file (no such group) is an error that wraps os.ErrNotExist.

// MemoryBytes is the group's memory use.
func (g *Group) MemoryBytes() (int64, error) {
	if g.unified {
		return ReadInt(filepath.Join(g.dirs[""], "memory.current"))
	}
	if d, ok := g.dirs["memory"]; ok {
		return ReadInt(filepath.Join(d, "memory.usage_in_bytes"))
	}
	return 0, nil
}

// OOMKills counts the processes the OOM killer killed in the group.
func (g *Group) OOMKills() (int64, error) {
	path := g.oomPath()
	if path == "" {
		return 0, nil
	}
	return ReadKey(path, "oom_kill")
}

func (g *Group) oomPath() string {
	if g.unified {
		return filepath.Join(g.dirs[""], "memory.events")
	}
	if d, ok := g.dirs["memory"]; ok {
		return filepath.Join(d, "memory.oom_control")
	}
	return ""
}

// OOMCounter reads a group's OOM kill count through a file it keeps open:
// the count is read around every exec, and an open is most of a read's
// cost. The instance that owns the group closes it.
type OOMCounter struct {
	path string
	mu   sync.Mutex
	f    *os.File
}

// OOMCounter returns a counter of g's OOM kills (0 on a v1 host without
// the memory controller).
func (g *Group) OOMCounter() *OOMCounter { return &OOMCounter{path: g.oomPath()} }

// Read is OOMKills through the kept file.
func (c *OOMCounter) Read() (int64, error) {
	if c.path == "" {
		return 0, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.f == nil {
		f, err := os.Open(c.path)
		if err != nil {
			return 0, err
		}
		c.f = f
	}
	var buf [512]byte
	n, err := c.f.ReadAt(buf[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		// The group was removed (and maybe made again): reopen next time.
		c.f.Close()
		c.f = nil
		return ReadKey(c.path, "oom_kill")
	}
	v, _, err := lookupKeyIn(buf[:n], "oom_kill")
	return v, err
}

// Close closes the kept file.
func (c *OOMCounter) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.f == nil {
		return nil
	}
	err := c.f.Close()
	c.f = nil
	return err
}

// Pids counts the tasks (threads) in the group.
func (g *Group) Pids() (int64, error) {
	if d, ok := g.Dir("pids"); ok {
		return ReadInt(filepath.Join(d, "pids.current"))
	}
	return 0, nil
}

// CPUNanos is the CPU time the group's tasks used. A v2 cpu.stat without
// usage_usec is an error, not zero.
func (g *Group) CPUNanos() (int64, error) {
	if g.unified {
		f := filepath.Join(g.dirs[""], "cpu.stat")
		usec, found, err := LookupKey(f, "usage_usec")
		if err != nil {
			return 0, err
		}
		if !found {
			return 0, fmt.Errorf("no usage_usec in %s", f)
		}
		return usec * 1000, nil
	}
	if d, ok := g.dirs["cpuacct"]; ok {
		return ReadInt(filepath.Join(d, "cpuacct.usage"))
	}
	return 0, nil
}

// MemoryCacheBytes is the page cache part of MemoryBytes: memory.stat's
// "file" on v2, "total_cache" (this group and its children) on v1.
func (g *Group) MemoryCacheBytes() (int64, error) {
	if g.unified {
		return ReadKey(filepath.Join(g.dirs[""], "memory.stat"), "file")
	}
	if d, ok := g.dirs["memory"]; ok {
		return ReadKey(filepath.Join(d, "memory.stat"), "total_cache")
	}
	return 0, nil
}
