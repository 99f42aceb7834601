// Package ginit runs inside space-agent when the gvisor runtime starts it as
// a sandbox's init. It puts the agent in a user namespace of its own inside
// gVisor, as native does on the host: sandbox root is then uid 100000000 of
// the sentry's root namespace, its capabilities are confined to that
// namespace, and /proc/self/uid_map says so.
//
// Stages, chosen by EnvStage:
//
//	outer  the container's init (root of the sentry's root user namespace).
//	       Starts itself again in a new user and pid namespace with ids
//	       0..65535 mapped to IDBase…, then waits for it and exits with its
//	       status, so the sandbox ends when the agent does. Meanwhile it is
//	       the sandbox's OOM killer when the runtime set EnvMemoryLimit
//	       (oom.go): gVisor enforces no memory limit inside.
//	inner  first process of the new namespaces. Mounts its /proc, bounds
//	       its capabilities to docker's default set, sets no_new_privs and a
//	       seccomp filter that refuses new namespaces and mounts, on every
//	       thread, and returns: the agent runs in this process.
//
// The host maps the template (an id-mapped mount) and the writable layer to
// IDBase, so files are owned by root inside.
package ginit

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	goruntime "runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// EnvStage selects the stage; the agent proper runs without it.
const EnvStage = "SPACE_GINIT"

// Stage values.
const (
	StageOuter = "outer"
	stageInner = "inner"
	// StageConfine is inner for a sandbox with no outer filter around it:
	// the microvm guest's init starts the agent in its namespaces itself
	// (package vminit) and there is no OCI spec whose seccomp policy
	// would apply. Besides what inner does it masks the /proc files a
	// real kernel has and gVisor's lacks, and adds the spec's denials to
	// the filter (confine.go).
	StageConfine = "confine"
	// StageHold blocks until stdin reaches EOF, then exits. The host starts
	// it in a new user namespace to hold that namespace while it opens it
	// (for id-mapped mounts): a Go program cannot create one in-process.
	StageHold = "hold"
)

// IDBase is the sentry-side uid/gid of sandbox root, IDSize the mapped range
// (the same numbers as native's host mapping).
const (
	IDBase = 100000000
	IDSize = 65536
)

// Enter does nothing unless the process was started by the gvisor runtime.
// In the outer stage it never returns.
func Enter() error {
	switch stage := os.Getenv(EnvStage); stage {
	case "":
		return nil
	case StageOuter:
		os.Exit(outer())
	case stageInner:
		return inner()
	case StageConfine:
		return confine()
	case StageHold:
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	default:
		return fmt.Errorf("unknown %s=%q", EnvStage, stage)
	}
	return nil
}

func outer() int {
	// The agent handles termination signals itself; this process only
	// waits, so it ignores them (as PID 1 it gets only those it handles).
	signal.Ignore(unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE)
	var guard *memoryGuard
	if limit, _ := strconv.ParseUint(os.Getenv(EnvMemoryLimit), 10, 64); limit > 0 {
		guard = newMemoryGuard(limit, os.Getenv(EnvOOMDir))
	}
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(withoutStage(os.Environ()), EnvStage+"="+stageInner)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// A mount namespace of its own, so that it can mount the /proc of
		// its pid namespace.
		Cloneflags:                 unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNS,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: IDBase, Size: IDSize}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: IDBase, Size: IDSize}},
		GidMappingsEnableSetgroups: true,
		Credential:                 &syscall.Credential{Uid: 0, Gid: 0},
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: gvisor init: starting the agent in its user namespace:", err)
		return 125
	}
	if guard != nil {
		guard.start(cmd.Process.Pid)
	}
	err := cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	if err != nil {
		return 125
	}
	return 0
}

// withoutStage drops this package's variables (the stage, the memory
// guard's settings) from env.
func withoutStage(env []string) []string {
	out := env[:0:0]
	for _, e := range env {
		if strings.HasPrefix(e, EnvStage+"=") || strings.HasPrefix(e, EnvStage+"_") {
			continue
		}
		out = append(out, e)
	}
	return out
}

// mountProc mounts the /proc of the agent's pid namespace over the
// container's, so that the agent is PID 1 there too (as it is to itself),
// and masks sysrq-trigger again as the runtime's spec does.
func mountProc() error {
	_ = unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "")
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if _, err := os.Stat("/proc/sysrq-trigger"); err == nil {
		if err := unix.Mount("/dev/null", "/proc/sysrq-trigger", "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mask /proc/sysrq-trigger: %w", err)
		}
	}
	return nil
}

// dockerCaps is docker's default capability set.
var dockerCaps = []uintptr{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_FOWNER, unix.CAP_FSETID, unix.CAP_KILL,
	unix.CAP_SETGID, unix.CAP_SETUID, unix.CAP_SETPCAP, unix.CAP_NET_BIND_SERVICE, unix.CAP_NET_RAW,
	unix.CAP_SYS_CHROOT, unix.CAP_MKNOD, unix.CAP_AUDIT_WRITE, unix.CAP_SETFCAP,
}

func inner() error { return enterConfined(nil, nil) }

