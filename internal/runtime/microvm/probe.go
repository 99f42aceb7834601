package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
)

// Strength for "auto": a guest kernel of its own isolates more than
// gVisor's user-space kernel (20) — but only under KVM. A TCG guest is as
// isolated and an order of magnitude slower, so it ranks below gVisor and
// auto never picks it over a working gVisor.
const (
	strengthKVM = 30
	strengthTCG = 15
)

// probeIDPrefix starts the id of the probe's sandbox.
const probeIDPrefix = "probe-"

// probeBootTimeout bounds the probe's guest boot to its agent's answer.
const probeBootTimeout = 90 * time.Second

type probeCache struct {
	mu   sync.Mutex
	done bool
	caps runtime.Capabilities
}

// Probe implements runtime.Runtime. Available only if QEMU, the guest
// kernel, the initramfs and the erofs and ext4 tools work and one real
// guest — root image, writable disk, agent and control port, exactly as a
// sandbox gets them — boots to its agent's health answer. KVM is used
// only if ProbeKVM saw a guest really run under it. A successful result is
// kept for the host's boot (probeKey).
func (r *Runtime) Probe(ctx context.Context) runtime.Capabilities {
	r.probe.mu.Lock()
	defer r.probe.mu.Unlock()
	if r.probe.done {
		return r.probe.caps
	}
	key, kerr := r.probeKey()
	if kerr == nil {
		if c, ok := r.loadProbe(key); ok {
			r.probe.caps, r.probe.done = c, true
			return c
		}
	}
	r.probing.Store(true)
	c := r.measure(ctx)
	r.probing.Store(false)
	if ctx.Err() != nil && !c.Available {
		return c // cut short by the caller: measure again next time
	}
	r.probe.caps, r.probe.done = c, true
	if kerr == nil {
		r.storeProbe(key, c)
	}
	return c
}

func (r *Runtime) measure(ctx context.Context) runtime.Capabilities {
	c := runtime.Capabilities{
		Isolation:   "microvm/" + AccelTCG,
		Strength:    strengthTCG,
		Verbs:       map[string]bool{},
		VerbReasons: map[string]string{},
		Details: map[string]string{
			"accel":         AccelTCG,
			"rootfs":        "erofs template image (read-only) + per-sandbox ext4 disk, overlayfs in the guest",
			"agent_channel": "virtio-serial port (unix socket chardev)",
		},
	}
	if err := r.check(ctx, &c); err != nil {
		c.Reason = err.Error()
	} else {
		c.Available = true
	}
	for _, v := range []string{api.OpCreate, api.OpDelete, api.OpStop, api.OpStart, api.OpPause, api.OpResume} {
		c.Verbs[v] = c.Available
		if !c.Available {
			c.VerbReasons[v] = c.Reason
		}
	}
	// The snapshot verbs are there when the instance implements them
	// (suspend.go, fork.go).
	var inst any = (*instance)(nil)
	_, canSuspend := inst.(runtime.Suspender)
	_, canFork := inst.(runtime.Forker)
	for v, ok := range map[string]bool{api.OpSuspend: canSuspend, api.OpRestore: canSuspend, api.OpWake: canSuspend, api.OpFork: canFork} {
		c.Verbs[v] = c.Available && ok
		switch {
		case !c.Available:
			c.VerbReasons[v] = c.Reason
		case !ok:
			c.VerbReasons[v] = "snapshots are not implemented by this build of the microvm runtime"
		}
	}
	return c
}

func (r *Runtime) check(ctx context.Context, c *runtime.Capabilities) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root (jailing QEMU, disk images)")
	}
	qemu, err := exec.LookPath(DefaultQEMU)
	if err != nil {
		return fmt.Errorf("%s not found (install qemu-system-x86)", DefaultQEMU)
	}
	c.Details["qemu"] = qemu
	out, err := exec.CommandContext(ctx, qemu, "-version").Output()
	if err != nil {
		return fmt.Errorf("%s -version: %v", qemu, err)
	}
	c.Details["qemu_version"] = qemuVersion(string(out))
	for _, tool := range []string{DefaultMkfsErofs, "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found (install erofs-utils and e2fsprogs)", tool)
		}
	}
	if jb := r.jailBinary(); jb == "" {
		return fmt.Errorf("no space-jail binary configured (the QEMU jailer)")
	} else if st, err := os.Stat(jb); err != nil || !st.Mode().IsRegular() {
		return fmt.Errorf("space-jail (the QEMU jailer) not found at %s: build it next to space-agent (make build) or set SPACE_JAIL_BIN", jb)
	}
	bf, err := r.bootFiles()
	if err != nil {
		return err
	}
	c.Details["kernel_release"] = bf.kernel.Release
	if err := os.MkdirAll(r.cfg.DataDir, 0o700); err != nil {
		return err
	}
	kvm := ProbeKVM(ctx, qemu, bf.kernel, bf.initrd, r.cfg.DataDir, DefaultKVMProbeTimeout)
	accel := kvm.Accel()
	c.Details["accel"] = accel
	if !kvm.Usable {
		c.Details["kvm_reason"] = kvm.Reason
	}
	c.Isolation = "microvm/" + accel
	if accel == AccelKVM {
		c.Strength = strengthKVM
	}
	d, err := r.probeBoot(ctx, accel)
	if err != nil {
		return err
	}
	c.Details["boot_ms"] = strconv.FormatInt(d.Milliseconds(), 10)
	return nil
}

