package gvisor

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
)

// runsc creates each sandbox's cgroups from the spec's cgroupsPath
// (/space-gvisor/<id>) and applies linux.resources to them; the host reads
// its statistics back from the same files, never from the sandbox.

const cgroupRoot = "/sys/fs/cgroup"

func cgroupV2() bool {
	var st unix.Statfs_t
	return unix.Statfs(cgroupRoot, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

// cgroupDirs maps controller → directory of sandbox id ("" on v2).
func cgroupDirs(id string) map[string]string {
	if cgroupV2() {
		return map[string]string{"": filepath.Join(cgroupRoot, cgroupBase, id)}
	}
	out := map[string]string{}
	for _, c := range []string{"memory", "pids", "cpu", "cpuacct", "freezer", "devices", "cpuset", "blkio"} {
		if _, err := os.Stat(filepath.Join(cgroupRoot, c)); err == nil {
			out[c] = filepath.Join(cgroupRoot, c, cgroupBase, id)
		}
	}
	return out
}

// cgroupStats reads memory, OOM kills and CPU of sandbox id from its host
// cgroups. Pids is filled by the caller: the host's pids counter counts the
// sentry's threads, not the sandbox's processes.
func cgroupStats(id string) (runtime.Stats, error) {
	var s runtime.Stats
	var err error
	dirs := cgroupDirs(id)
	if d, ok := dirs[""]; ok {
		if s.MemoryBytes, err = cgroupfs.ReadInt(filepath.Join(d, "memory.current")); err != nil {
			return s, err
		}
		if s.OOMKills, err = cgroupfs.ReadKey(filepath.Join(d, "memory.events"), "oom_kill"); err != nil {
			return s, err
		}
		usec, err := cgroupfs.ReadKey(filepath.Join(d, "cpu.stat"), "usage_usec")
		if err != nil {
			return s, err
		}
		s.CPUNanos = usec * 1000
		return s, nil
	}
	if d, ok := dirs["memory"]; ok {
		if s.MemoryBytes, err = cgroupfs.ReadInt(filepath.Join(d, "memory.usage_in_bytes")); err != nil {
			return s, err
		}
		if s.OOMKills, err = cgroupfs.ReadKey(filepath.Join(d, "memory.oom_control"), "oom_kill"); err != nil {
			return s, err
		}
	}
	if d, ok := dirs["cpuacct"]; ok {
		if s.CPUNanos, err = cgroupfs.ReadInt(filepath.Join(d, "cpuacct.usage")); err != nil {
			return s, err
		}
	}
	return s, nil
}

// cgroupProcs lists the host pids in sandbox id's cgroups.
func cgroupProcs(id string) []int {
	seen := map[int]bool{}
	var out []int
	for _, d := range cgroupDirs(id) {
		data, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(data)) {
			if n, err := strconv.Atoi(f); err == nil && !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	return out
}

// removeCgroups removes sandbox id's (empty) cgroups; runsc removes them on
// delete, this catches a sandbox that died without one.
func removeCgroups(id string) error {
	var errs []error
	for _, d := range cgroupDirs(id) {
		if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// cgroupIDs lists the sandbox ids that have a cgroup of this runtime.
func cgroupIDs() []string {
	seen := map[string]bool{}
	var ids []string
	for _, d := range cgroupDirs("x") {
		ents, _ := os.ReadDir(filepath.Dir(d))
		for _, e := range ents {
			if e.IsDir() && !seen[e.Name()] {
				seen[e.Name()] = true
				ids = append(ids, e.Name())
			}
		}
	}
	return ids
}
