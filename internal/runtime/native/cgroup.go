package native

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
)

// cgroupRoot is where every cgroup hierarchy is mounted.
const cgroupRoot = "/sys/fs/cgroup"

// cgroupParent is the directory below each hierarchy that holds one cgroup
// per sandbox.
const cgroupParent = "space"

// cgroup is one sandbox's cgroup(s), whichever hierarchy version the host has.
type cgroup interface {
	// create makes the cgroup(s) and applies limits; it is idempotent.
	create(l api.Limits) error
	addProc(pid int) error
	// procs lists the pids in the cgroup (empty when it does not exist).
	procs() ([]int, error)
	// kill SIGKILLs every process and waits until the cgroup is empty.
	kill(ctx context.Context) error
	freeze(ctx context.Context) error
	thaw(ctx context.Context) error
	stats() (runtime.Stats, error)
	// remove deletes the (empty) cgroup(s); missing ones are fine.
	remove() error
	// paths lists the cgroup directories.
	paths() []string
}

var (
	_ cgroup = (*cgroupV1)(nil)
	_ cgroup = (*cgroupV2)(nil)
)

// cgroupVersion is 2 when /sys/fs/cgroup is a cgroup2 mount (unified), 1
// for legacy and hybrid hosts (v1 controllers, maybe an empty unified mount).
func cgroupVersion() int {
	var st unix.Statfs_t
	if err := unix.Statfs(cgroupRoot, &st); err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		return 2
	}
	return 1
}

// v1Controllers are the v1 hierarchies a sandbox joins.
var v1Controllers = []string{"memory", "pids", "cpu", "cpuacct", "freezer", "devices"}

// allowedDevices are the only device nodes a sandbox may open (the ones
// nsinit binds into /dev, plus its own ptys). A user namespace cannot make
// device nodes anyway; on v1 hosts the devices controller says so again.
var allowedDevices = []string{
	"c 1:3 rwm",   // null
	"c 1:5 rwm",   // zero
	"c 1:7 rwm",   // full
	"c 1:8 rwm",   // random
	"c 1:9 rwm",   // urandom
	"c 5:0 rwm",   // tty
	"c 5:2 rwm",   // ptmx
	"c 136:* rwm", // pty slaves
}

func newCgroup(id string) cgroup {
	if cgroupVersion() == 2 {
		return &cgroupV2{dir: filepath.Join(cgroupRoot, cgroupParent, id)}
	}
	cg := &cgroupV1{dirs: map[string]string{}}
	seen := map[string]bool{}
	for _, c := range v1Controllers {
		mnt := filepath.Join(cgroupRoot, c)
		// cpu and cpuacct may be one co-mounted hierarchy behind symlinks.
		real, err := filepath.EvalSymlinks(mnt)
		if err != nil || seen[real] {
			if err == nil {
				cg.dirs[c] = filepath.Join(real, cgroupParent, id)
			}
			continue
		}
		seen[real] = true
		cg.dirs[c] = filepath.Join(real, cgroupParent, id)
	}
	return cg
}

// sandboxCgroupIDs lists the ids that have a cgroup on this host.
func sandboxCgroupIDs() []string {
	var parents []string
	if cgroupVersion() == 2 {
		parents = []string{filepath.Join(cgroupRoot, cgroupParent)}
	} else {
		for _, c := range v1Controllers {
			parents = append(parents, filepath.Join(cgroupRoot, c, cgroupParent))
		}
	}
	seen := map[string]bool{}
	var ids []string
	for _, p := range parents {
		ents, _ := os.ReadDir(p)
		for _, e := range ents {
			if e.IsDir() && !seen[e.Name()] {
				seen[e.Name()] = true
				ids = append(ids, e.Name())
			}
		}
	}
	return ids
}

func writeFile(path, value string) error {
	if err := os.WriteFile(path, []byte(value), 0); err != nil {
		return fmt.Errorf("cgroup write %q to %s: %w", value, path, err)
	}
	return nil
}

func readProcs(path string) ([]int, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		if n, err := strconv.Atoi(f); err == nil {
			pids = append(pids, n)
		}
	}
	return pids, nil
}

