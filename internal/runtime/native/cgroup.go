package native

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
)

// cgroupRoot is where every cgroup hierarchy is mounted.
const cgroupRoot = cgroupfs.Root

// cgroupParent is the directory below each hierarchy that holds one cgroup
// per sandbox.
const cgroupParent = "space"

// cgroupVersion is 2 on a unified host, 1 on legacy and hybrid ones.
func cgroupVersion() int { return cgroupfs.Version() }

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

// newCgroup is sandbox id's cgroup, whichever hierarchy version the host has.
func newCgroup(id string) *cgroupfs.Group {
	return cgroupfs.Host().Group(cgroupParent, id, v1Controllers)
}

// cgroupLimits are the cgroup limits of a sandbox limited to l.
func cgroupLimits(l api.Limits) cgroupfs.Limits {
	return cgroupfs.Limits{MemoryBytes: l.MemoryMiB << 20, Pids: l.Pids, CPUs: l.CPUs, Devices: allowedDevices}
}

// cgroupStats reads a sandbox's statistics from its cgroup.
func cgroupStats(cg *cgroupfs.Group) (runtime.Stats, error) {
	var s runtime.Stats
	var err error
	if s.MemoryBytes, err = cg.MemoryBytes(); err != nil {
		return s, err
	}
	if s.OOMKills, err = cg.OOMKills(); err != nil {
		return s, err
	}
	if s.Pids, err = cg.Pids(); err != nil {
		return s, err
	}
	if s.MemoryCacheBytes, err = cg.MemoryCacheBytes(); err != nil {
		return s, err
	}
	s.CPUNanos, err = cg.CPUNanos()
	return s, err
}

// sandboxCgroupIDs lists the ids that have a cgroup on this host.
func sandboxCgroupIDs() []string {
	return cgroupfs.Host().Names(cgroupParent, v1Controllers)
}

// removeStaleCgroup removes cg if it holds no process and was created more
// than minAge ago. It reports whether it removed anything.
func removeStaleCgroup(cg *cgroupfs.Group, minAge time.Duration) bool {
	if pids, err := cg.Procs(); err != nil || len(pids) > 0 {
		return false
	}
	for _, d := range cg.Paths() {
		var st unix.Stat_t
		if err := unix.Stat(d, &st); err == nil && time.Since(time.Unix(st.Ctim.Unix())) < minAge {
			return false
		}
	}
	return cg.Remove() == nil
}
