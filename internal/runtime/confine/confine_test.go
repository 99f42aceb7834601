package confine

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

const envChild = "CONFINE_TEST_CHILD"

func TestMain(m *testing.M) {
	if k := os.Getenv(envChild); k != "" {
		os.Exit(child(k))
	}
	os.Exit(m.Run())
}

// child loads the filter for kernel k ("none": no filter) on every thread,
// then reports what each probe got as "name errno" lines, and what a
// normal program run under it printed.
func child(k string) int {
	if k != "none" {
		kernel := HostKernel
		if k == "own" {
			kernel = OwnKernel
		}
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			fmt.Println("setup", err)
			return 1
		}
		if err := LoadFilter(kernel, unix.SECCOMP_FILTER_FLAG_TSYNC); err != nil {
			fmt.Println("setup", err)
			return 1
		}
	}
	errno := func(err error) int {
		var e unix.Errno
		if errors.As(err, &e) {
			return int(e)
		}
		return 0
	}
	// Each probe runs in a child of its own where it would change this
	// process (unshare): a locked thread that exits takes it with it.
	probe := func(name string, f func() error) {
		done := make(chan int)
		go func() {
			// Never unlocked: the thread dies with its namespaces.
			runtime.LockOSThread()
			done <- errno(f())
		}()
		fmt.Println(name, <-done)
	}
	probe("unshare_time", func() error { return unix.Unshare(unix.CLONE_NEWTIME) })
	probe("unshare_user", func() error { return unix.Unshare(unix.CLONE_NEWUSER) })
	probe("unshare_ns", func() error { return unix.Unshare(unix.CLONE_NEWNS) })
	probe("mount", func() error { return unix.Mount("none", "/nonexistent", "tmpfs", 0, "") })
	probe("keyctl", func() error {
		_, err := unix.KeyctlGetKeyringID(unix.KEY_SPEC_SESSION_KEYRING, false)
		return err
	})
	probe("bpf", func() error {
		_, _, e := unix.Syscall(unix.SYS_BPF, 0, 0, 0)
		if e == 0 {
			return nil
		}
		return e
	})
	probe("clone3", func() error {
		_, _, e := unix.Syscall(unix.SYS_CLONE3, 0, 0, 0)
		return e
	})
	out, err := exec.Command("/bin/sh", "-c", "echo hello; ls / >/dev/null && echo listed; grep ^Seccomp: /proc/self/status").CombinedOutput()
	fmt.Printf("program %q %v\n", out, err)
	return 0
}

func runChild(t *testing.T, kernel string) map[string]string {
	t.Helper()
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+kernel)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child (%s): %v\n%s", kernel, err, out)
	}
	res := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		name, val, _ := strings.Cut(line, " ")
		res[name] = val
	}
	if s, ok := res["setup"]; ok {
		t.Fatalf("child (%s) setup: %s", kernel, s)
	}
	return res
}

// TestFilterDenies runs a child under each filter: what the policy denies
// fails with its errno, and a normal program runs.
func TestFilterDenies(t *testing.T) {
	eperm := fmt.Sprint(int(unix.EPERM))
	for _, kernel := range []string{"host", "own"} {
		t.Run(kernel, func(t *testing.T) {
			res := runChild(t, kernel)
			for _, name := range []string{"unshare_time", "unshare_user", "unshare_ns", "mount", "keyctl", "bpf"} {
				if res[name] != eperm {
					t.Errorf("%s: errno %s under the filter, want EPERM", name, res[name])
				}
			}
			if res["clone3"] != fmt.Sprint(int(unix.ENOSYS)) {
				t.Errorf("clone3: errno %s, want ENOSYS", res["clone3"])
			}
			if p := res["program"]; !strings.Contains(p, `hello\nlisted\nSeccomp:\t2`) || !strings.HasSuffix(p, "<nil>") {
				t.Errorf("a normal program under the filter: %s", p)
			}
		})
	}
}

// TestFilterIsWhatDenies checks the probes themselves: as root, without the
// filter, a new time namespace is allowed, so the EPERM above is the
// filter's.
func TestFilterIsWhatDenies(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: unprivileged, the kernel itself refuses a time namespace")
	}
	if _, err := os.Stat("/proc/self/ns/time"); err != nil {
		t.Skip("kernel without time namespaces")
	}
	if res := runChild(t, "none"); res["unshare_time"] != "0" {
		t.Fatalf("without the filter unshare(CLONE_NEWTIME) got errno %s, want success", res["unshare_time"])
	}
}

// TestFilterShape checks what the kernel would otherwise only reject at
// sandbox start: the program fits, every jump lands inside it, and nothing
// the policy denies is on the host kernel's plain allowlist.
func TestFilterShape(t *testing.T) {
	for _, k := range []Kernel{HostKernel, OwnKernel} {
		f := Filter(k)
		if len(f) == 0 || len(f) > 4096 {
			t.Fatalf("filter %d has %d instructions", k, len(f))
		}
		for i, ins := range f {
			if ins.Code&0x07 == unix.BPF_JMP && ins.Code != unix.BPF_JMP|unix.BPF_JA {
				if i+1+int(ins.Jt) >= len(f) || i+1+int(ins.Jf) >= len(f) {
					t.Fatalf("filter %d: instruction %d jumps out of the program", k, i)
				}
			}
		}
		want := uint32(retEPERM)
		if k == OwnKernel {
			want = retAllow
		}
		if last := f[len(f)-1]; last.Code != unix.BPF_RET|unix.BPF_K || last.K != want {
			t.Fatalf("filter %d: default action %+v, want %#x", k, last, want)
		}
	}
	checked := []uint32{unix.SYS_CLONE, unix.SYS_CLONE3, unix.SYS_UNSHARE, unix.SYS_SOCKET, unix.SYS_IOCTL}
	for _, s := range slices.Concat(Denied, DeniedMounts) {
		checked = append(checked, s.Nr)
	}
	allowed := map[uint32]bool{}
	for _, nr := range Allowed {
		if allowed[nr] {
			t.Errorf("syscall %d listed twice", nr)
		}
		allowed[nr] = true
	}
	for _, nr := range checked {
		if allowed[nr] {
			t.Errorf("syscall %d must not be on the plain allowlist", nr)
		}
	}
}

func TestCapabilities(t *testing.T) {
	if m := CapabilityMask(); m != 0x200405fb {
		t.Errorf("capability mask %#x", m)
	}
	for _, c := range CapabilityNames() {
		if !strings.HasPrefix(c, "CAP_") {
			t.Errorf("capability name %q", c)
		}
	}
}
