// Package native is the namespaces+seccomp+landlock runtime: every sandbox
// is a tree of ordinary host processes in their own user, mount, pid, net,
// ipc, uts and cgroup namespaces, on an overlay of a uid-shifted template
// and a per-sandbox ext4 disk, under cgroup limits.
//
// The host half (this package) prepares disks, cgroups and the agent's
// socket and starts space-agent; the in-sandbox half (package nsinit, run
// by space-agent before it serves) finishes the sandbox from inside. They
// share only nsinit.Config and the file descriptor numbers.
//
// Sandbox ids 0..65535 are host ids 100000000..100065535 in every sandbox.
// The sandbox init runs as that unprivileged host uid and never looks up a
// host path: the host hands it the overlay layers as descriptors opened in
// the init's own mount namespace, so DataDir stays private (0700).
//
// Layout under Config.DataDir:
//
//	rootfs/<digest>/          uid-shifted template copies, one per tree digest
//	rootfs/.<digest>.lock     its flock: exclusive to build or forget it,
//	                          shared while a sandbox starts on it
//	rootfs/.<digest>.src      the tree it was made from: a later copy of a
//	                          tree sharing its inodes links them (reuser)
//	pool/<MiB>-<rand>.img     spare formatted disk images (see diskPool)
//	sandboxes/<id>/disk.img   sparse ext4 image (the writable layer)
//	sandboxes/<id>/rw/        its mount point: upper/, work/, init.log
//	sandboxes/<id>/root/      where the sandbox's init attaches its root
//	sandboxes/<id>/agent.sock the agent's listening socket (host-created)
//	sandboxes/<id>/init.pid   "pid starttime" of the running init
//	sandboxes/<id>/template   the rootfs/ name it uses (see ForgetTemplate)
//	sandboxes/<id>/export/    its disk, read-only, while Changes exposes it
//
// Start sequence: the host creates the cgroups and the agent socket, starts
// the init — space-nsinit when it lies next to the agent binary, else
// `space-agent init-native` — in new user/mount/pid/net/ipc/uts namespaces
// and, from its first instruction, in the sandbox's cgroups
// (cgroupfs.StartIn); the init blocks on its config socket while the host
// writes init.pid, makes the TAP device in its network namespace and sends
// the config with the layer descriptors. nsinit unshares the cgroup
// namespace, builds and pivots into the root, drops privileges, and
// executes the agent binary (passed as a descriptor); a setup error comes
// back on the status pipe.
//
// Where start-up time goes (BenchmarkStartup, p50; init.log has the init's
// own split): Create ~1 ms with a spare disk from the pool (mkfs+mount
// ~17 ms without one); in Start, prepare ~2, clone into the namespaces
// ~4–7 (the network namespace most), the init's Go start-up (~2 ms for the
// 2 MB space-nsinit, ~5 for the 7.5 MB agent), building the sandbox ~3–4
// (mounts ~1, seccomp load ~0.6), then the agent's own Go start-up until it
// answers Health. The exec after setup is kept because Landlock (ABI ≤ 7)
// can only restrict the calling thread, so one exec after setup is what
// confines every thread. Nothing on this path sleeps or polls: the host
// blocks on the status pipe and a pidfd.
//
// Density (TestDensity, SPACE_BENCH=1): 1000 idle sandboxes with 64 MiB
// memory and disk run at once, ~2.3 MiB of host memory each.
package native

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/hostproc"
)

// Name is the name the runtime registers under.
const Name = "native"

// Isolation is what a native sandbox gets when Landlock is available.
const Isolation = "namespaces+seccomp+landlock"

// strength ranks native below the VM and user-space-kernel runtimes: the
// sandbox shares the host kernel's whole syscall surface minus the filter.
const strength = 10

func init() {
	runtime.Register(Name, New)
}

// Runtime is the native runtime.
type Runtime struct {
	cfg   runtime.Config
	log   *slog.Logger
	probe runtime.ProbeCache
	disks *diskPool

	oomWarn sync.Once
}

var _ runtime.Runtime = (*Runtime)(nil)

// New builds the native runtime; it touches nothing until used.
func New(cfg runtime.Config) (runtime.Runtime, error) {
	log, err := cfg.Check(Name)
	if err != nil {
		return nil, err
	}
	return &Runtime{cfg: cfg, log: log,
		disks: newDiskPool(filepath.Join(cfg.DataDir, "pool"))}, nil
}

// Close stops formatting spare disk images and removes the spare ones.
// Sandboxes are not touched. The runtime still works after Close, only
// without spare disks.
func (r *Runtime) Close() error { return r.disks.close() }

// DataDir is the runtime's directory.
func (r *Runtime) DataDir() string { return r.cfg.DataDir }

