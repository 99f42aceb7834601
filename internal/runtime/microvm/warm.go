package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// Warm templates.
//
// A cold boot under TCG takes seconds; restoring a snapshot of a guest
// that has just booted takes a fraction of that. So the first cold boot of
// a kind of sandbox — same template tree, limits, kernel, initramfs,
// accelerator, QEMU and root image: warmer.key — takes a snapshot right after
// its agent and init answered, and later creates of that kind copy the
// snapshot's disk and restore its RAM instead of booting (Start calls
// warmer.start first, warmer.afterColdBoot after a cold boot).
//
// Only a fresh sandbox does either: the snapshot must hold nothing of any
// sandbox's own (it is taken before the manager ever talks to the agent,
// on a disk just formatted by Create), and a warm start replaces the disk,
// which only a sandbox that never ran may have done to it. The booted
// marker in the sandbox directory records that it ran; restored children
// of a fork get it at once.
//
// A restored guest gets fresh entropy (credited, the CRNG reseeded), the
// current time and its own hostname through vmctl, like any restore. A
// snapshot whose restore fails is deleted and the create boots cold.
//
// Layout: warm/<tree digest name>/<key>/{vm.state,disk.img,vm.json}, built
// in warm/<name>/.tmp-<key> under the flock warm/<name>/.<key>.lock and
// renamed into place complete. ForgetWarm removes a tree's snapshots.

var errNoWarm = errors.New("no warm snapshot")

// warmWait is how long a create waits for a snapshot of its kind that
// another sandbox is building before it boots cold itself.
const warmWait = 5 * time.Second

// bootedMarker marks a sandbox that ran (or was restored): its disk is no
// longer fresh.
const bootedMarker = "booted"

// WarmStats count warm-template events in this process (tests, metrics).
var WarmStats struct {
	Builds, Starts, Broken atomic.Int64
}

// warmer owns one sandbox's use of warm templates: whether the sandbox
// ran yet (the booted marker), the key of its kind, restoring a fresh
// sandbox from its kind's snapshot (start) and taking that snapshot after
// its first cold boot (afterColdBoot). Start calls it with the instance's
// mu held.
type warmer struct {
	rt    *Runtime
	spec  runtime.Spec
	files layout
	snap  *snapshots
}

// booted reports whether the sandbox ran (or was restored).
func (w *warmer) booted() bool {
	_, err := os.Lstat(w.files.bootedFile())
	return err == nil
}

// markBooted records that the sandbox ran: its disk is no longer fresh.
func (w *warmer) markBooted() error {
	return os.WriteFile(w.files.bootedFile(), nil, 0o600)
}

func (r *Runtime) warmDir() string { return filepath.Join(r.cfg.DataDir, "warm") }

// warmTreeDir is where the snapshots of one template tree live.
func (r *Runtime) warmTreeDir(treeDigest string) (string, error) {
	name, err := imageName(treeDigest)
	if err != nil {
		return "", err
	}
	return filepath.Join(r.warmDir(), name), nil
}

// ForgetWarm removes every warm snapshot of the template tree treeDigest
// (ForgetTemplate calls it). Idempotent. A build of one under way fails at
// its rename; restores in progress keep their open files.
func (r *Runtime) ForgetWarm(treeDigest string) error {
	dir, err := r.warmTreeDir(treeDigest)
	if err != nil {
		return err
	}
	return os.RemoveAll(dir)
}

// warmVM is this sandbox's cold-boot VM with what is the sandbox's own
// left out: what a warm snapshot of its kind was taken from.
func warmShape(vm VM) VM {
	vm.AgentSocket, vm.ConsoleLog, vm.Disk, vm.CtlSocket, vm.QMPSocket = "", "", "", "", ""
	vm.NetSocket, vm.NetPeer = "", ""
	vm.Hostname = ""
	vm.IncomingFD = 0
	return vm
}

// warmKeyVersion changes when what a snapshot holds changes beyond the
// fields of the key: 2 — the VM has a NIC (a virtio-net device), which a
// snapshot taken without one cannot restore into.
const warmKeyVersion = 2

// key names the kind of sandbox a warm snapshot serves: a digest over
// the tree digest, the VM's shape (vCPUs, memory, sandbox memory and
// pids, kernel and initramfs paths — the initramfs is named by its digest
// —, accelerator, translation cache, root image path), the disk size, the
// kernel release and QEMU's version.
func (w *warmer) key(vm VM, qemuVersion string) (string, error) {
	bf, err := w.rt.bootFiles()
	if err != nil {
		return "", err
	}
	b, err := json.Marshal(struct {
		Version     int
		Tree        string
		VM          VM
		DiskMiB     int64
		Kernel      string
		Initramfs   string
		QEMUVersion string
	}{warmKeyVersion, w.spec.TemplateDigest, warmShape(vm), w.spec.Limits.DiskMiB, bf.kernel.Release, filepath.Base(bf.initrd), qemuVersion})
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:16]), nil
}

// target is the VM this fresh sandbox would cold-boot and where its
// kind's snapshot lives.
func (w *warmer) target(ctx context.Context) (vm VM, treeDir, key string, err error) {
	caps := w.rt.Probe(ctx)
	if !caps.Available {
		return vm, "", "", errNoWarm
	}
	accel := caps.Details["accel"]
	if accel == "" {
		accel = AccelTCG
	}
	if vm, err = w.rt.coldVM(w.spec, w.files, accel); err != nil {
		return vm, "", "", err
	}
	if key, err = w.key(vm, caps.Details["qemu_version"]); err != nil {
		return vm, "", "", err
	}
	treeDir, err = w.rt.warmTreeDir(w.spec.TemplateDigest)
	return vm, treeDir, key, err
}

