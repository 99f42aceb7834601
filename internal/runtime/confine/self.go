package confine

import (
	"errors"
	"fmt"
	"os"
	goruntime "runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// Role is the first argument of space-agent that runs Self and then the
// agent: the stage a gvisor or microvm sandbox's init starts the agent as.
const Role = "confine"

// Self confines the calling process, the agent of a sandbox with a kernel
// of its own (OwnKernel), as the first thing it does in the user, pid and
// mount namespaces its parent started it in (gvisor's container init,
// microvm's guest init): it mounts the /proc of its pid namespace, masks
// MaskedPaths, keeps only Capabilities, sets no_new_privs and loads the
// filter, on every thread at once, and returns: the agent then runs in
// this process, with the arguments Self returns: agentArgs with the
// agent's channel named through a descriptor only the agent holds
// (HideChannel). Where Go cannot change every thread (a cgo build), it
// confines this thread and execs its own binary as the plain agent with
// those arguments instead.
func Self(agentArgs []string) ([]string, error) {
	// The /proc of the agent's pid namespace over the parent's, so that the
	// agent is PID 1 there too (as it is to itself).
	_ = unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "")
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return nil, fmt.Errorf("mount /proc: %w", err)
	}
	for _, p := range MaskedPaths {
		if err := Mask(p); err != nil {
			return nil, err
		}
	}
	// Before the capabilities go: covering a path is a mount.
	agentArgs, err := HideChannel(agentArgs)
	if err != nil {
		return nil, err
	}
	// A Go program's start costs ~80 ms under gVisor: confining every
	// thread in place saves one.
	err = DropCapabilities(AllThreads)
	if errors.Is(err, syscall.ENOTSUP) {
		return nil, selfExec(agentArgs)
	}
	if err != nil {
		return nil, err
	}
	if _, _, errno := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0); errno != 0 {
		return nil, fmt.Errorf("no_new_privs: %w", errno)
	}
	return agentArgs, LoadFilter(OwnKernel, unix.SECCOMP_FILTER_FLAG_TSYNC)
}

// selfExec is Self for a process that cannot change all its threads.
func selfExec(agentArgs []string) error {
	goruntime.LockOSThread()
	if err := DropCapabilities(ThisThread); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	if err := LoadFilter(OwnKernel, 0); err != nil {
		return err
	}
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return fmt.Errorf("exec agent: %w", err)
	}
	// The channel's descriptors (HideChannel) are the agent's, across exec.
	for _, fd := range channelFDs(agentArgs) {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, 0); err != nil {
			return fmt.Errorf("exec agent: keep descriptor %d: %w", fd, err)
		}
	}
	argv := append([]string{os.Args[0]}, agentArgs...)
	return fmt.Errorf("exec agent: %w", unix.Exec(exe, argv, os.Environ()))
}
