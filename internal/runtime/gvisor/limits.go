package gvisor

import (
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
)

// Memory limits take two layers under gVisor (docs/gvisor.md, "Limits"):
//
//   - Inside, the sandbox's limit is Limits.MemoryMiB: the sentry reports it
//     as MemTotal (runsc derives --total-memory from the spec's cgroup
//     limit), and ginit's memory guard kills a process inside when the
//     sentry's accounting reaches it, as Linux's memory cgroup would. The
//     sandbox's agent survives; Stats counts the kill.
//   - On the host, the sandbox's cgroup gets hostMemoryLimit: the limit plus
//     headroom for what the sentry, the gofer and the systrap stubs use
//     themselves and for the guard's reaction time. The host's OOM killer
//     would kill the whole sandbox (every page of it is the sentry's), so
//     it is only a backstop that a working guard never reaches.

// oomDirName is the directory, in the agent's host directory (mounted at
// agentDir), where the guard keeps its kill count.
const oomDirName = "oom"

// hostMemoryLimit is the host cgroup's memory limit for a sandbox limited
// to l.MemoryMiB inside: 64 MiB for the sentry and gofer themselves, an
// eighth of the limit for what the guard's poll interval lets through, and
// 512 KiB per allowed task for the sentry's task state and each systrap
// stub's page tables (measured: a 57-process fork bomb adds ~40 MiB on the
// host beyond what the sentry accounts to the sandbox).
func hostMemoryLimit(l api.Limits) int64 {
	mem := l.MemoryMiB << 20
	pids := l.Pids
	if pids <= 0 || pids > 1024 {
		pids = 1024
	}
	return mem + 64<<20 + mem/8 + pids<<19
}

// guardEnv is the environment that makes ginit's outer stage run the
// memory guard for l.
func guardEnv(l api.Limits) []string {
	if l.MemoryMiB <= 0 {
		return nil
	}
	return []string{
		ginit.EnvMemoryLimit + "=" + strconv.FormatInt(l.MemoryMiB<<20, 10),
		ginit.EnvOOMDir + "=" + agentDir + "/" + oomDirName,
	}
}

// raiseHostMemory moves sandbox id's host memory limit from l.MemoryMiB,
// which runsc applied so that the sentry reports it as the sandbox's total
// memory, to hostMemoryLimit(l). It runs right after `runsc run` or
// `runsc restore`, before the sandbox can have used its headroom.
func raiseHostMemory(id string, l api.Limits) error {
	if l.MemoryMiB <= 0 {
		return nil
	}
	return sandboxCgroup(id).SetMemoryLimit(hostMemoryLimit(l))
}

// guardKills reads the guard's kill count from the sandbox's agent
// directory. The sandbox can write that directory, so the count is trusted
// only from a directory and file owned by root, which the guard (root of
// the sentry) makes and sandbox root (uid confine.IDBase) cannot; anything
// else reads as 0. Nothing on the path is followed.
func guardKills(hostAgentDir string) int64 {
	dfd, err := unix.Open(hostAgentDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(dfd)
	ofd, err := unix.Openat(dfd, oomDirName, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(ofd)
	if !ownedByRoot(ofd) {
		return 0
	}
	fd, err := unix.Openat(ofd, ginit.OOMCountFile, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != 0 {
		return 0
	}
	buf := make([]byte, 32)
	n, err := unix.Read(fd, buf)
	if err != nil || n <= 0 {
		return 0
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(buf[:n])), 10, 64)
	if err != nil || v < 0 {
		return 0
	}
	return v
}

func ownedByRoot(fd int) bool {
	var st unix.Stat_t
	return unix.Fstat(fd, &st) == nil && st.Uid == 0 && st.Mode&0o022 == 0
}
