package confine

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The seccomp filter is assembled here, by one small assembler, so that
// every decision is visible in this file. For every sandbox:
//
//   - a foreign architecture or the x32 ABI kills the process (they would
//     reach different syscall numbers than the ones checked);
//   - no new namespaces: clone and unshare with a namespace flag fail with
//     EPERM (an unprivileged user namespace would give back every
//     capability the sandbox dropped; a time namespace would let it lie
//     about the clock to its own children), and clone3, whose flags a
//     filter cannot read, fails with ENOSYS so that libc falls back to
//     clone;
//   - Denied and DeniedMounts fail with EPERM.
//
// Then it depends on whose kernel the sandbox's syscalls reach (Kernel):
// the host's kernel allows only Allowed (and socket and ioctl with checked
// arguments), everything else fails with EPERM; a kernel of the sandbox's
// own allows everything else.

// Kernel says whose kernel a sandbox's syscalls reach.
type Kernel int

const (
	// HostKernel: the sandbox runs on the host's kernel (native). The
	// filter is an allowlist.
	HostKernel Kernel = iota
	// OwnKernel: the sandbox has a kernel of its own (gVisor's sentry, a
	// microvm guest's Linux), which is the isolation boundary. The filter
	// refuses only what would undo the sandbox's confinement inside it or
	// reach that kernel's machinery (Denied, DeniedMounts, namespaces).
	OwnKernel
)

const (
	retKill  = unix.SECCOMP_RET_KILL_PROCESS
	retAllow = unix.SECCOMP_RET_ALLOW
	retEPERM = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)

	x32SyscallBit = 0x40000000

	// Offsets in struct seccomp_data (little endian: low word first).
	offNr   = 0
	offArch = 4
)

func offArgLo(i int) uint32 { return 16 + 8*uint32(i) }

func retErrno(e unix.Errno) uint32 { return unix.SECCOMP_RET_ERRNO | uint32(e) }

// NamespaceFlags are the namespace-creating clone flags a sandbox may not
// use. CLONE_NEWTIME (0x80) overlaps clone's exit-signal byte, so it is
// checked for unshare only (clone cannot create a time namespace).
const NamespaceFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET

// Syscall is a syscall by number and by the name OCI specs use.
type Syscall struct {
	Nr   uint32
	Name string
}

// Denied are refused with EPERM to every process of every sandbox:
// keyrings, bpf, perf, ptrace and other processes' memory, kernel modules
// and kexec, io_uring, userfaultfd, file handles, the machine's identity,
// swap, power, logs and accounting. (docker's default profile refuses them
// too.)
var Denied = []Syscall{
	{unix.SYS_KEYCTL, "keyctl"}, {unix.SYS_ADD_KEY, "add_key"}, {unix.SYS_REQUEST_KEY, "request_key"},
	{unix.SYS_BPF, "bpf"}, {unix.SYS_PERF_EVENT_OPEN, "perf_event_open"}, {unix.SYS_PTRACE, "ptrace"},
	{unix.SYS_PROCESS_VM_READV, "process_vm_readv"}, {unix.SYS_PROCESS_VM_WRITEV, "process_vm_writev"},
	{unix.SYS_KCMP, "kcmp"}, {unix.SYS_PIDFD_GETFD, "pidfd_getfd"}, {unix.SYS_SETNS, "setns"},
	{unix.SYS_KEXEC_LOAD, "kexec_load"}, {unix.SYS_KEXEC_FILE_LOAD, "kexec_file_load"},
	{unix.SYS_INIT_MODULE, "init_module"}, {unix.SYS_FINIT_MODULE, "finit_module"},
	{unix.SYS_DELETE_MODULE, "delete_module"}, {unix.SYS_USERFAULTFD, "userfaultfd"},
	{unix.SYS_IO_URING_SETUP, "io_uring_setup"}, {unix.SYS_IO_URING_ENTER, "io_uring_enter"},
	{unix.SYS_IO_URING_REGISTER, "io_uring_register"},
	{unix.SYS_OPEN_BY_HANDLE_AT, "open_by_handle_at"}, {unix.SYS_NAME_TO_HANDLE_AT, "name_to_handle_at"},
	{unix.SYS_SWAPON, "swapon"}, {unix.SYS_SWAPOFF, "swapoff"}, {unix.SYS_REBOOT, "reboot"},
	{unix.SYS_SYSLOG, "syslog"}, {unix.SYS_ACCT, "acct"}, {unix.SYS_QUOTACTL, "quotactl"},
	{unix.SYS_SETHOSTNAME, "sethostname"}, {unix.SYS_SETDOMAINNAME, "setdomainname"},
}

