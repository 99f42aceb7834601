package ginit

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ConfineMaskedProc are the /proc files StageConfine hides (bound over by
// /dev/null) besides sysrq-trigger: a real kernel's views of its memory,
// keys and timers, as docker's default masked paths.
var ConfineMaskedProc = []string{
	"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug",
	"/proc/latency_stats", "/proc/timer_stats", "/proc/acpi", "/proc/scsi",
}

// ConfineDenied are the syscalls StageConfine's filter refuses with EPERM
// besides mounts: the gvisor runtime's OCI spec refuses the same ones to
// every process of its sandboxes (keyrings, bpf, perf, ptrace, kernel
// modules, io_uring, userfaultfd, handles, the machine's identity and
// power). Everything else in the agent's namespaces is confined by them.
var ConfineDenied = []uint32{
	unix.SYS_KEYCTL, unix.SYS_ADD_KEY, unix.SYS_REQUEST_KEY, unix.SYS_BPF, unix.SYS_PERF_EVENT_OPEN,
	unix.SYS_PTRACE, unix.SYS_PROCESS_VM_READV, unix.SYS_PROCESS_VM_WRITEV, unix.SYS_KCMP,
	unix.SYS_PIDFD_GETFD, unix.SYS_SETNS, unix.SYS_KEXEC_LOAD, unix.SYS_KEXEC_FILE_LOAD,
	unix.SYS_INIT_MODULE, unix.SYS_FINIT_MODULE, unix.SYS_DELETE_MODULE, unix.SYS_USERFAULTFD,
	unix.SYS_IO_URING_SETUP, unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER,
	unix.SYS_OPEN_BY_HANDLE_AT, unix.SYS_NAME_TO_HANDLE_AT, unix.SYS_SWAPON, unix.SYS_SWAPOFF,
	unix.SYS_REBOOT, unix.SYS_SYSLOG, unix.SYS_ACCT, unix.SYS_QUOTACTL, unix.SYS_SETHOSTNAME,
	unix.SYS_SETDOMAINNAME,
}

func confine() error { return enterConfined(ConfineMaskedProc, ConfineDenied) }

// maskProc binds /dev/null over each file of paths that exists, and an
// empty read-only tmpfs over each directory.
func maskProc(paths []string) error {
	for _, p := range paths {
		fi, err := os.Lstat(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
		if fi.IsDir() {
			err = unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0,mode=0555")
		} else {
			err = unix.Mount("/dev/null", p, "", unix.MS_BIND, "")
		}
		if err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	return nil
}
