package gvisor

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
)

// runsc creates each sandbox's cgroups from the spec's cgroupsPath
// (/space-gvisor/<id>) and applies linux.resources to them; the host reads
// its statistics back from the same files, never from the sandbox.

// v1Controllers are the hierarchies runsc puts a sandbox in on a v1 host.
var v1Controllers = []string{"memory", "pids", "cpu", "cpuacct", "freezer", "devices", "cpuset", "blkio"}

func cgroupV2() bool { return cgroupfs.Host().Unified }

// sandboxCgroup is sandbox id's cgroup.
func sandboxCgroup(id string) *cgroupfs.Group {
	return cgroupfs.Host().Group(cgroupBase, id, v1Controllers)
}

// cgroupStats reads memory, OOM kills and CPU of sandbox id from its host
// cgroups. Pids is filled by the caller: the host's pids counter counts the
// sentry's threads, not the sandbox's processes.
func cgroupStats(id string) (runtime.Stats, error) {
	var s runtime.Stats
	var err error
	g := sandboxCgroup(id)
	if s.MemoryBytes, err = g.MemoryBytes(); err != nil {
		return s, err
	}
	if s.OOMKills, err = g.OOMKills(); err != nil {
		return s, err
	}
	s.CPUNanos, err = g.CPUNanos()
	return s, err
}

// cgroupProcs lists the host pids in sandbox id's cgroups.
func cgroupProcs(id string) []int {
	pids, _ := sandboxCgroup(id).Procs()
	return pids
}

// removeCgroups removes sandbox id's (empty) cgroups; runsc removes them on
// delete, this catches a sandbox that died without one.
func removeCgroups(id string) error { return sandboxCgroup(id).Remove() }

// cgroupIDs lists the sandbox ids that have a cgroup of this runtime.
func cgroupIDs() []string { return cgroupfs.Host().Names(cgroupBase, v1Controllers) }

// killCgroup SIGKILLs every host process in sandbox id's cgroups.
func killCgroup(id string) {
	for round := 0; round < 50; round++ {
		pids := cgroupProcs(id)
		if len(pids) == 0 {
			return
		}
		for _, p := range pids {
			_ = unix.Kill(p, unix.SIGKILL)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