// DeniedMounts are refused with EPERM once a sandbox is confined: every
// way to mount, unmount or move a mount. They are separate from Denied
// because a runtime's outer filter (gvisor's OCI spec) must still let the
// init stage mount the sandbox's /proc before it confines itself.
var DeniedMounts = []Syscall{
	{unix.SYS_MOUNT, "mount"}, {unix.SYS_UMOUNT2, "umount2"}, {unix.SYS_PIVOT_ROOT, "pivot_root"},
	{unix.SYS_FSOPEN, "fsopen"}, {unix.SYS_FSMOUNT, "fsmount"}, {unix.SYS_FSCONFIG, "fsconfig"},
	{unix.SYS_FSPICK, "fspick"}, {unix.SYS_MOVE_MOUNT, "move_mount"}, {unix.SYS_OPEN_TREE, "open_tree"},
	{unix.SYS_MOUNT_SETATTR, "mount_setattr"},
}

// DeniedNames is Denied by name, for an OCI spec.
func DeniedNames() []string {
	names := make([]string, len(Denied))
	for i, s := range Denied {
		names[i] = s.Name
	}
	return names
}

// Allowed are passed without argument checks on the host's kernel; every
// syscall not listed fails with EPERM there. Deliberately absent, besides
// Denied and DeniedMounts: chroot-escaping helpers, iopl/ioperm,
// modify_ldt, *mempolicy/mbind/move_pages, fanotify_init,
// statmount/listmount/listns, memfd_secret, settimeofday/clock_settime.
// socket and ioctl are checked separately (filter).
var Allowed = []uint32{
	unix.SYS_ACCEPT, unix.SYS_ACCEPT4, unix.SYS_ACCESS, unix.SYS_ADJTIMEX, unix.SYS_ALARM,
	unix.SYS_ARCH_PRCTL, unix.SYS_BIND, unix.SYS_BRK, unix.SYS_CACHESTAT, unix.SYS_CAPGET,
	unix.SYS_CAPSET, unix.SYS_CHDIR, unix.SYS_CHMOD, unix.SYS_CHOWN, unix.SYS_CHROOT,
	unix.SYS_CLOCK_ADJTIME, unix.SYS_CLOCK_GETRES, unix.SYS_CLOCK_GETTIME, unix.SYS_CLOCK_NANOSLEEP,
	unix.SYS_CLOSE, unix.SYS_CLOSE_RANGE, unix.SYS_CONNECT, unix.SYS_COPY_FILE_RANGE, unix.SYS_CREAT,
	unix.SYS_DUP, unix.SYS_DUP2, unix.SYS_DUP3, unix.SYS_EPOLL_CREATE, unix.SYS_EPOLL_CREATE1,
	unix.SYS_EPOLL_CTL, unix.SYS_EPOLL_PWAIT, unix.SYS_EPOLL_PWAIT2, unix.SYS_EPOLL_WAIT,
	unix.SYS_EVENTFD, unix.SYS_EVENTFD2, unix.SYS_EXECVE, unix.SYS_EXECVEAT, unix.SYS_EXIT,
	unix.SYS_EXIT_GROUP, unix.SYS_FACCESSAT, unix.SYS_FACCESSAT2, unix.SYS_FADVISE64,
	unix.SYS_FALLOCATE, unix.SYS_FANOTIFY_MARK, unix.SYS_FCHDIR, unix.SYS_FCHMOD, unix.SYS_FCHMODAT,
	unix.SYS_FCHMODAT2, unix.SYS_FCHOWN, unix.SYS_FCHOWNAT, unix.SYS_FCNTL, unix.SYS_FDATASYNC,
	unix.SYS_FGETXATTR, unix.SYS_FLISTXATTR, unix.SYS_FLOCK, unix.SYS_FORK, unix.SYS_FREMOVEXATTR,
	unix.SYS_FSETXATTR, unix.SYS_FSTAT, unix.SYS_FSTATFS, unix.SYS_FSYNC, unix.SYS_FTRUNCATE,
	unix.SYS_FUTEX, unix.SYS_FUTEX_REQUEUE, unix.SYS_FUTEX_WAIT, unix.SYS_FUTEX_WAITV,
	unix.SYS_FUTEX_WAKE, unix.SYS_FUTIMESAT, unix.SYS_GETCPU, unix.SYS_GETCWD, unix.SYS_GETDENTS,
	unix.SYS_GETDENTS64, unix.SYS_GETEGID, unix.SYS_GETEUID, unix.SYS_GETGID, unix.SYS_GETGROUPS,
	unix.SYS_GETITIMER, unix.SYS_GETPEERNAME, unix.SYS_GETPGID, unix.SYS_GETPGRP, unix.SYS_GETPID,
	unix.SYS_GETPPID, unix.SYS_GETPRIORITY, unix.SYS_GETRANDOM, unix.SYS_GETRESGID,
	unix.SYS_GETRESUID, unix.SYS_GETRLIMIT, unix.SYS_GET_ROBUST_LIST, unix.SYS_GETRUSAGE,
	unix.SYS_GETSID, unix.SYS_GETSOCKNAME, unix.SYS_GETSOCKOPT, unix.SYS_GET_THREAD_AREA,
	unix.SYS_GETTID, unix.SYS_GETTIMEOFDAY, unix.SYS_GETUID, unix.SYS_GETXATTR, unix.SYS_GETXATTRAT,
	unix.SYS_GET_MEMPOLICY, unix.SYS_INOTIFY_ADD_WATCH, unix.SYS_INOTIFY_INIT, unix.SYS_INOTIFY_INIT1,
	unix.SYS_INOTIFY_RM_WATCH, unix.SYS_IO_CANCEL, unix.SYS_IO_DESTROY, unix.SYS_IO_GETEVENTS,
	unix.SYS_IO_PGETEVENTS, unix.SYS_IOPRIO_GET, unix.SYS_IOPRIO_SET, unix.SYS_IO_SETUP,
	unix.SYS_IO_SUBMIT, unix.SYS_KILL, unix.SYS_LANDLOCK_ADD_RULE, unix.SYS_LANDLOCK_CREATE_RULESET,
	unix.SYS_LANDLOCK_RESTRICT_SELF, unix.SYS_LCHOWN, unix.SYS_LGETXATTR, unix.SYS_LINK,
	unix.SYS_LINKAT, unix.SYS_LISTEN, unix.SYS_LISTXATTR, unix.SYS_LISTXATTRAT, unix.SYS_LLISTXATTR,
	unix.SYS_LREMOVEXATTR, unix.SYS_LSEEK, unix.SYS_LSETXATTR, unix.SYS_LSTAT, unix.SYS_MADVISE,
	unix.SYS_MAP_SHADOW_STACK, unix.SYS_MEMBARRIER, unix.SYS_MEMFD_CREATE, unix.SYS_MINCORE,
	unix.SYS_MKDIR, unix.SYS_MKDIRAT, unix.SYS_MKNOD, unix.SYS_MKNODAT, unix.SYS_MLOCK,
	unix.SYS_MLOCK2, unix.SYS_MLOCKALL, unix.SYS_MMAP, unix.SYS_MPROTECT, unix.SYS_MQ_GETSETATTR,
	unix.SYS_MQ_NOTIFY, unix.SYS_MQ_OPEN, unix.SYS_MQ_TIMEDRECEIVE, unix.SYS_MQ_TIMEDSEND,
	unix.SYS_MQ_UNLINK, unix.SYS_MREMAP, unix.SYS_MSEAL, unix.SYS_MSGCTL, unix.SYS_MSGGET,
	unix.SYS_MSGRCV, unix.SYS_MSGSND, unix.SYS_MSYNC, unix.SYS_MUNLOCK, unix.SYS_MUNLOCKALL,
	unix.SYS_MUNMAP, unix.SYS_NANOSLEEP, unix.SYS_NEWFSTATAT, unix.SYS_OPEN, unix.SYS_OPENAT,
	unix.SYS_OPENAT2, unix.SYS_PAUSE, unix.SYS_PERSONALITY, unix.SYS_PIDFD_OPEN,
	unix.SYS_PIDFD_SEND_SIGNAL, unix.SYS_PIPE, unix.SYS_PIPE2, unix.SYS_PKEY_ALLOC,
	unix.SYS_PKEY_FREE, unix.SYS_PKEY_MPROTECT, unix.SYS_POLL, unix.SYS_PPOLL, unix.SYS_PRCTL,
	unix.SYS_PREAD64, unix.SYS_PREADV, unix.SYS_PREADV2, unix.SYS_PRLIMIT64,
	unix.SYS_PROCESS_MADVISE, unix.SYS_PROCESS_MRELEASE, unix.SYS_PSELECT6, unix.SYS_PWRITE64,
	unix.SYS_PWRITEV, unix.SYS_PWRITEV2, unix.SYS_READ, unix.SYS_READAHEAD, unix.SYS_READLINK,
	unix.SYS_READLINKAT, unix.SYS_READV, unix.SYS_RECVFROM, unix.SYS_RECVMMSG, unix.SYS_RECVMSG,
	unix.SYS_REMAP_FILE_PAGES, unix.SYS_REMOVEXATTR, unix.SYS_REMOVEXATTRAT, unix.SYS_RENAME,
	unix.SYS_RENAMEAT, unix.SYS_RENAMEAT2, unix.SYS_RESTART_SYSCALL, unix.SYS_RMDIR, unix.SYS_RSEQ,
	unix.SYS_RT_SIGACTION, unix.SYS_RT_SIGPENDING, unix.SYS_RT_SIGPROCMASK, unix.SYS_RT_SIGQUEUEINFO,
	unix.SYS_RT_SIGRETURN, unix.SYS_RT_SIGSUSPEND, unix.SYS_RT_SIGTIMEDWAIT,
	unix.SYS_RT_TGSIGQUEUEINFO, unix.SYS_SCHED_GETAFFINITY, unix.SYS_SCHED_GETATTR,
	unix.SYS_SCHED_GETPARAM, unix.SYS_SCHED_GET_PRIORITY_MAX, unix.SYS_SCHED_GET_PRIORITY_MIN,
	unix.SYS_SCHED_GETSCHEDULER, unix.SYS_SCHED_RR_GET_INTERVAL, unix.SYS_SCHED_SETAFFINITY,
	unix.SYS_SCHED_SETATTR, unix.SYS_SCHED_SETPARAM, unix.SYS_SCHED_SETSCHEDULER,
	unix.SYS_SCHED_YIELD, unix.SYS_SECCOMP, unix.SYS_SELECT, unix.SYS_SEMCTL, unix.SYS_SEMGET,
	unix.SYS_SEMOP, unix.SYS_SEMTIMEDOP, unix.SYS_SENDFILE, unix.SYS_SENDMMSG, unix.SYS_SENDMSG,
	unix.SYS_SENDTO, unix.SYS_SETFSGID, unix.SYS_SETFSUID, unix.SYS_SETGID, unix.SYS_SETGROUPS,
	unix.SYS_SETITIMER, unix.SYS_SETPGID, unix.SYS_SETPRIORITY, unix.SYS_SETREGID,
	unix.SYS_SETRESGID, unix.SYS_SETRESUID, unix.SYS_SETREUID, unix.SYS_SETRLIMIT,
	unix.SYS_SET_ROBUST_LIST, unix.SYS_SETSID, unix.SYS_SETSOCKOPT, unix.SYS_SET_THREAD_AREA,
	unix.SYS_SET_TID_ADDRESS, unix.SYS_SETUID, unix.SYS_SETXATTR, unix.SYS_SETXATTRAT,
	unix.SYS_SHMAT, unix.SYS_SHMCTL, unix.SYS_SHMDT, unix.SYS_SHMGET, unix.SYS_SHUTDOWN,
	unix.SYS_SIGALTSTACK, unix.SYS_SIGNALFD, unix.SYS_SIGNALFD4, unix.SYS_SOCKETPAIR,
	unix.SYS_SPLICE, unix.SYS_STAT, unix.SYS_STATFS, unix.SYS_STATX, unix.SYS_SYMLINK,
	unix.SYS_SYMLINKAT, unix.SYS_SYNC, unix.SYS_SYNC_FILE_RANGE, unix.SYS_SYNCFS, unix.SYS_SYSINFO,
	unix.SYS_TEE, unix.SYS_TGKILL, unix.SYS_TIME, unix.SYS_TIMER_CREATE, unix.SYS_TIMER_DELETE,
	unix.SYS_TIMER_GETOVERRUN, unix.SYS_TIMER_GETTIME, unix.SYS_TIMER_SETTIME,
	unix.SYS_TIMERFD_CREATE, unix.SYS_TIMERFD_GETTIME, unix.SYS_TIMERFD_SETTIME, unix.SYS_TIMES,
	unix.SYS_TKILL, unix.SYS_TRUNCATE, unix.SYS_UMASK, unix.SYS_UNAME, unix.SYS_UNLINK,
	unix.SYS_UNLINKAT, unix.SYS_UTIME, unix.SYS_UTIMENSAT, unix.SYS_UTIMES, unix.SYS_VFORK,
	unix.SYS_VMSPLICE, unix.SYS_WAIT4, unix.SYS_WAITID, unix.SYS_WRITE, unix.SYS_WRITEV,
	unix.SYS_FILE_GETATTR, unix.SYS_FILE_SETATTR, unix.SYS_LSM_GET_SELF_ATTR,
	unix.SYS_LSM_LIST_MODULES, unix.SYS_RSEQ_SLICE_YIELD,
}

