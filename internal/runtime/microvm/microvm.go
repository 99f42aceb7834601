package microvm

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
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/hostproc"
)

// Name is the name the runtime registers under.
const Name = "microvm"

// diskRootID owns the writable disk's root directory: the sandbox's root
// after the guest init's id shift (uid 0 of the confined agent's user
// namespace), the same shift the root images have.
const diskRootID = confine.IDBase

// guestOverheadMiB is what the guest needs beside the sandbox's own memory:
// the guest kernel (text, data, struct pages, slabs), the initramfs that
// stays in RAM as the initial rootfs (~9 MiB unpacked with its modules),
// the guest init and the page cache of the root image outside the
// sandbox's cgroup. VM memory = Limits.MemoryMiB + guestOverheadMiB; the
// sandbox's cgroup in the guest (memory.max) holds the sandbox to its own
// limit, so the overhead never becomes sandbox memory.
const guestOverheadMiB = 96

// tcgTBSizeMiB bounds TCG's translation cache. QEMU's default is 1 GiB
// per VM, host memory a TCG guest could make QEMU take on top of its RAM;
// 128 MiB holds a Debian userland's hot code with little retranslation.
const tcgTBSizeMiB = 128

// startTimeout bounds a cold boot until the agent answers. Under TCG on a
// loaded 2-core host a boot takes 3–10 s (docs/microvm.md).
const startTimeout = 2 * time.Minute

func init() {
	runtime.Register(Name, New)
}

// Runtime is the microvm runtime. Layout under Config.DataDir:
//
//	images/<digest>.erofs     read-only root image per template tree (Images)
//	boot/                     initramfs cache (BuildInitramfs)
//	probe.json                the probe's result for this host boot
//	sandboxes/<id>/           one sandbox (see instance.go)
//	warm/<key>/               warm templates (warm.go)
type Runtime struct {
	cfg    runtime.Config
	log    *slog.Logger
	images *Images
	probe  runtime.ProbeCache

	bootMu sync.Mutex
	boot   *bootFiles // kernel and initramfs, once found

	// probing is set while the probe's own sandbox exists, which Sweep
	// must leave alone.
	probing atomic.Bool

	// noWarm turns warm templates off (SetWarmTemplates).
	noWarm atomic.Bool
}

// SetWarmTemplates turns warm templates on (the default) or off. Off, every
// Start boots cold and no snapshot is taken: for deployments that do not
// want clones sharing a guest kernel's address-space layout, and for
// measuring cold boots.
func (r *Runtime) SetWarmTemplates(on bool) { r.noWarm.Store(!on) }

// bootFiles is what every guest boots from.
type bootFiles struct {
	kernel Kernel
	initrd string
}

var (
	_ runtime.Runtime          = (*Runtime)(nil)
	_ runtime.TemplatePreparer = (*Runtime)(nil)
)

// New builds the microvm runtime; it touches nothing until used.
func New(cfg runtime.Config) (runtime.Runtime, error) {
	log, err := cfg.Check(Name)
	if err != nil {
		return nil, err
	}
	return &Runtime{
		cfg:    cfg,
		log:    log,
		images: &Images{Dir: filepath.Join(cfg.DataDir, "images"), AgentBinary: cfg.AgentBinary},
	}, nil
}

// jailBinary is space-jail: the configured one, else the one next to the
// agent binary (make build and scripts/setup.sh put them side by side).
func (r *Runtime) jailBinary() string {
	if r.cfg.JailBinary != "" {
		return r.cfg.JailBinary
	}
	if r.cfg.AgentBinary == "" {
		return ""
	}
	return filepath.Join(filepath.Dir(r.cfg.AgentBinary), "space-jail")
}

// Name implements runtime.Runtime.
func (r *Runtime) Name() string { return Name }

// kernelCacheDir is where scripts/setup.sh unpacks the guest kernel.
func kernelCacheDir() string {
	if d := os.Getenv("SPACE_CACHE"); d != "" {
		return d
	}
	return "/var/cache/space"
}

