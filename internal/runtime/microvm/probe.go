package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

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

// Probe implements runtime.Runtime. Available only if QEMU, the guest
// kernel, the initramfs and the erofs and ext4 tools work and one real
// guest — root image, writable disk, agent and control port, exactly as a
// sandbox gets them — boots to its agent's health answer. KVM is used
// only if ProbeKVM saw a guest really run under it. A successful result is
// kept for the host's boot (probeKey).
func (r *Runtime) Probe(ctx context.Context) runtime.Capabilities {
	disk := runtime.ProbeDisk{Key: r.probeKey, Files: r.probeCachePaths}
	return r.probe.Get(ctx, disk, func(ctx context.Context) (runtime.Capabilities, bool) {
		r.probing.Store(true)
		c := r.measure(ctx)
		r.probing.Store(false)
		// Cut short by the caller: measure again next time.
		return c, c.Available || ctx.Err() == nil
	})
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
	// The snapshot verbs (suspend, restore, wake, fork — a fork is a
	// snapshot restored into children) are offered only if the probe's own
	// guest really went through a suspend and a restore (check).
	snapErr := c.Details["snapshot_error"]
	for _, v := range []string{api.OpSuspend, api.OpRestore, api.OpWake, api.OpFork} {
		c.Verbs[v] = c.Available && snapErr == ""
		switch {
		case !c.Available:
			c.VerbReasons[v] = c.Reason
		case snapErr != "":
			c.VerbReasons[v] = "the probe's guest could not be suspended and restored here: " + snapErr
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
	res, err := r.probeBoot(ctx, accel)
	if err != nil {
		return err
	}
	c.Details["boot_ms"] = strconv.FormatInt(res.boot.Milliseconds(), 10)
	if res.snapshotErr != nil {
		c.Details["snapshot_error"] = res.snapshotErr.Error()
	} else {
		c.Details["probe_suspend_restore_ms"] = strconv.FormatInt(res.snapshot.Milliseconds(), 10)
	}
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

// probeResult is what probeBoot measured.
type probeResult struct {
	boot        time.Duration // Start: boot until the agent and the guest's init answer
	snapshot    time.Duration // suspend to disk and restore until the guest's init answers
	snapshotErr error         // why the suspend and restore failed (the guest booted)
}

// probeBoot creates, starts and destroys a sandbox of a tiny template the
// way the runtime serves any sandbox, and measures its boot and then a
// suspend and restore of it through Suspend and Restore: the snapshot
// verbs are advertised only if that worked here.
func (r *Runtime) probeBoot(ctx context.Context, accel string) (probeResult, error) {
	tree, err := os.MkdirTemp(r.cfg.DataDir, ".probe-tree-")
	if err != nil {
		return probeResult{}, err
	}
	defer os.RemoveAll(tree)
	for _, d := range []string{"etc", "tmp", "root", "proc", "sys", "dev", "run"} {
		if err := os.Mkdir(filepath.Join(tree, d), 0o755); err != nil {
			return probeResult{}, err
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
		return probeResult{}, fmt.Errorf("probe sandbox: %w", err)
	}
	defer inst.Destroy(context.WithoutCancel(ctx))
	i := inst.(*instance)
	ctx, cancel := context.WithTimeout(ctx, probeBootTimeout)
	defer cancel()
	vm, err := r.coldVM(spec, i.files, accel)
	if err != nil {
		return probeResult{}, err
	}
	if err := i.files.writeVM(vm); err != nil {
		return probeResult{}, err
	}
	t0 := time.Now()
	i.mu.Lock()
	err = i.vm.launch(ctx, nil)
	if err == nil {
		err = i.waitReady(ctx)
	}
	i.mu.Unlock()
	if err != nil {
		return probeResult{}, fmt.Errorf("probe sandbox: %w", err)
	}
	res := probeResult{boot: time.Since(t0)}
	t1 := time.Now()
	res.snapshotErr = probeSnapshot(ctx, i)
	res.snapshot = time.Since(t1)
	return res, nil
}

// probeSnapshot suspends the probe's running guest to disk and restores
// it, and asks the restored guest's init to answer.
func probeSnapshot(ctx context.Context, i *instance) error {
	if err := i.Suspend(ctx); err != nil {
		return err
	}
	if !i.Suspended() || i.Alive() {
		return errors.New("suspend left no image or a running QEMU")
	}
	if err := i.Restore(ctx); err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := i.guest.ping(pctx); err != nil {
		return fmt.Errorf("the restored guest does not answer: %w", err)
	}
	return nil
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

func (r *Runtime) probeKey() (string, error) {
	qemu, err := exec.LookPath(DefaultQEMU)
	if err != nil {
		return "", err
	}
	k, err := FindKernel(kernelCacheDir())
	if err != nil {
		return "", err
	}
	return runtime.ProbeKey(fmt.Sprintf("kvm_timeout=%v\n", DefaultKVMProbeTimeout), qemu, k.Vmlinuz, r.cfg.AgentBinary, r.jailBinary())
}

func (r *Runtime) probeCachePaths(key string) []string {
	return []string{filepath.Join(r.cfg.DataDir, probeCacheFile), filepath.Join(runProbeDir, "probe-"+key[:16]+".json")}
}
