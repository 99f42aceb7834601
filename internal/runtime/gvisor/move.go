package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

var _ runtime.Mover = (*Runtime)(nil)

// Names inside an exported directory.
const (
	movedDisk  = "disk.img"
	movedAgent = "agent"
	movedImage = "checkpoint"
)

// Export implements runtime.Mover: the suspended instance's disk (sparse),
// its agent directory (what the restore walks again under /run/space) and
// its checkpoint image.
func (r *Runtime) Export(ctx context.Context, inst runtime.Instance, dir string) (err error) {
	i, ok := inst.(*instance)
	if !ok {
		return fmt.Errorf("export: not a gvisor instance: %w", errdefs.ErrInvalidArgument)
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.aliveLocked() || !i.ckpt.saved() {
		return fmt.Errorf("export sandbox %s: not suspended: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if _, err := os.Lstat(dir); err == nil {
		return fmt.Errorf("export sandbox %s: %s exists: %w", i.spec.ID, dir, errdefs.ErrConflict)
	}
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.MkdirAll(filepath.Join(tmp, movedAgent), 0o700); err != nil {
		return err
	}
	if err := hostfs.CopySparse(i.files.diskImage(), filepath.Join(tmp, movedDisk)); err != nil {
		return fmt.Errorf("export sandbox %s: disk: %w", i.spec.ID, err)
	}
	if err := copyAgentDir(i.files.agentDir(), filepath.Join(tmp, movedAgent)); err != nil {
		return fmt.Errorf("export sandbox %s: agent directory: %w", i.spec.ID, err)
	}
	if err := copyImage(i.files.imageDir(), filepath.Join(tmp, movedImage)); err != nil {
		return fmt.Errorf("export sandbox %s: image: %w", i.spec.ID, err)
	}
	return os.Rename(tmp, dir)
}

// Import implements runtime.Mover: a sandbox directory of this host's
// shape with the moved disk, agent directory and image, and the bundle
// written for this host's paths (Restore runs the bundle it finds).
func (r *Runtime) Import(ctx context.Context, spec runtime.Spec, dir string) (_ runtime.Instance, err error) {
	k, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(spec.RootFS); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("template root %q is not a directory: %w", spec.RootFS, errdefs.ErrInvalidArgument)
	}
	if _, err := os.Stat(k.files.dir); err == nil {
		return nil, fmt.Errorf("import sandbox %s: it exists here: %w", spec.ID, errdefs.ErrConflict)
	}
	if err := hostfs.MkdirSandbox(k.files.dir, spec.ID); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = k.Destroy(context.WithoutCancel(ctx))
		}
	}()
	if err := hostfs.CopySparse(filepath.Join(dir, movedDisk), k.files.diskImage()); err != nil {
		return nil, fmt.Errorf("import sandbox %s: disk: %w", spec.ID, err)
	}
	if err := makeAgentDir(k.files.agentDir()); err != nil {
		return nil, err
	}
	if err := copyAgentDir(filepath.Join(dir, movedAgent), k.files.agentDir()); err != nil {
		return nil, fmt.Errorf("import sandbox %s: agent directory: %w", spec.ID, err)
	}
	hostname := spec.Hostname
	if hostname == "" {
		hostname = spec.ID
	}
	bs := bundleSpec(spec.ID, k.files.rootfsDir(), hostname, k.files.agentDir(), r.cfg.AgentBinary, k.files.netnsPath(), spec.Limits)
	if err := writeSpec(k.files.dir, bs); err != nil {
		return nil, err
	}
	// The image last: its presence is what makes the instance suspended.
	if err := copyImage(filepath.Join(dir, movedImage), k.files.imageDir()+".tmp"); err != nil {
		return nil, fmt.Errorf("import sandbox %s: image: %w", spec.ID, err)
	}
	if err := os.Rename(k.files.imageDir()+".tmp", k.files.imageDir()); err != nil {
		return nil, err
	}
	return k, nil
}

// copyImage copies a checkpoint image: a directory of regular files, as
// runsc writes it (anything else is refused).
func copyImage(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			return fmt.Errorf("%s in a checkpoint image is not a regular file", e.Name())
		}
		if err := hostfs.CopySparse(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
			return err
		}
	}
	return nil
}
