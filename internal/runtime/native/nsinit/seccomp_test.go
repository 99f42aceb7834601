package nsinit

import (
	"testing"

	"golang.org/x/sys/unix"
)

// TestFilterShape checks what the kernel would otherwise only reject at
// sandbox start: the program fits, every jump lands inside it, and the
// dangerous syscalls are not on the plain allowlist.
func TestFilterShape(t *testing.T) {
	f := filter()
	if len(f) == 0 || len(f) > 4096 {
		t.Fatalf("filter has %d instructions", len(f))
	}
	for i, ins := range f {
		if ins.Code&0x07 == unix.BPF_JMP && ins.Code != unix.BPF_JMP|unix.BPF_JA {
			if i+1+int(ins.Jt) >= len(f) || i+1+int(ins.Jf) >= len(f) {
				t.Fatalf("instruction %d jumps out of the program", i)
			}
		}
	}
	if last := f[len(f)-1]; last.Code != unix.BPF_RET|unix.BPF_K || last.K != retEPERM {
		t.Fatalf("default action %+v, want EPERM", last)
	}
	denied := []uint32{unix.SYS_MOUNT, unix.SYS_UMOUNT2, unix.SYS_PIVOT_ROOT, unix.SYS_KEXEC_LOAD,
		unix.SYS_KEXEC_FILE_LOAD, unix.SYS_INIT_MODULE, unix.SYS_FINIT_MODULE, unix.SYS_DELETE_MODULE,
		unix.SYS_BPF, unix.SYS_PERF_EVENT_OPEN, unix.SYS_USERFAULTFD, unix.SYS_IO_URING_SETUP,
		unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER, unix.SYS_KEYCTL, unix.SYS_ADD_KEY,
		unix.SYS_REQUEST_KEY, unix.SYS_PTRACE, unix.SYS_SETNS, unix.SYS_OPEN_BY_HANDLE_AT,
		unix.SYS_FSOPEN, unix.SYS_FSMOUNT, unix.SYS_MOVE_MOUNT, unix.SYS_OPEN_TREE,
		unix.SYS_PROCESS_VM_READV, unix.SYS_PROCESS_VM_WRITEV, unix.SYS_PIDFD_GETFD, unix.SYS_REBOOT,
		unix.SYS_SWAPON, unix.SYS_SYSLOG, unix.SYS_CLONE, unix.SYS_CLONE3, unix.SYS_UNSHARE, unix.SYS_SOCKET,
		unix.SYS_IOCTL}
	allowed := map[uint32]bool{}
	for _, nr := range allowedSyscalls {
		if allowed[nr] {
			t.Errorf("syscall %d listed twice", nr)
		}
		allowed[nr] = true
	}
	for _, nr := range denied {
		if allowed[nr] {
			t.Errorf("syscall %d must not be on the plain allowlist", nr)
		}
	}
}