// Name implements runtime.Runtime.
func (r *Runtime) Name() string { return Name }

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,39}$`)

func (r *Runtime) sandboxesDir() string { return filepath.Join(r.cfg.DataDir, "sandboxes") }

func (r *Runtime) newInstance(spec runtime.Spec) (*instance, error) {
	if !idRE.MatchString(spec.ID) {
		return nil, fmt.Errorf("sandbox id %q: %w", spec.ID, errdefs.ErrInvalidArgument)
	}
	dir := filepath.Join(r.sandboxesDir(), spec.ID)
	// sockaddr_un holds 108 bytes including the NUL.
	if n := len(filepath.Join(dir, "agent.sock")); n >= 108 {
		return nil, fmt.Errorf("agent socket path is %d bytes, unix sockets allow 107; use a shorter DataDir: %w", n, errdefs.ErrInvalidArgument)
	}
	return &instance{rt: r, spec: spec, dir: dir, cg: newCgroup(spec.ID)}, nil
}

// Create implements runtime.Runtime: the sandbox directory and its
// formatted, mounted disk. The template is never copied per sandbox.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (_ runtime.Instance, err error) {
	t0 := time.Now()
	defer r.disks.busy()()
	inst, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if spec.Limits.DiskMiB <= 0 {
		return nil, fmt.Errorf("disk limit must be set: %w", errdefs.ErrInvalidArgument)
	}
	if _, err := r.ensureShiftedRootfs(ctx, spec.RootFS, spec.TemplateDigest); err != nil {
		return nil, err
	}
	// Private to the host: sandbox init gets descriptors, not paths.
	if err := hostfs.MkdirSandbox(inst.dir, spec.ID); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = inst.Destroy(context.WithoutCancel(ctx))
		}
	}()
	if err := inst.recordTemplate(); err != nil {
		return nil, err
	}
	if err := os.Mkdir(inst.rootDir(), 0o700); err != nil {
		return nil, err
	}
	tDisk := time.Now()
	if err := r.takeDisk(ctx, inst.diskImage(), inst.rwDir(), spec.Limits.DiskMiB); err != nil {
		return nil, err
	}
	tMount := time.Now()
	if err := mountDisk(inst.diskImage(), inst.rwDir()); err != nil {
		return nil, err
	}
	r.log.Debug("sandbox created", "id", spec.ID, "prepare", tDisk.Sub(t0), "disk", tMount.Sub(tDisk), "mount", time.Since(tMount))
	return inst, nil
}

// Open implements runtime.Runtime: it re-adopts a sandbox created earlier,
// trusting its pid file only when the pid's start time still matches.
func (r *Runtime) Open(ctx context.Context, spec runtime.Spec) (runtime.Instance, error) {
	inst, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(inst.dir); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, errdefs.ErrNotFound)
	}
	if p, err := hostproc.Adopt(inst.pidFile()); err == nil {
		inst.pid, inst.exited = p.Pid(), p.Exited()
	}
	return inst, nil
}

// Sweep implements runtime.Runtime. It finds sandboxes by every trace they
// can leave — directory, mounts, cgroups — so a half-created or
// half-destroyed one is found too, and destroys those keep rejects.
func (r *Runtime) Sweep(ctx context.Context, keep func(id string) bool) ([]string, error) {
	ids := map[string]bool{}
	if ents, err := os.ReadDir(r.sandboxesDir()); err == nil {
		for _, e := range ents {
			ids[e.Name()] = true
		}
	}
	if mps, err := hostfs.MountsUnder(r.sandboxesDir()); err == nil {
		for _, mp := range mps {
			rel, err := filepath.Rel(r.sandboxesDir(), mp)
			if err == nil && rel != "." {
				ids[firstElem(rel)] = true
			}
		}
	}
	// Cgroups are host-global while DataDir is not: another runtime (a
	// second server, a test) may own a cgroup with no directory here. Such
	// an orphan is only removed when it is empty and old, so it cannot be
	// a sandbox that is starting elsewhere; one with processes is left
	// alone.
	for _, id := range sandboxCgroupIDs() {
		if ids[id] || keep(id) || !idRE.MatchString(id) {
			continue
		}
		if removeStaleCgroup(newCgroup(id), time.Minute) {
			r.log.Info("removed orphan cgroup", "id", id)
		}
	}
	r.sweepScratch()
	if err := r.disks.clean(false); err != nil {
		r.log.Warn("cleaning the disk pool", "err", err)
	}
	var removed []string
	var errs []error
	for id := range ids {
		if keep(id) || !idRE.MatchString(id) {
			continue
		}
		inst, err := r.newInstance(runtime.Spec{ID: id})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if p, err := hostproc.Adopt(inst.pidFile()); err == nil {
			inst.pid, inst.exited = p.Pid(), p.Exited()
		}
		if err := inst.Destroy(ctx); err != nil {
			errs = append(errs, fmt.Errorf("sweep %s: %w", id, err))
			continue
		}
		removed = append(removed, id)
	}
	sort.Strings(removed)
	return removed, errors.Join(errs...)
}

func firstElem(rel string) string {
	for i := 0; i < len(rel); i++ {
		if rel[i] == '/' {
			return rel[:i]
		}
	}
	return rel
}

// sweepScratch removes half-built template copies whose builder is gone
// (its lock is free) and probe directories left by a crash.
func (r *Runtime) sweepScratch() {
	base := filepath.Join(r.cfg.DataDir, "rootfs")
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), ".tmp-")
		if !ok || !e.IsDir() {
			continue
		}
		i := strings.LastIndexByte(rest, '-')
		if i <= 0 {
			continue
		}
		lock, err := os.OpenFile(filepath.Join(base, "."+rest[:i]+".lock"), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			continue
		}
		if unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
			os.RemoveAll(filepath.Join(base, e.Name()))
			unix.Flock(int(lock.Fd()), unix.LOCK_UN)
		}
		lock.Close()
	}
	ents, _ = os.ReadDir(r.cfg.DataDir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && strings.HasPrefix(e.Name(), ".probe-") && time.Since(fi.ModTime()) > time.Hour {
			os.RemoveAll(filepath.Join(r.cfg.DataDir, e.Name()))
		}
	}
}
