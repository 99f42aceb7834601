package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
)

// requireBoot returns the guest kernel and an initramfs with the test's
// space-agent, or skips (locally) / fails (in CI, where setup installs
// them) when QEMU or the kernel are missing.
func requireBoot(t *testing.T) (Kernel, string) {
	t.Helper()
	_, err := exec.LookPath(DefaultQEMU)
	testenv.Require(t, "qemu", err == nil, "install qemu-system-x86 (scripts/setup.sh)")
	k, err := FindKernel(testenv.CacheDir())
	testenv.Require(t, "microvm-kernel", err == nil, "scripts/setup.sh unpacks the guest kernel: "+errString(err))
	agent := testenv.AgentBinary(t)
	// A cache of its own per test: a shared one would keep one image per
	// agent build forever.
	initrd, err := BuildInitramfs(k, agent, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return k, initrd
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// shortDir is a temp dir whose paths fit a unix socket address.
func shortDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "mvm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// TestBootHealth boots the guest under TCG and gets the agent's health
// answer over the virtio-serial port: kernel, initramfs, module loading,
// vminit's port discovery and the yamux stream all work end to end.
func TestBootHealth(t *testing.T) {
	k, initrd := requireBoot(t)
	dir := shortDir(t)
	vm := VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG, CPUs: 1, MemoryMiB: 256,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log")}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	p, err := Start(vm)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	c, h, err := p.WaitHealthy(ctx)
	if err != nil {
		t.Fatalf("health: %v\nconsole:\n%s", err, p.ConsoleTail(4096))
	}
	defer c.Close()
	t.Logf("boot→health %v under TCG (agent %s, pid %d)", time.Since(start).Round(time.Millisecond), h.Version, h.Pid)
	for _, line := range strings.Split(p.ConsoleTail(4096), "\n") {
		if strings.Contains(line, "vm init:") {
			t.Log(strings.TrimSpace(line))
		}
	}
	if h.Pid != 1 {
		t.Errorf("agent pid in the guest = %d, want 1 (it is the guest's init)", h.Pid)
	}
}

// hostHasHardwareVirt reports whether the CPU advertises VT-x or AMD-V to
// this kernel; without them /dev/kvm can only be a software KVM (kvm_pvm
// here), which does not run a Linux guest.
func hostHasHardwareVirt(t *testing.T) bool {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range strings.Fields(string(b)) {
		if f == "vmx" || f == "svm" {
			return true
		}
	}
	return false
}

// TestProbeKVM runs the KVM probe. On a host without hardware
// virtualisation (this project's CI machines: /dev/kvm is kvm_pvm) it must
// report KVM unusable and pick TCG, within its timeout; on a host with it
// the probe's verdict is logged.
func TestProbeKVM(t *testing.T) {
	k, initrd := requireBoot(t)
	const timeout = 8 * time.Second
	start := time.Now()
	r := ProbeKVM(context.Background(), "", k, initrd, shortDir(t), timeout)
	el := time.Since(start)
	t.Logf("kvm probe: usable=%v accel=%s in %v: %s", r.Usable, r.Accel(), el.Round(time.Millisecond), r.Reason)
	if el > timeout+5*time.Second {
		t.Errorf("probe took %v, longer than its timeout %v allows", el, timeout)
	}
	if r.Usable {
		if r.Accel() != AccelKVM || r.Reason != "" {
			t.Errorf("usable probe: accel %s reason %q", r.Accel(), r.Reason)
		}
		return
	}
	if r.Accel() != AccelTCG || r.Reason == "" {
		t.Errorf("unusable probe: accel %s reason %q", r.Accel(), r.Reason)
	}
	if !hostHasHardwareVirt(t) {
		return // the expected verdict here
	}
	t.Logf("note: the CPU has vmx/svm but the probe found KVM unusable")
}

// TestGuestInitFailureEndsVM boots a guest whose initramfs lacks
// virtio_console, so vminit finds no agent port: the guest must say so on
// its console and end itself, and WaitHealthy must return that console
// tail as soon as QEMU exits instead of waiting for its deadline.
func TestGuestInitFailureEndsVM(t *testing.T) {
	k, _ := requireBoot(t)
	var mods []string
	for _, m := range GuestModules {
		if m != "virtio_console" {
			mods = append(mods, m)
		}
	}
	paths, err := resolveModules(k, mods)
	if err != nil {
		t.Fatal(err)
	}
	dir := shortDir(t)
	initrd := filepath.Join(dir, "initrd")
	f, err := os.Create(initrd)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeInitramfs(f, testenv.AgentBinary(t), paths); err != nil {
		t.Fatal(err)
	}
	f.Close()
	p, err := Start(VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG,
		AgentSocket: filepath.Join(dir, "a.sock"), ConsoleLog: filepath.Join(dir, "console.log")})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	start := time.Now()
	_, _, err = p.WaitHealthy(ctx)
	if err == nil {
		t.Fatal("agent answered without its port")
	}
	if ctx.Err() != nil {
		t.Fatalf("WaitHealthy ran into its deadline instead of noticing the VM end: %v", err)
	}
	if !strings.Contains(err.Error(), `no virtio-serial port named "agent"`) {
		t.Errorf("error does not carry the guest's reason: %v", err)
	}
	t.Logf("guest ended %v after start: %v", time.Since(start).Round(time.Millisecond), oneLine(err.Error(), 400))
}