// enterConfined is the inner stage, with maskedProc (besides
// sysrq-trigger) bound over by /dev/null and extraDenied refused with
// EPERM by the seccomp filter.
func enterConfined(maskedProc []string, extraDenied []uint32) error {
	os.Unsetenv(EnvStage)
	if err := mountProc(); err != nil {
		return err
	}
	if err := maskProc(maskedProc); err != nil {
		return err
	}
	// Capabilities, no_new_privs and seccomp are per-thread. Applied to
	// every thread of this process at once, the agent can run here
	// directly; where Go cannot do that (a cgo build), this thread applies
	// them and execs the agent, which makes its state the whole process's.
	// A Go program's start costs ~80 ms under gVisor, so the first way saves
	// one.
	err := limitCapabilities(allThreads)
	if errors.Is(err, syscall.ENOTSUP) {
		return innerExec(extraDenied)
	}
	if err != nil {
		return err
	}
	if _, _, errno := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0); errno != 0 {
		return fmt.Errorf("no_new_privs: %w", errno)
	}
	return loadSeccomp(unix.SECCOMP_FILTER_FLAG_TSYNC, extraDenied)
}

// innerExec is inner for a process that cannot change all its threads.
func innerExec(extraDenied []uint32) error {
	goruntime.LockOSThread()
	if err := limitCapabilities(thisThread); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	if err := loadSeccomp(0, extraDenied); err != nil {
		return err
	}
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return err
	}
	return fmt.Errorf("exec agent: %w", unix.Exec(exe, os.Args, os.Environ()))
}

type syscaller func(trap, a1, a2, a3 uintptr) (r1, r2 uintptr, err syscall.Errno)

func allThreads(trap, a1, a2, a3 uintptr) (uintptr, uintptr, syscall.Errno) {
	return syscall.AllThreadsSyscall(trap, a1, a2, a3)
}

func thisThread(trap, a1, a2, a3 uintptr) (uintptr, uintptr, syscall.Errno) {
	return syscall.RawSyscall(trap, a1, a2, a3)
}

// limitCapabilities drops every capability outside docker's set from the
// bounding set, and sets the permitted, effective and inheritable sets to
// it, through call: on every thread, or on this one before an exec.
func limitCapabilities(call syscaller) error {
	keep := map[uintptr]bool{}
	var mask [2]uint32
	for _, c := range dockerCaps {
		keep[c] = true
		mask[c/32] |= 1 << (c % 32)
	}
	for c := uintptr(0); c <= unix.CAP_LAST_CAP; c++ {
		if keep[c] {
			continue
		}
		if _, _, errno := call(unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, c, 0); errno != 0 && errno != unix.EINVAL {
			if errno == syscall.ENOTSUP {
				return errno
			}
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, errno)
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: mask[0], Permitted: mask[0], Inheritable: 0},
		{Effective: mask[1], Permitted: mask[1], Inheritable: 0},
	}
	if _, _, errno := call(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); errno != 0 {
		return fmt.Errorf("capset: %w", errno)
	}
	// The agent runs as root: after exec, root's permitted set is the
	// bounding set anyway; ambient stays empty.
	return nil
}

// Seccomp: inside the agent's user namespace nothing may create another
// namespace (which would hand back every capability dropped above) or
// mount anything. Everything else the sandbox may not do is refused by the
// OCI spec's filter, which applies to every process of the sandbox.
const (
	offNr    = 0
	offArch  = 4
	offArg0  = 16
	retAllow = unix.SECCOMP_RET_ALLOW
	nsFlags  = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
		unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET
)

func stmt(code uint16, k uint32) unix.SockFilter { return unix.SockFilter{Code: code, K: k} }
func jump(code uint16, k uint32, jt, jf uint8) unix.SockFilter {
	return unix.SockFilter{Code: code, Jt: jt, Jf: jf, K: k}
}

// deniedMounts are refused by this filter rather than the OCI spec's,
// which would also refuse them to mountProc.
var deniedMounts = []uint32{
	unix.SYS_MOUNT, unix.SYS_UMOUNT2, unix.SYS_PIVOT_ROOT, unix.SYS_FSOPEN, unix.SYS_FSMOUNT,
	unix.SYS_FSCONFIG, unix.SYS_FSPICK, unix.SYS_MOVE_MOUNT, unix.SYS_OPEN_TREE, unix.SYS_MOUNT_SETATTR,
}

func filter(extraDenied []uint32) []unix.SockFilter {
	eperm := uint32(unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM))
	enosys := uint32(unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS))
	ld := uint16(unix.BPF_LD | unix.BPF_W | unix.BPF_ABS)
	jeq := uint16(unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K)
	jset := uint16(unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K)
	ret := uint16(unix.BPF_RET | unix.BPF_K)
	p := []unix.SockFilter{
		stmt(ld, offArch),
		jump(jeq, unix.AUDIT_ARCH_X86_64, 1, 0),
		stmt(ret, uint32(unix.SECCOMP_RET_KILL_PROCESS)),
		stmt(ld, offNr),
	}
	for _, nr := range append(deniedMounts[:len(deniedMounts):len(deniedMounts)], extraDenied...) {
		p = append(p, jump(jeq, nr, 0, 1), stmt(ret, eperm))
	}
	return append(p,
		jump(jeq, unix.SYS_CLONE3, 0, 1),
		stmt(ret, enosys), // libc falls back to clone, checked below
		jump(jeq, unix.SYS_CLONE, 1, 0),
		jump(jeq, unix.SYS_UNSHARE, 0, 3),
		stmt(ld, offArg0),
		jump(jset, nsFlags, 0, 1),
		stmt(ret, eperm),
		stmt(ret, retAllow),
	)
}

// loadSeccomp installs the filter on this thread, or on all threads with
// SECCOMP_FILTER_FLAG_TSYNC; no_new_privs is set.
func loadSeccomp(flags uintptr, extraDenied []uint32) error {
	f := filter(extraDenied)
	prog := unix.SockFprog{Len: uint16(len(f)), Filter: &f[0]}
	_, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, uintptr(unsafe.Pointer(&prog)))
	if errno != 0 {
		return fmt.Errorf("load seccomp filter: %w", errno)
	}
	return nil
}