// bootFiles finds the kernel and builds (or finds cached) the initramfs
// with the configured agent binary. A success is kept for the runtime's
// life; the agent binary of a running server does not change under it.
func (r *Runtime) bootFiles() (*bootFiles, error) {
	r.bootMu.Lock()
	defer r.bootMu.Unlock()
	if r.boot != nil {
		return r.boot, nil
	}
	k, err := FindKernel(kernelCacheDir())
	if err != nil {
		return nil, fmt.Errorf("guest kernel: %w: %w", err, errdefs.ErrUnavailable)
	}
	if r.cfg.AgentBinary == "" {
		return nil, fmt.Errorf("microvm runtime: no agent binary configured: %w", errdefs.ErrUnavailable)
	}
	dir := filepath.Join(r.cfg.DataDir, "boot")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	initrd, err := BuildInitramfs(k, r.cfg.AgentBinary, dir)
	if err != nil {
		return nil, fmt.Errorf("guest initramfs: %w", err)
	}
	r.boot = &bootFiles{kernel: k, initrd: initrd}
	return r.boot, nil
}

// PrepareTemplate implements runtime.TemplatePreparer: the template's
// read-only erofs root image, built once per tree digest.
func (r *Runtime) PrepareTemplate(ctx context.Context, treeDigest, rootfs string) error {
	_, err := r.images.Prepare(ctx, treeDigest, rootfs)
	return err
}

