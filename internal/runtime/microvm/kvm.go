package microvm

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// DefaultKVMProbeTimeout bounds the KVM probe. A guest under real KVM
// reaches its agent in well under a second; under this project's nested
// kvm_pvm a Linux guest prints its first line after 13–90 s and then dies
// with an emulation failure (../shared/MACHINE.md), so waiting longer only
// delays the fallback.
const DefaultKVMProbeTimeout = 10 * time.Second

// KVMProbe is the outcome of ProbeKVM.
type KVMProbe struct {
	Usable bool
	// Reason says why KVM is not usable (empty when it is).
	Reason string
	// Elapsed is how long the probe took (boot to health when usable).
	Elapsed time.Duration
}

// Accel is the accelerator the probe picks: KVM when a guest really ran
// under it, TCG otherwise.
func (r KVMProbe) Accel() string {
	if r.Usable {
		return AccelKVM
	}
	return AccelTCG
}

// ProbeKVM decides whether KVM can really run a guest here by booting one
// — kernel k with initrd, the same guest a sandbox gets — under -accel kvm
// and waiting at most timeout for its agent's health answer. /dev/kvm
// existing proves nothing. workDir holds the probe's socket and console and
// must be short enough for a unix socket path. The caller caches the result
// (it holds for the host's boot).
func ProbeKVM(ctx context.Context, qemu string, k Kernel, initrd, workDir string, timeout time.Duration) KVMProbe {
	start := time.Now()
	fail := func(format string, a ...any) KVMProbe {
		return KVMProbe{Reason: fmt.Sprintf(format, a...), Elapsed: time.Since(start)}
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return fail("cannot open /dev/kvm: %v", err)
	}
	f.Close()
	dir, err := os.MkdirTemp(workDir, "kvmprobe")
	if err != nil {
		return fail("probe directory: %v", err)
	}
	defer os.RemoveAll(dir)
	p, err := Start(VM{QEMU: qemu, Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelKVM, CPUs: 1, MemoryMiB: 128,
		AgentSocket: filepath.Join(dir, "a.sock"), ConsoleLog: filepath.Join(dir, "console.log")})
	if err != nil {
		return fail("%v", err)
	}
	defer p.Kill()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, _, err := p.WaitHealthy(ctx)
	if err != nil {
		return fail("a guest under KVM did not reach its agent within %v: %s", timeout, oneLine(err.Error(), 300))
	}
	c.Close()
	return KVMProbe{Usable: true, Elapsed: time.Since(start)}
}

// oneLine flattens s to one line of at most max bytes (a Reason shown by
// `space info`).
func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > max {
		s = s[:max] + "…"
	}
	return s
}
