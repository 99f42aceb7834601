package jail

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
)

// Every jail's cgroup is <hierarchy>/space-jail/<id>: one directory per v1
// controller on legacy and hybrid hosts, one directory on unified (v2)
// hosts.
const cgroupParent = "space-jail"

// v1Controllers are the v1 hierarchies a jail joins.
var v1Controllers = []string{"memory", "pids", "cpu", "cpuacct", "devices"}

// killTimeout bounds how long RemoveCgroup waits for a jail's processes
// to die.
const killTimeout = 5 * time.Second

func jailCgroup(id string) *cgroupfs.Group {
	return cgroupfs.Host().Group(cgroupParent, id, v1Controllers)
}

// SetCPUWeight changes the CPU weight of jail id's cgroup (a pool member
// that became someone's sandbox leaves the background weight).
func SetCPUWeight(id string, weight int) error { return jailCgroup(id).SetCPUWeight(weight) }

// createCgroup makes the jail's cgroup(s) with s's limits. A leftover of
// the same id (a crashed start) is reused: the limits are written again.
func createCgroup(s *Spec, devices []devNode) (err error) {
	g := jailCgroup(s.ID)
	if len(g.Paths()) == 0 {
		return fmt.Errorf("jail: no cgroup hierarchy under %s: %w", cgroupfs.Root, errdefs.ErrNotSupported)
	}
	for _, c := range []string{"memory", "pids", "cpu"} {
		if _, ok := g.Dir(c); !ok {
			return fmt.Errorf("jail: no v1 %s controller: %w", c, errdefs.ErrNotSupported)
		}
	}
	// The devices controller (v1) repeats what the jail's /dev says: only
	// these nodes open, even if one were made some other way.
	allow := make([]string, 0, len(devices))
	for _, n := range devices {
		allow = append(allow, fmt.Sprintf("c %d:%d rwm", unix.Major(n.Rdev), unix.Minor(n.Rdev)))
	}
	// Guest memory swapped out by the host would defeat the limit: no swap.
	l := cgroupfs.Limits{MemoryBytes: s.Limits.MemoryBytes, Pids: s.Limits.Pids, CPUs: s.Limits.CPUs, Devices: allow, CPUWeight: s.Limits.CPUWeight}
	if err := g.Create(l); err != nil {
		_ = RemoveCgroup(s.ID)
		return fmt.Errorf("jail: %w", err)
	}
	return nil
}

// addToCgroup moves process pid (all its threads) into jail id's cgroup(s).
func addToCgroup(id string, pid int) error {
	if err := jailCgroup(id).AddProc(pid); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	return nil
}

// CgroupCPU is the CPU time jail id's processes have used, in nanoseconds,
// from the host's cgroup (QEMU's threads: guest vCPUs and emulation).
func CgroupCPU(id string) (int64, error) {
	if !ValidID(id) {
		return 0, invalid("id %q", id)
	}
	g := jailCgroup(id)
	if _, ok := g.Dir("cpuacct"); !ok {
		return 0, fmt.Errorf("jail: no v1 cpuacct controller: %w", errdefs.ErrNotSupported)
	}
	n, err := g.CPUNanos()
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

// RemoveCgroup SIGKILLs whatever still runs in jail id's cgroup(s) (a
// QEMU that Sweep found unowned) and removes them. A missing cgroup is
// not an error.
func RemoveCgroup(id string) error {
	if !ValidID(id) {
		return invalid("id %q", id)
	}
	g := jailCgroup(id)
	ctx, cancel := context.WithTimeout(context.Background(), killTimeout)
	defer cancel()
	if err := g.Kill(ctx); err != nil {
		return fmt.Errorf("jail: cgroup of %s: processes did not die: %w", id, errors.Join(err, errdefs.ErrUnavailable))
	}
	if err := g.Remove(); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	return nil
}

// CgroupIDs lists the ids that have a jail cgroup on this host, for the
// runtime's Sweep.
func CgroupIDs() []string {
	var ids []string
	for _, id := range cgroupfs.Host().Names(cgroupParent, v1Controllers) {
		if ValidID(id) {
			ids = append(ids, id)
		}
	}
	return ids
}