// ForgetTemplate implements runtime.TemplatePreparer. Running guests keep
// their open image; a later Create of the digest builds it again.
func (r *Runtime) ForgetTemplate(ctx context.Context, treeDigest string) error {
	return errors.Join(r.images.Forget(ctx, treeDigest), r.ForgetWarm(treeDigest))
}

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,39}$`)

func (r *Runtime) sandboxesDir() string { return filepath.Join(r.cfg.DataDir, "sandboxes") }

func (r *Runtime) newInstance(spec runtime.Spec) (*instance, error) {
	if !idRE.MatchString(spec.ID) {
		return nil, fmt.Errorf("sandbox id %q: %w", spec.ID, errdefs.ErrInvalidArgument)
	}
	i := &instance{rt: r, spec: spec, files: layout{id: spec.ID, dir: filepath.Join(r.sandboxesDir(), spec.ID)}}
	i.vm = &vmm{rt: r, spec: spec, files: i.files}
	i.guest = &guestCtl{id: spec.ID, sock: i.files.ctlSocket(), running: i.vm.alive}
	i.vm.guest = i.guest
	i.snap = &snapshots{rt: r, id: spec.ID, files: i.files, vm: i.vm, guest: i.guest}
	i.warm = &warmer{rt: r, spec: spec, files: i.files, snap: i.snap}
	// QEMU binds the sockets at these paths: they must fit a sockaddr_un.
	if p := i.files.qmpSocket(); len(p) > maxUnixPath {
		return nil, fmt.Errorf("microvm runtime: DataDir %s is too long for the sandboxes' unix sockets (%s): %w", r.cfg.DataDir, p, errdefs.ErrInvalidArgument)
	}
	return i, nil
}

// Create implements runtime.Runtime: the sandbox directory, the template's
// root image (derived once per tree digest) and the sandbox's writable
// ext4 disk of Limits.DiskMiB. Nothing runs until Start; on error nothing
// of this sandbox is left.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (_ runtime.Instance, err error) {
	i, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	l := spec.Limits
	if l.DiskMiB <= 0 || l.MemoryMiB <= 0 || l.CPUs <= 0 || l.Pids <= 0 {
		return nil, fmt.Errorf("limits %+v: every limit must be set: %w", l, errdefs.ErrInvalidArgument)
	}
	if fi, err := os.Stat(spec.RootFS); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("template root %q is not a directory: %w", spec.RootFS, errdefs.ErrInvalidArgument)
	}
	if spec.Hostname != "" && !hostnameRE.MatchString(spec.Hostname) {
		return nil, fmt.Errorf("hostname %q: %w", spec.Hostname, errdefs.ErrInvalidArgument)
	}
	if err := hostfs.MkdirSandbox(i.files.dir, spec.ID); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			if derr := i.Destroy(context.WithoutCancel(ctx)); derr != nil {
				r.log.Warn("rolling back a failed create", "id", spec.ID, "err", derr)
			}
		}
	}()
	if _, err := r.images.Prepare(ctx, spec.TemplateDigest, spec.RootFS); err != nil {
		return nil, fmt.Errorf("root image of %s: %w", spec.TemplateDigest, err)
	}
	if err := os.Mkdir(i.files.vmDir(), 0o700); err != nil {
		return nil, err
	}
	fctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := hostfs.FormatExt4(fctx, i.files.diskImage(), l.DiskMiB, diskRootID); err != nil {
		return nil, err
	}
	return i, nil
}

// Open implements runtime.Runtime: it re-adopts a sandbox created earlier.
// Its QEMU is trusted to be the one it started only when the recorded pid
// still runs with the recorded start time.
func (r *Runtime) Open(ctx context.Context, spec runtime.Spec) (runtime.Instance, error) {
	i, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(i.files.dir); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, errdefs.ErrNotFound)
	}
	i.mu.Lock()
	i.vm.adopt(ctx)
	i.mu.Unlock()
	return i, nil
}

// Sweep implements runtime.Runtime: sandboxes are found by their
// directories and by QEMU processes whose command line names a sandbox
// directory of this runtime (a directory removed under a live QEMU);
// those keep rejects are destroyed.
func (r *Runtime) Sweep(ctx context.Context, keep func(id string) bool) ([]string, error) {
	ids := map[string]bool{}
	if ents, err := os.ReadDir(r.sandboxesDir()); err == nil {
		for _, e := range ents {
			ids[e.Name()] = true
		}
	}
	orphans := qemuProcessesUnder(r.sandboxesDir())
	for id := range orphans {
		ids[id] = true
	}
	var errs []error
	var removed []string
	for id := range ids {
		if keep(id) || !idRE.MatchString(id) || (r.probing.Load() && strings.HasPrefix(id, probeIDPrefix)) {
			continue
		}
		i, err := r.newInstance(runtime.Spec{ID: id})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		i.mu.Lock()
		i.vm.adopt(ctx)
		i.mu.Unlock()
		if err := i.Destroy(ctx); err != nil {
			errs = append(errs, fmt.Errorf("sweep %s: %w", id, err))
			continue
		}
		// A QEMU the pid file did not name (its directory went first).
		for _, pid := range orphans[id] {
			killPid(pid)
		}
		removed = append(removed, id)
	}
	// What a probe cut short by a crash left (its sandbox went above).
	if !r.probing.Load() {
		for _, pat := range []string{".probe-tree-*", "kvmprobe*"} {
			m, _ := filepath.Glob(filepath.Join(r.cfg.DataDir, pat))
			for _, p := range m {
				_ = os.RemoveAll(p)
			}
		}
	}
	sort.Strings(removed)
	return removed, errors.Join(errs...)
}

// qemuProcessesUnder finds processes whose arguments name a path below
// dir/<id>/, by sandbox id.
func qemuProcessesUnder(dir string) map[string][]int {
	out := map[string][]int{}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return out
	}
	prefix := dir + "/"
	for _, e := range ents {
		pid := 0
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid <= 0 {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(b), prefix) {
			continue
		}
		for _, arg := range strings.Split(string(b), "\x00") {
			_, rest, ok := strings.Cut(arg, prefix)
			if !ok {
				continue
			}
			if id, _, ok := strings.Cut(rest, "/"); ok && idRE.MatchString(id) {
				out[id] = append(out[id], pid)
				break
			}
		}
	}
	return out
}

// killPid SIGKILLs pid through a pidfd (so a recycled pid is never hit
// after the check) and waits briefly for it to go.
func killPid(pid int) {
	p, err := hostproc.OpenPid(pid)
	if err != nil {
		return
	}
	exited := p.Exited()
	_ = p.Signal(unix.SIGKILL)
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
	}
}
