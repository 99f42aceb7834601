package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
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
	initrd, err := BuildInitramfs(k, agent, filepath.Join(testenv.CacheDir(), "microvm", "test-initramfs"))
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
	if h.Pid != 1 {
		t.Errorf("agent pid in the guest = %d, want 1 (it is the guest's init)", h.Pid)
	}
}
