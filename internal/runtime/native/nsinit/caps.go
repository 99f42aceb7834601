package nsinit

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// KeptCapabilities is the docker-like default set a sandbox keeps (all of
// them only meaningful inside its user namespace). Everything else —
// SYS_ADMIN, NET_ADMIN, NET_RAW, SYS_PTRACE, MKNOD, … — leaves the bounding
// set for good.
var KeptCapabilities = []int{
	unix.CAP_CHOWN,
	unix.CAP_DAC_OVERRIDE,
	unix.CAP_FOWNER,
	unix.CAP_FSETID,
	unix.CAP_KILL,
	unix.CAP_SETGID,
	unix.CAP_SETUID,
	unix.CAP_SETPCAP,
	unix.CAP_NET_BIND_SERVICE,
	unix.CAP_SYS_CHROOT,
	unix.CAP_AUDIT_WRITE,
}

// KeptCapabilityMask is KeptCapabilities as a CapEff-style bit mask.
func KeptCapabilityMask() uint64 {
	var m uint64
	for _, c := range KeptCapabilities {
		m |= 1 << uint(c)
	}
	return m
}

func lastCap() int {
	data, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil {
			return n
		}
	}
	return 63
}

// dropCapabilities shrinks the calling thread's bounding set, clears the
// ambient set and sets effective, permitted and inheritable to the kept set.
// After the final execve a uid-0 process gets permitted = bounding, so the
// agent and everything it starts never hold more.
func dropCapabilities() error {
	keep := KeptCapabilityMask()
	// Read once: it is a file, and this loop runs ~40 times.
	last := lastCap()
	for c := 0; c <= last; c++ {
		if keep&(1<<uint(c)) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && err != unix.EINVAL {
			return fmt.Errorf("drop capability %d from bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: uint32(keep), Permitted: uint32(keep), Inheritable: uint32(keep)},
		{Effective: uint32(keep >> 32), Permitted: uint32(keep >> 32), Inheritable: uint32(keep >> 32)},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}
