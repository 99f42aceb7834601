package jail

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
)

// Every jail's cgroup is <hierarchy>/space-jail/<id>: one directory per v1
// controller on legacy and hybrid hosts, one directory on unified (v2)
// hosts.
const (
	cgroupRoot   = "/sys/fs/cgroup"
	cgroupParent = "space-jail"
	cpuPeriodUS  = 100000
)

// v1Controllers are the v1 hierarchies a jail joins. cpu and cpuacct are
// often one co-mounted hierarchy behind two names.
var v1Controllers = []string{"memory", "pids", "cpu", "cpuacct", "devices"}

func cgroupV2() bool {
	var st unix.Statfs_t
	return unix.Statfs(cgroupRoot, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

// cgroupDirs maps controller → directory of jail id; on v2 the one key is
// "". Controllers the host lacks are left out.
func cgroupDirs(id string) map[string]string {
	if cgroupV2() {
		return map[string]string{"": filepath.Join(cgroupRoot, cgroupParent, id)}
	}
	dirs := map[string]string{}
	for _, c := range v1Controllers {
		real, err := filepath.EvalSymlinks(filepath.Join(cgroupRoot, c))
		if err != nil {
			continue
		}
		dirs[c] = filepath.Join(real, cgroupParent, id)
	}
	return dirs
}

// uniqueDirs lists each directory of dirs once (co-mounted controllers
// share one).
func uniqueDirs(dirs map[string]string) []string {
	seen := map[string]bool{}
	var out []string
	for _, d := range dirs {
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	return out
}

func writeCg(dir, file, value string) error {
	if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0); err != nil {
		return fmt.Errorf("jail: cgroup: write %q to %s: %w", value, filepath.Join(dir, file), err)
	}
	return nil
}

func cpuQuotaUS(cpus float64) int64 { return int64(math.Ceil(cpus * cpuPeriodUS)) }

// createCgroup makes the jail's cgroup(s) with s's limits. A leftover of
// the same id (a crashed start) is reused: the limits are written again.
func createCgroup(s *Spec, devices []devNode) (err error) {
	dirs := cgroupDirs(s.ID)
	if len(dirs) == 0 {
		return fmt.Errorf("jail: no cgroup hierarchy under %s: %w", cgroupRoot, errdefs.ErrNotSupported)
	}
	defer func() {
		if err != nil {
			_ = RemoveCgroup(s.ID)
		}
	}()
	mem := strconv.FormatInt(s.Limits.MemoryBytes, 10)
	pids := strconv.FormatInt(s.Limits.Pids, 10)
	if d, ok := dirs[""]; ok {
		return createV2(cgroupRoot, d, mem, pids, s.Limits.CPUs)
	}
	for _, d := range uniqueDirs(dirs) {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("jail: cgroup: %w", err)
		}
	}
	d, ok := dirs["memory"]
	if !ok {
		return fmt.Errorf("jail: no v1 memory controller: %w", errdefs.ErrNotSupported)
	}
	if err := writeCg(d, "memory.limit_in_bytes", mem); err != nil {
		return err
	}
	// Guest memory swapped out by the host would defeat the limit.
	if _, err := os.Stat(filepath.Join(d, "memory.memsw.limit_in_bytes")); err == nil {
		if err := writeCg(d, "memory.memsw.limit_in_bytes", mem); err != nil {
			return err
		}
	}
	_ = writeCg(d, "memory.swappiness", "0")
	if d, ok = dirs["pids"]; !ok {
		return fmt.Errorf("jail: no v1 pids controller: %w", errdefs.ErrNotSupported)
	}
	if err := writeCg(d, "pids.max", pids); err != nil {
		return err
	}
	if d, ok = dirs["cpu"]; !ok {
		return fmt.Errorf("jail: no v1 cpu controller: %w", errdefs.ErrNotSupported)
	}
	if err := writeCg(d, "cpu.cfs_period_us", strconv.Itoa(cpuPeriodUS)); err != nil {
		return err
	}
	if err := writeCg(d, "cpu.cfs_quota_us", strconv.FormatInt(cpuQuotaUS(s.Limits.CPUs), 10)); err != nil {
		return err
	}
	// The devices controller repeats what the jail's /dev says: only
	// these nodes open, even if one were made some other way.
	if d, ok := dirs["devices"]; ok {
		if err := writeCg(d, "devices.deny", "a"); err != nil {
			return err
		}
		for _, n := range devices {
			if err := writeCg(d, "devices.allow", fmt.Sprintf("c %d:%d rwm", unix.Major(n.Rdev), unix.Minor(n.Rdev))); err != nil {
				return err
			}
		}
	}
	return nil
}

// createV2 makes dir, a jail's cgroup below the unified hierarchy at root.
func createV2(root, dir, mem, pids string, cpus float64) error {
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("jail: cgroup: %w", err)
	}
	// The root may already delegate them; a failure here shows up as a
	// missing file below, with the real reason.
	_ = writeCg(root, "cgroup.subtree_control", "+memory +pids +cpu")
	if err := writeCg(parent, "cgroup.subtree_control", "+memory +pids +cpu"); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("jail: cgroup: %w", err)
	}
	if err := writeCg(dir, "memory.max", mem); err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(dir, "memory.swap.max")); err == nil {
		if err := writeCg(dir, "memory.swap.max", "0"); err != nil {
			return err
		}
	}
	if err := writeCg(dir, "pids.max", pids); err != nil {
		return err
	}
	return writeCg(dir, "cpu.max", fmt.Sprintf("%d %d", cpuQuotaUS(cpus), cpuPeriodUS))
}