// program is a tiny assembler: blocks of instructions ending in a return.
type program []unix.SockFilter

func (p *program) ld(off uint32) {
	*p = append(*p, unix.SockFilter{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: off})
}

func (p *program) ret(v uint32) {
	*p = append(*p, unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: v})
}

// jmp adds a conditional jump; jt and jf count instructions to skip.
func (p *program) jmp(op uint16, k uint32, jt, jf uint8) {
	*p = append(*p, unix.SockFilter{Code: unix.BPF_JMP | op | unix.BPF_K, K: k, Jt: jt, Jf: jf})
}

// onSyscall appends block, guarded so it runs only for syscall nr. block
// must reload whatever it inspects and end in a return; the accumulator
// holds the syscall number again for the code after it.
func (p *program) onSyscall(nr uint32, block program) {
	if len(block) > 255 {
		panic("seccomp block too long")
	}
	p.jmp(unix.BPF_JEQ, nr, 0, uint8(len(block)))
	*p = append(*p, block...)
}

// each returns nr for every syscall with ret, one check each.
func (p *program) each(list []Syscall, ret uint32) {
	for _, s := range list {
		p.jmp(unix.BPF_JEQ, s.Nr, 0, 1)
		p.ret(ret)
	}
}

// prologue starts every program of this package: foreign architectures and
// x32 syscalls killed, clone into new namespaces refused, clone3 (whose
// flags a filter cannot see) ENOSYS so callers fall back to clone.
func (p *program) prologue() {
	p.ld(offArch)
	p.jmp(unix.BPF_JEQ, unix.AUDIT_ARCH_X86_64, 1, 0)
	p.ret(retKill)
	p.ld(offNr)
	p.jmp(unix.BPF_JGE, x32SyscallBit, 0, 1)
	p.ret(retKill)

	var b program
	b.ld(offArgLo(0))
	b.jmp(unix.BPF_JSET, NamespaceFlags, 0, 1)
	b.ret(retEPERM)
	b.ret(retAllow)
	p.onSyscall(unix.SYS_CLONE, b)

	b = nil
	b.ret(retErrno(unix.ENOSYS))
	p.onSyscall(unix.SYS_CLONE3, b)
}