// qemuVersion is "7.2.x" from `qemu -version`'s first line.
func qemuVersion(out string) string {
	line, _, _ := strings.Cut(out, "\n")
	if _, v, ok := strings.Cut(line, "version "); ok {
		return strings.Fields(v)[0]
	}
	return strings.TrimSpace(line)
}

// probeBoot creates, starts and destroys a sandbox of a tiny template the
// way the runtime serves any sandbox, and returns how long Start took
// (boot until the agent and the guest's init answer).
func (r *Runtime) probeBoot(ctx context.Context, accel string) (time.Duration, error) {
	tree, err := os.MkdirTemp(r.cfg.DataDir, ".probe-tree-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(tree)
	for _, d := range []string{"etc", "tmp", "root", "proc", "sys", "dev", "run"} {
		if err := os.Mkdir(filepath.Join(tree, d), 0o755); err != nil {
			return 0, err
		}
	}
	// A digest of its own (the tree is built here, not imported), so no
	// real template's image is touched.
	digest := "probe-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	defer r.images.Forget(context.WithoutCancel(ctx), digest)
	id := probeIDPrefix + strconv.FormatInt(time.Now().UnixNano()%1e12, 36)
	spec := runtime.Spec{ID: id, RootFS: tree, TemplateDigest: digest, Hostname: id,
		Limits: api.Limits{CPUs: 1, MemoryMiB: 64, Pids: 32, DiskMiB: 16}}
	inst, err := r.Create(ctx, spec)
	if err != nil {
		return 0, fmt.Errorf("probe sandbox: %w", err)
	}
	defer inst.Destroy(context.WithoutCancel(ctx))
	i := inst.(*instance)
	ctx, cancel := context.WithTimeout(ctx, probeBootTimeout)
	defer cancel()
	vm, err := i.coldVM(accel)
	if err != nil {
		return 0, err
	}
	if err := i.writeVM(vm); err != nil {
		return 0, err
	}
	t0 := time.Now()
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.launch(ctx, nil); err != nil {
		return 0, fmt.Errorf("probe sandbox: %w", err)
	}
	defer i.stopLocked(context.WithoutCancel(ctx))
	if err := i.waitReady(ctx); err != nil {
		return 0, fmt.Errorf("probe sandbox: %w", err)
	}
	return time.Since(t0), nil
}

// The probe boots a guest, seconds under TCG, and every server start and
// every test runtime probes. A successful result is kept for the rest of
// the host's boot, as long as nothing it depends on changed: the boot id,
// and QEMU, the guest kernel, the agent binary and the running program,
// each by path, size, inode and modification time. It is kept in DataDir
// and in /run (one per host boot by nature, shared by runtimes with other
// DataDirs). A failed probe is never kept.

const probeCacheFile = "probe.json"

// runProbeDir is the host-wide copy's directory.
const runProbeDir = "/run/space/microvm"

type probeRecord struct {
	Key  string               `json:"key"`
	Caps runtime.Capabilities `json:"caps"`
}

func (r *Runtime) probeKey() (string, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	qemu, err := exec.LookPath(DefaultQEMU)
	if err != nil {
		return "", err
	}
	k, err := FindKernel(kernelCacheDir())
	if err != nil {
		return "", err
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "boot=%s\nuid=%d\nkvm_timeout=%v\n", strings.TrimSpace(string(boot)), os.Geteuid(), DefaultKVMProbeTimeout)
	for _, p := range []string{qemu, k.Vmlinuz, r.cfg.AgentBinary, r.jailBinary(), self} {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s %d %d %d %d.%d\n", p, st.Dev, st.Ino, st.Size, st.Mtim.Sec, st.Mtim.Nsec)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func (r *Runtime) probeCachePaths(key string) []string {
	return []string{filepath.Join(r.cfg.DataDir, probeCacheFile), filepath.Join(runProbeDir, "probe-"+key[:16]+".json")}
}

func (r *Runtime) loadProbe(key string) (runtime.Capabilities, bool) {
	for _, p := range r.probeCachePaths(key) {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		var rec probeRecord
		if json.Unmarshal(data, &rec) != nil || rec.Key != key || !rec.Caps.Available {
			continue
		}
		c := rec.Caps
		if c.Details == nil {
			c.Details = map[string]string{}
		}
		c.Details["probe_cached"] = "true"
		return c, true
	}
	return runtime.Capabilities{}, false
}

func (r *Runtime) storeProbe(key string, c runtime.Capabilities) {
	if !c.Available {
		return
	}
	data, err := json.Marshal(probeRecord{Key: key, Caps: c})
	if err != nil {
		return
	}
	_ = os.MkdirAll(runProbeDir, 0o700)
	for _, p := range r.probeCachePaths(key) {
		tmp := p + ".tmp" + strconv.Itoa(os.Getpid())
		if err := os.WriteFile(tmp, data, 0o600); err != nil {
			continue
		}
		if err := os.Rename(tmp, p); err != nil {
			_ = os.Remove(tmp)
		}
	}
}