func warmComplete(dir string) bool {
	for _, f := range []string{stateName, "disk.img"} {
		var st unix.Stat_t
		if unix.Lstat(filepath.Join(dir, f), &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return false
		}
	}
	return true
}

// lockBusy reports whether the build lock at path is held right now.
func lockBusy(path string) bool {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		return true
	}
	_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
	return false
}

// start restores a fresh sandbox from its kind's warm snapshot:
// errNoWarm when there is none (or the sandbox is not fresh). Called by
// Start with the instance's mu held. On any other error no QEMU runs, the sandbox's
// fresh disk is back, and a snapshot that failed to restore is gone.
func (w *warmer) start(ctx context.Context) (err error) {
	if w.booted() || w.rt.noWarm.Load() {
		return errNoWarm
	}
	vm, treeDir, key, err := w.target(ctx)
	if err != nil {
		if errors.Is(err, errNoWarm) {
			return err
		}
		return fmt.Errorf("%w: %v", errNoWarm, err)
	}
	dir := filepath.Join(treeDir, key)
	if !warmComplete(dir) {
		// Another sandbox of this kind may be building it right now.
		lock := filepath.Join(treeDir, "."+key+".lock")
		deadline := time.Now().Add(warmWait)
		for !warmComplete(dir) {
			if !lockBusy(lock) || time.Now().After(deadline) || ctx.Err() != nil {
				return errNoWarm
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	t0 := time.Now()
	disk := w.files.diskImage()
	fresh := disk + ".fresh"
	if err := os.Rename(disk, fresh); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.Remove(disk)
			if rerr := os.Rename(fresh, disk); rerr != nil {
				err = errors.Join(err, fmt.Errorf("putting the fresh disk back: %w", rerr))
			}
			return
		}
		os.Remove(fresh)
	}()
	if err := hostfs.CopySparse(filepath.Join(dir, "disk.img"), disk); err != nil {
		return fmt.Errorf("copying the warm disk: %w", err)
	}
	if err := w.files.writeVM(vm); err != nil {
		return err
	}
	tCopied := time.Now()
	if err := w.snap.restoreFrom(ctx, filepath.Join(dir, stateName), guestHostname(w.spec)); err != nil {
		if ctx.Err() == nil {
			// The snapshot does not restore (QEMU refused it, the guest
			// did not come back): nobody should try it again.
			WarmStats.Broken.Add(1)
			if rerr := os.RemoveAll(dir); rerr != nil {
				w.rt.log.Warn("removing a broken warm snapshot", "dir", dir, "err", rerr)
			}
		}
		return fmt.Errorf("warm restore of %s: %w", key, err)
	}
	if err := w.markBooted(); err != nil {
		return err
	}
	WarmStats.Starts.Add(1)
	w.rt.log.Debug("warm start", "id", w.spec.ID, "key", key, "disk_copy", tCopied.Sub(t0), "restore", time.Since(tCopied))
	return nil
}

// afterColdBoot runs after a cold boot whose agent and init answered,
// with the instance's mu held: on a sandbox's first boot (fresh disk) it takes its
// kind's warm snapshot unless one exists or is being built. Failures only
// cost the snapshot; the sandbox runs on either way.
func (w *warmer) afterColdBoot(ctx context.Context) {
	if w.booted() {
		return
	}
	if err := w.markBooted(); err != nil {
		w.rt.log.Warn("marking a sandbox booted", "id", w.spec.ID, "err", err)
		return
	}
	if w.rt.noWarm.Load() {
		return
	}
	if err := w.build(ctx); err != nil {
		w.rt.log.Warn("warm snapshot not taken", "id", w.spec.ID, "err", err)
	}
}

// build takes the warm snapshot of the sandbox's kind unless one exists
// or another sandbox builds it.
func (w *warmer) build(ctx context.Context) error {
	_, treeDir, key, err := w.target(ctx)
	if err != nil {
		if errors.Is(err, errNoWarm) {
			return nil
		}
		return err
	}
	dir := filepath.Join(treeDir, key)
	if warmComplete(dir) {
		return nil
	}
	if err := os.MkdirAll(treeDir, 0o700); err != nil {
		return err
	}
	lf, err := os.OpenFile(filepath.Join(treeDir, "."+key+".lock"), os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil // another sandbox of this kind builds it
	}
	if warmComplete(dir) {
		return nil
	}
	t0 := time.Now()
	tmp := filepath.Join(treeDir, ".tmp-"+key)
	if err := os.RemoveAll(tmp); err != nil { // a build that died
		return err
	}
	if err := os.RemoveAll(dir); err != nil { // an incomplete one
		return err
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	vm, err := w.files.readVM()
	if err != nil {
		return err
	}
	if err := writeJSONFile(filepath.Join(tmp, "vm.json"), warmShape(vm)); err != nil {
		return err
	}
	copyDisk := func() error {
		if err := hostfs.CopySparse(w.files.diskImage(), filepath.Join(tmp, "disk.img")); err != nil {
			return fmt.Errorf("copying the disk: %w", err)
		}
		return nil
	}
	info, err := w.snap.save(ctx, filepath.Join(tmp, stateName), true, copyDisk)
	if err != nil {
		return err
	}
	if err := w.snap.cont(ctx, info); err != nil {
		return fmt.Errorf("the guest did not run again after its warm snapshot: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return err
	}
	WarmStats.Builds.Add(1)
	w.rt.log.Debug("warm snapshot taken", "id", w.spec.ID, "key", key, "state_bytes", info.Bytes, "took", time.Since(t0))
	return syncDir(treeDir)
}

func writeJSONFile(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}