// poll runs cond every few milliseconds until it is true or ctx ends.
func poll(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
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

func memoryBytes(l api.Limits) int64 { return l.MemoryMiB << 20 }

const cpuPeriodUS = 100000

func cpuQuotaUS(l api.Limits) int64 { return int64(l.CPUs * cpuPeriodUS) }

// cgroupV1 is a sandbox on a legacy/hybrid host: one directory per controller.
type cgroupV1 struct {
	dirs map[string]string // controller → directory
}

func (c *cgroupV1) create(l api.Limits) error {
	for _, d := range c.dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("create cgroup: %w", err)
		}
	}
	if d, ok := c.dirs["memory"]; ok && l.MemoryMiB > 0 {
		mem := strconv.FormatInt(memoryBytes(l), 10)
		// Lowering memsw below memory fails, raising memory above memsw
		// fails: set memory first when growing, memsw first when shrinking
		// is not needed here because a fresh cgroup starts unlimited.
		if err := writeFile(filepath.Join(d, "memory.limit_in_bytes"), mem); err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(d, "memory.memsw.limit_in_bytes")); err == nil {
			if err := writeFile(filepath.Join(d, "memory.memsw.limit_in_bytes"), mem); err != nil {
				return err
			}
		}
		// No swapping inside a sandbox: its memory limit is a real limit.
		_ = writeFile(filepath.Join(d, "memory.swappiness"), "0")
	}
	if d, ok := c.dirs["devices"]; ok {
		if err := writeFile(filepath.Join(d, "devices.deny"), "a"); err != nil {
			return err
		}
		for _, dev := range allowedDevices {
			if err := writeFile(filepath.Join(d, "devices.allow"), dev); err != nil {
				return err
			}
		}
	}
	if d, ok := c.dirs["pids"]; ok && l.Pids > 0 {
		if err := writeFile(filepath.Join(d, "pids.max"), strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	if d, ok := c.dirs["cpu"]; ok && l.CPUs > 0 {
		if err := writeFile(filepath.Join(d, "cpu.cfs_period_us"), strconv.Itoa(cpuPeriodUS)); err != nil {
			return err
		}
		if err := writeFile(filepath.Join(d, "cpu.cfs_quota_us"), strconv.FormatInt(cpuQuotaUS(l), 10)); err != nil {
			return err
		}
	}
	return nil
}

func (c *cgroupV1) addProc(pid int) error {
	for _, d := range c.dirs {
		if err := writeFile(filepath.Join(d, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

func (c *cgroupV1) procs() ([]int, error) {
	seen := map[int]bool{}
	var out []int
	for _, d := range c.dirs {
		pids, err := readProcs(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			return nil, err
		}
		for _, p := range pids {
			if !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	}
	return out, nil
}

func (c *cgroupV1) kill(ctx context.Context) error {
	// Freeze first so nothing can fork while we kill; SIGKILL is delivered
	// to frozen tasks as soon as they thaw.
	frozen := c.freeze(ctx) == nil
	for round := 0; ; round++ {
		pids, err := c.procs()
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		for _, p := range pids {
			_ = unix.Kill(p, unix.SIGKILL)
		}
		if frozen {
			if err := c.thaw(ctx); err != nil {
				return err
			}
			frozen = false
		}
		if err := poll(ctx, "cgroup to empty", func() (bool, error) {
			pids, err := c.procs()
			return len(pids) == 0, err
		}); err == nil {
			return nil
		} else if round > 3 {
			return err
		}
	}
}

func (c *cgroupV1) setFreezer(ctx context.Context, state string) error {
	d, ok := c.dirs["freezer"]
	if !ok {
		return errors.New("freezer controller not mounted")
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
		if cur == "FREEZING" && state == "FROZEN" {
			// A task stuck in an uninterruptible sleep can stall freezing;
			// re-writing the state retries it.
			_ = writeFile(f, state)
		}
		return cur == state, nil
	})
}

func (c *cgroupV1) freeze(ctx context.Context) error { return c.setFreezer(ctx, "FROZEN") }
func (c *cgroupV1) thaw(ctx context.Context) error   { return c.setFreezer(ctx, "THAWED") }

func (c *cgroupV1) stats() (runtime.Stats, error) {
	var s runtime.Stats
	var err error
	if d, ok := c.dirs["memory"]; ok {
		if s.MemoryBytes, err = cgroupfs.ReadInt(filepath.Join(d, "memory.usage_in_bytes")); err != nil {
			return s, err
		}
		if s.OOMKills, err = cgroupfs.ReadKey(filepath.Join(d, "memory.oom_control"), "oom_kill"); err != nil {
			return s, err
		}
	}
	if d, ok := c.dirs["pids"]; ok {
		if s.Pids, err = cgroupfs.ReadInt(filepath.Join(d, "pids.current")); err != nil {
			return s, err
		}
	}
	if d, ok := c.dirs["cpuacct"]; ok {
		if s.CPUNanos, err = cgroupfs.ReadInt(filepath.Join(d, "cpuacct.usage")); err != nil {
			return s, err
		}
	}
	return s, nil
}

func (c *cgroupV1) paths() []string {
	var out []string
	for _, d := range c.dirs {
		out = append(out, d)
	}
	return out
}

func (c *cgroupV1) remove() error {
	var errs []error
	for _, d := range c.dirs {
		if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// cgroupV2 is a sandbox on a unified host: one directory.
type cgroupV2 struct {
	dir string
}

// enableControllers turns on memory, pids and cpu for the children of dir.
func enableControllers(dir string) error {
	return writeFile(filepath.Join(dir, "cgroup.subtree_control"), "+memory +pids +cpu")
}

func (c *cgroupV2) create(l api.Limits) error {
	parent := filepath.Dir(c.dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("create cgroup parent: %w", err)
	}
	// The top level may already delegate them (systemd) or refuse because
	// it holds processes (a server in a container's cgroup namespace):
	// then enabling them on our parent below reports the real problem.
	_ = enableControllers(filepath.Dir(parent))
	if err := enableControllers(parent); err != nil {
		return err
	}
	if err := os.Mkdir(c.dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create cgroup: %w", err)
	}
	if l.MemoryMiB > 0 {
		if err := writeFile(filepath.Join(c.dir, "memory.max"), strconv.FormatInt(memoryBytes(l), 10)); err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(c.dir, "memory.swap.max")); err == nil {
			if err := writeFile(filepath.Join(c.dir, "memory.swap.max"), "0"); err != nil {
				return err
			}
		}
	}
	if l.Pids > 0 {
		if err := writeFile(filepath.Join(c.dir, "pids.max"), strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	if l.CPUs > 0 {
		if err := writeFile(filepath.Join(c.dir, "cpu.max"), fmt.Sprintf("%d %d", cpuQuotaUS(l), cpuPeriodUS)); err != nil {
			return err
		}
	}
	return nil
}

func (c *cgroupV2) addProc(pid int) error {
	return writeFile(filepath.Join(c.dir, "cgroup.procs"), strconv.Itoa(pid))
}

func (c *cgroupV2) procs() ([]int, error) {
	return readProcs(filepath.Join(c.dir, "cgroup.procs"))
}

func (c *cgroupV2) kill(ctx context.Context) error {
	if _, err := os.Stat(c.dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := writeFile(filepath.Join(c.dir, "cgroup.kill"), "1"); err != nil {
		// Kernels before 5.14 lack cgroup.kill: freeze, kill, thaw.
		_ = c.freeze(ctx)
		pids, _ := c.procs()
		for _, p := range pids {
			_ = unix.Kill(p, unix.SIGKILL)
		}
		_ = c.thaw(ctx)
	}
	return poll(ctx, "cgroup to empty", func() (bool, error) {
		n, err := cgroupfs.ReadKey(filepath.Join(c.dir, "cgroup.events"), "populated")
		return n == 0, err
	})
}

func (c *cgroupV2) setFrozen(ctx context.Context, v int64) error {
	if err := writeFile(filepath.Join(c.dir, "cgroup.freeze"), strconv.FormatInt(v, 10)); err != nil {
		return err
	}
	return poll(ctx, "cgroup.freeze", func() (bool, error) {
		n, err := cgroupfs.ReadKey(filepath.Join(c.dir, "cgroup.events"), "frozen")
		return n == v, err
	})
}

func (c *cgroupV2) freeze(ctx context.Context) error { return c.setFrozen(ctx, 1) }
func (c *cgroupV2) thaw(ctx context.Context) error   { return c.setFrozen(ctx, 0) }

func (c *cgroupV2) stats() (runtime.Stats, error) {
	var s runtime.Stats
	var err error
	if s.MemoryBytes, err = cgroupfs.ReadInt(filepath.Join(c.dir, "memory.current")); err != nil {
		return s, err
	}
	if s.OOMKills, err = cgroupfs.ReadKey(filepath.Join(c.dir, "memory.events"), "oom_kill"); err != nil {
		return s, err
	}
	if s.Pids, err = cgroupfs.ReadInt(filepath.Join(c.dir, "pids.current")); err != nil {
		return s, err
	}
	usec, err := cgroupfs.ReadKey(filepath.Join(c.dir, "cpu.stat"), "usage_usec")
	if err != nil {
		return s, err
	}
	s.CPUNanos = usec * 1000
	return s, nil
}

func (c *cgroupV2) paths() []string { return []string{c.dir} }

func (c *cgroupV2) remove() error {
	if err := unix.Rmdir(c.dir); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove cgroup %s: %w", c.dir, err)
	}
	return nil
}

// removeStaleCgroup removes cg if it holds no process and was created more
// than minAge ago. It reports whether it removed anything.
func removeStaleCgroup(cg cgroup, minAge time.Duration) bool {
	if pids, err := cg.procs(); err != nil || len(pids) > 0 {
		return false
	}
	for _, d := range cg.paths() {
		var st unix.Stat_t
		if err := unix.Stat(d, &st); err == nil && time.Since(time.Unix(st.Ctim.Unix())) < minAge {
			return false
		}
	}
	return cg.remove() == nil
}
