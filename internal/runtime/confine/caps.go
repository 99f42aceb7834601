package confine

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Syscaller makes a raw syscall: on the calling thread (ThisThread) or on
// every thread of the process (AllThreads).
type Syscaller func(trap, a1, a2, a3 uintptr) (r1, r2 uintptr, err syscall.Errno)

// ThisThread and AllThreads are the two Syscallers. AllThreads fails with
// ENOTSUP where Go cannot do it (a cgo build): confine one thread then and
// make its state the process's with an execve.
var (
	ThisThread Syscaller = syscall.RawSyscall
	AllThreads Syscaller = syscall.AllThreadsSyscall
)

func lastCap() uintptr {
	data, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && n >= 0 {
			return uintptr(n)
		}
	}
	return 63
}

// DropCapabilities shrinks the bounding set to Capabilities, clears the
// ambient and inheritable sets and sets effective and permitted to
// Capabilities, through call. After an execve a uid-0 process gets
// permitted = bounding, so nothing it starts ever holds more. An error
// wrapping ENOTSUP means call cannot be used here.
func DropCapabilities(call Syscaller) error {
	keep := CapabilityMask()
	// Read once: it is a file, and this loop runs ~40 times.
	last := lastCap()
	for c := uintptr(0); c <= last; c++ {
		if keep&(1<<c) != 0 {
			continue
		}
		if _, _, errno := call(unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, c, 0); errno != 0 && errno != unix.EINVAL {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, errno)
		}
	}
	// EINVAL: a kernel without ambient capabilities (there are none to clear).
	if _, _, errno := call(unix.SYS_PRCTL, unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0); errno != 0 && errno != unix.EINVAL {
		return fmt.Errorf("clear ambient capabilities: %w", errno)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: uint32(keep), Permitted: uint32(keep)},
		{Effective: uint32(keep >> 32), Permitted: uint32(keep >> 32)},
	}
	if _, _, errno := call(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); errno != 0 {
		return fmt.Errorf("capset: %w", errno)
	}
	return nil
}
