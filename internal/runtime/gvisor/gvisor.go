// Package gvisor is the gVisor runtime: every sandbox runs on gVisor's
// user-space kernel (runsc, systrap platform), so code in the sandbox talks
// to the sentry, never to the host kernel's full syscall surface.
//
// The runtime generates one OCI bundle per sandbox and drives runsc with a
// state directory of its own (--root), so runsc state, cgroups and
// directories are the whole truth about which sandboxes exist.
//
// Layout under Config.DataDir:
//
//	state/                    runsc --root (runsc's container state)
//	sandboxes/<id>/disk.img   sparse ext4 image: the writable layer
//	sandboxes/<id>/rw/        its mount point: upper/, work/
//	sandboxes/<id>/rootfs/    host overlayfs: template tree + rw/upper
//	sandboxes/<id>/agent/     mounted at /run/space: the agent binds
//	                          agent.sock here; the host dials it
//	sandboxes/<id>/config.json the OCI spec (the bundle is the directory)
//	sandboxes/<id>/sandbox.pid "pid starttime" of the running sandbox
//
// Root filesystem: a host overlay of the template tree (Spec.RootFS, the
// lower layer, never written) and upper/ on the sandbox's own ext4 image,
// served by runsc's gofer with gVisor's internal rootfs overlay turned off
// (--overlay2=none). Writes land on the image: they survive Stop, a full
// image is ENOSPC inside, and Destroy removes it.
//
// Agent stream: space-agent is the container's init (bind-mounted read-only
// at /run/space/space-agent) and listens with --socket on
// /run/space/agent.sock, a host directory mounted into the sandbox. With
// --host-uds=create the sentry binds that socket on the host, so the
// server dials a plain unix socket, also after a restart.
//
// User namespace: the init first moves the agent into a user, pid and mount
// namespace of its own inside gVisor (package ginit), where sandbox root is
// uid 100000000 of the sentry; the template is mounted id-mapped to match.
//
// See docs/gvisor.md for flags, measurements and known gaps.
package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// Name is the name the runtime registers under.
const Name = "gvisor"

// strength ranks the runtime for "auto": gVisor's user-space kernel isolates
// more than native's namespaces (10), and with suspend/restore/fork it can do
// more, so auto prefers it wherever its probe sandbox really runs.
const strength = 20

func init() {
	runtime.Register(Name, New)
}

// Runtime is the gVisor runtime.
type Runtime struct {
	cfg   runtime.Config
	log   *slog.Logger
	probe probeCache

	runscOnce sync.Once
	rs        *runsc
	rsErr     error

	usernsOnce sync.Once
	userns     int // user namespace for id-mapped mounts (idmap.go)
	usernsErr  error
}

var (
	_ runtime.Runtime = (*Runtime)(nil)
	_ io.Closer       = (*Runtime)(nil)
)

// New builds the gVisor runtime; it touches nothing until used.
func New(cfg runtime.Config) (runtime.Runtime, error) {
	log, err := cfg.Check(Name)
	if err != nil {
		return nil, err
	}
	return &Runtime{cfg: cfg, log: log}, nil
}

// Name implements runtime.Runtime.
func (r *Runtime) Name() string { return Name }

// Close removes the bind mount runsc pins its shared empty gofer network
// namespace with (state/null-netns), left by a runsc run without
// --gofer-network-namespace=new (an earlier configuration); it would make
// the state directory impossible to remove. Sandboxes keep running (their
// processes hold their namespaces). The runtime still works after Close.
func (r *Runtime) Close() error {
	path := filepath.Join(r.cfg.DataDir, "state", "null-netns")
	// Concurrent runsc starts may have stacked several mounts on it.
	for i := 0; i < 64 && unix.Unmount(path, unix.MNT_DETACH) == nil; i++ {
	}
	return nil
}

