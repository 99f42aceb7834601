// Package confine is the one confinement policy of every sandbox, whatever
// its runtime: the seccomp filter, the /proc and /sys paths hidden from it,
// the capabilities it keeps, and the host ids its root and users map to.
// Each is defined here once; the runtimes' init stages apply it (native's
// nsinit on the host kernel, gvisor's ginit inside the sentry, microvm's
// vminit inside the guest) and the conformance suite (runtimetest) checks
// it.
//
// Where the runtimes once had copies that drifted, the policy is their
// union: every rule any of them had applies to all of them.
package confine

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// IDBase is the id (uid and gid) that a sandbox's root maps to outside its
// user namespace, and IDSize how many ids are mapped: sandbox ids
// 0..IDSize-1 are IDBase.. outside. The same numbers on the host (native),
// in gVisor's sentry and in a microvm guest, so a writable layer or disk
// made for one has the owners the others expect.
const (
	IDBase = 100000000
	IDSize = 65536
)

// Capabilities is the set a sandbox keeps, all of it only meaningful in its
// own user namespace: docker's default set without NET_RAW, MKNOD and
// SETFCAP. Everything else (SYS_ADMIN, NET_ADMIN, SYS_PTRACE, …) leaves
// the bounding set for good.
var Capabilities = []Capability{
	{unix.CAP_CHOWN, "CAP_CHOWN"},
	{unix.CAP_DAC_OVERRIDE, "CAP_DAC_OVERRIDE"},
	{unix.CAP_FOWNER, "CAP_FOWNER"},
	{unix.CAP_FSETID, "CAP_FSETID"},
	{unix.CAP_KILL, "CAP_KILL"},
	{unix.CAP_SETGID, "CAP_SETGID"},
	{unix.CAP_SETUID, "CAP_SETUID"},
	{unix.CAP_SETPCAP, "CAP_SETPCAP"},
	{unix.CAP_NET_BIND_SERVICE, "CAP_NET_BIND_SERVICE"},
	{unix.CAP_SYS_CHROOT, "CAP_SYS_CHROOT"},
	{unix.CAP_AUDIT_WRITE, "CAP_AUDIT_WRITE"},
}

// Capability is one capability, by number and by the name OCI specs use.
type Capability struct {
	Num  int
	Name string
}

// CapabilityMask is Capabilities as a CapEff-style bit mask.
func CapabilityMask() uint64 {
	var m uint64
	for _, c := range Capabilities {
		m |= 1 << uint(c.Num)
	}
	return m
}

// CapabilityNames is Capabilities by name, for an OCI spec.
func CapabilityNames() []string {
	names := make([]string, len(Capabilities))
	for i, c := range Capabilities {
		names[i] = c.Name
	}
	return names
}

// MaskedPaths are hidden from a sandbox behind /dev/null (files) or an
// empty read-only tmpfs (directories): they show the kernel's memory, keys
// and timers, or poke hardware. A path the kernel does not have is
// skipped.
var MaskedPaths = []string{
	"/proc/acpi",
	"/proc/asound",
	"/proc/kcore",
	"/proc/keys",
	"/proc/latency_stats",
	"/proc/timer_list",
	"/proc/timer_stats",
	"/proc/sched_debug",
	"/proc/scsi",
	"/proc/sysrq-trigger",
	"/sys/firmware",
	"/sys/devices/virtual/powercap",
	"/sys/kernel/debug",
	"/sys/kernel/security",
}

// ReadonlyPaths stay visible but cannot be written. They matter where the
// sandbox's kernel is the host's (native): elsewhere the kernel's own
// permission checks keep sandbox root out of them already.
var ReadonlyPaths = []string{
	"/proc/bus",
	"/proc/fs",
	"/proc/irq",
	"/proc/sys",
}

// Mask hides path (see MaskedPaths): files behind /dev/null, directories
// behind an empty read-only tmpfs. A path that does not exist is skipped.
func Mask(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("mask %s: %w", path, err)
	}
	if fi.IsDir() {
		err = unix.Mount("tmpfs", path, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0,mode=555")
	} else {
		err = unix.Mount("/dev/null", path, "", unix.MS_BIND, "")
	}
	if err != nil {
		return fmt.Errorf("mask %s: %w", path, err)
	}
	return nil
}