// Filter assembles the seccomp program for a sandbox on kernel k.
func Filter(k Kernel) []unix.SockFilter {
	var p program
	p.prologue()

	var b program
	b.ld(offArgLo(0))
	b.jmp(unix.BPF_JSET, NamespaceFlags|unix.CLONE_NEWTIME, 0, 1)
	b.ret(retEPERM)
	b.ret(retAllow)
	p.onSyscall(unix.SYS_UNSHARE, b)

	if k == OwnKernel {
		p.each(DeniedMounts, retEPERM)
		p.each(Denied, retEPERM)
		p.ret(retAllow)
		return p
	}

	// On the host's kernel, Denied and DeniedMounts are simply not in
	// Allowed (checked by the tests), so they meet the default.

	// socket: unix, inet, inet6, and netlink route only (no packet, vsock,
	// audit, …). EAFNOSUPPORT is what programs expect for a missing family.
	b = nil
	b.ld(offArgLo(0))
	b.jmp(unix.BPF_JEQ, unix.AF_UNIX, 5, 0)
	b.jmp(unix.BPF_JEQ, unix.AF_INET, 4, 0)
	b.jmp(unix.BPF_JEQ, unix.AF_INET6, 3, 0)
	b.jmp(unix.BPF_JEQ, unix.AF_NETLINK, 0, 3)
	b.ld(offArgLo(2))
	b.jmp(unix.BPF_JEQ, unix.NETLINK_ROUTE, 0, 1)
	b.ret(retAllow)
	b.ret(retErrno(unix.EAFNOSUPPORT))
	p.onSyscall(unix.SYS_SOCKET, b)

	// ioctl: no typing into another process's terminal.
	b = nil
	b.ld(offArgLo(1))
	b.jmp(unix.BPF_JEQ, unix.TIOCSTI, 0, 1)
	b.ret(retEPERM)
	b.ret(retAllow)
	p.onSyscall(unix.SYS_IOCTL, b)

	for _, nr := range Allowed {
		p.jmp(unix.BPF_JEQ, nr, 0, 1)
		p.ret(retAllow)
	}
	p.ret(retEPERM)
	return p
}

// LoadFilter installs Filter(k) on the calling thread, or with
// unix.SECCOMP_FILTER_FLAG_TSYNC in flags on every thread of the process;
// an execve carries it into the new program and all its descendants.
// no_new_privs must already be set.
func LoadFilter(k Kernel, flags uintptr) error {
	return load(Filter(k), flags)
}

// load installs the program f with flags.
func load(f []unix.SockFilter, flags uintptr) error {
	prog := unix.SockFprog{Len: uint16(len(f)), Filter: &f[0]}
	_, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, uintptr(unsafe.Pointer(&prog)))
	if errno != 0 {
		return fmt.Errorf("load seccomp filter (%d instructions): %w", len(f), errno)
	}
	return nil
}