// addToCgroup moves process pid (all its threads) into jail id's cgroup(s).
func addToCgroup(id string, pid int) error {
	for _, d := range uniqueDirs(cgroupDirs(id)) {
		if err := writeCg(d, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// CgroupCPU is the CPU time jail id's processes have used, in nanoseconds,
// from the host's cgroup (QEMU's threads: guest vCPUs and emulation).
func CgroupCPU(id string) (int64, error) {
	if !ValidID(id) {
		return 0, invalid("id %q", id)
	}
	dirs := cgroupDirs(id)
	if d, ok := dirs[""]; ok {
		usec, found, err := cgroupfs.LookupKey(filepath.Join(d, "cpu.stat"), "usage_usec")
		if err != nil {
			return 0, cgErr(id, err)
		}
		if !found {
			return 0, cgErr(id, errors.New("no usage_usec in cpu.stat"))
		}
		return usec * 1000, nil
	}
	d, ok := dirs["cpuacct"]
	if !ok {
		return 0, fmt.Errorf("jail: no v1 cpuacct controller: %w", errdefs.ErrNotSupported)
	}
	n, err := cgroupfs.ReadInt(filepath.Join(d, "cpuacct.usage"))
	if err != nil {
		return 0, cgErr(id, err)
	}
	return n, nil
}

func cgErr(id string, err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("jail: cgroup of %s: %w", id, errdefs.ErrNotFound)
	}
	return fmt.Errorf("jail: cgroup of %s: %w", id, err)
}

func cgroupProcs(dir string) []int {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			pids = append(pids, n)
		}
	}
	return pids
}

// RemoveCgroup SIGKILLs whatever still runs in jail id's cgroup(s) (a
// QEMU that Sweep found unowned) and removes them. A missing cgroup is
// not an error.
func RemoveCgroup(id string) error {
	if !ValidID(id) {
		return invalid("id %q", id)
	}
	var errs []error
	for _, d := range uniqueDirs(cgroupDirs(id)) {
		if _, err := os.Stat(d); errors.Is(err, os.ErrNotExist) {
			continue
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			pids := cgroupProcs(d)
			if len(pids) == 0 {
				break
			}
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("jail: cgroup %s: processes %v did not die: %w", d, pids, errdefs.ErrUnavailable))
				break
			}
			for _, p := range pids {
				_ = unix.Kill(p, unix.SIGKILL)
			}
			time.Sleep(5 * time.Millisecond)
		}
		// The kernel may still be tearing down an exited task's css
		// references for a moment after cgroup.procs emptied.
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
			errs = append(errs, fmt.Errorf("jail: remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// CgroupIDs lists the ids that have a jail cgroup on this host, for the
// runtime's Sweep.
func CgroupIDs() []string {
	var parents []string
	if cgroupV2() {
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
			if e.IsDir() && ValidID(e.Name()) && !seen[e.Name()] {
				seen[e.Name()] = true
				ids = append(ids, e.Name())
			}
		}
	}
	return ids
}