// runsc returns the runsc driver, finding the binary once.
func (r *Runtime) runsc() (*runsc, error) {
	r.runscOnce.Do(func() {
		bin, err := findRunsc()
		if err != nil {
			r.rsErr = err
			return
		}
		root := filepath.Join(r.cfg.DataDir, "state")
		if err := os.MkdirAll(root, 0o700); err != nil {
			r.rsErr = err
			return
		}
		r.rs = &runsc{bin: bin, root: root, flags: globalFlags()}
	})
	return r.rs, r.rsErr
}

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,39}$`)

func (r *Runtime) sandboxesDir() string { return filepath.Join(r.cfg.DataDir, "sandboxes") }

func (r *Runtime) newInstance(spec runtime.Spec) (*instance, error) {
	if !idRE.MatchString(spec.ID) {
		return nil, fmt.Errorf("sandbox id %q: %w", spec.ID, errdefs.ErrInvalidArgument)
	}
	rs, err := r.runsc()
	if err != nil {
		return nil, fmt.Errorf("gvisor runtime: %w: %w", err, errdefs.ErrUnavailable)
	}
	dir := filepath.Join(r.sandboxesDir(), spec.ID)
	// The agent socket's host path may be longer than a sockaddr_un
	// holds: the gofer binds it at its own short path and the host dials
	// it through an O_PATH descriptor (agentChan.dial, DialAgent).
	files := layout{dir: dir}
	agent := &agentChan{id: spec.ID, files: files}
	return &instance{rt: r, rs: rs, spec: spec, files: files, agent: agent,
		ckpt:  &checkpointer{rt: r, rs: rs, id: spec.ID, files: files, agent: agent},
		meter: &meter{rs: rs, id: spec.ID, files: files}}, nil
}

// Create implements runtime.Runtime: the sandbox directory and its
// formatted disk image. Nothing runs until Start.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (_ runtime.Instance, err error) {
	inst, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if spec.Limits.DiskMiB <= 0 {
		return nil, fmt.Errorf("disk limit must be set: %w", errdefs.ErrInvalidArgument)
	}
	if fi, err := os.Stat(spec.RootFS); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("template root %q is not a directory: %w", spec.RootFS, errdefs.ErrInvalidArgument)
	}
	if err := hostfs.MkdirSandbox(inst.files.dir, spec.ID); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = inst.Destroy(context.WithoutCancel(ctx))
		}
	}()
	if err := formatDisk(ctx, inst.files.diskImage(), spec.Limits.DiskMiB); err != nil {
		return nil, err
	}
	return inst, nil
}

// Open implements runtime.Runtime: it re-adopts a sandbox created earlier,
// trusting its pid file only when the pid's start time still matches and
// runsc still knows the container.
func (r *Runtime) Open(ctx context.Context, spec runtime.Spec) (runtime.Instance, error) {
	inst, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(inst.files.dir); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, errdefs.ErrNotFound)
	}
	inst.adopt(ctx)
	return inst, nil
}

// Sweep implements runtime.Runtime: it finds sandboxes by every trace they
// leave — runsc state, directories, mounts, cgroups — and destroys those
// keep rejects.
func (r *Runtime) Sweep(ctx context.Context, keep func(id string) bool) ([]string, error) {
	rs, err := r.runsc()
	if err != nil {
		return nil, nil // nothing of ours can exist without runsc
	}
	ids := map[string]bool{}
	if ents, err := os.ReadDir(r.sandboxesDir()); err == nil {
		for _, e := range ents {
			ids[e.Name()] = true
		}
	}
	var errs []error
	if listed, err := rs.list(ctx); err == nil {
		for _, id := range listed {
			ids[id] = true
		}
	} else {
		errs = append(errs, fmt.Errorf("listing runsc containers: %w", err))
	}
	if mps, err := hostfs.MountsUnder(r.sandboxesDir()); err == nil {
		for _, mp := range mps {
			if rel, err := filepath.Rel(r.sandboxesDir(), mp); err == nil && rel != "." {
				id, _, _ := strings.Cut(rel, "/")
				ids[id] = true
			}
		}
	}
	// Cgroups are host-wide while DataDir is not: another gvisor runtime
	// (a second server, a test) may own one. Only an empty cgroup with no
	// runsc container here is removed.
	for _, id := range cgroupIDs() {
		if !ids[id] && !keep(id) && idRE.MatchString(id) && len(cgroupProcs(id)) == 0 {
			_ = removeCgroups(id)
		}
	}
	var removed []string
	for id := range ids {
		if keep(id) || !idRE.MatchString(id) {
			continue
		}
		inst, err := r.newInstance(runtime.Spec{ID: id})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		inst.adopt(ctx)
		if err := inst.Destroy(ctx); err != nil {
			errs = append(errs, fmt.Errorf("sweep %s: %w", id, err))
			continue
		}
		removed = append(removed, id)
	}
	sort.Strings(removed)
	return removed, errors.Join(errs...)
}
