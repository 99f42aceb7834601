package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/forkutil"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// Fork.
//
// The parent (its agent quiesced by the manager) is paused, checkpointed
// with --leave-running into a temporary image, and its writable disk is
// frozen (FIFREEZE) and copied while it stays paused, so every child's disk
// matches the memory image. Then the parent resumes and its agent listens
// again, and each child — its own directory, id, disk copy, overlay, agent
// directory and bundle, with the same mounts at the same places — is
// restored from the image. Children take the parent's disk size, and a copy
// of the parent's /run/space (see copyAgentDir).

// forkParallel is how many children restore at once.
const forkParallel = 4

// Fork implements runtime.Forker.
//
// The children are validated (forkutil.Run) only once the parent's agent
// is known to be quiet, so that a refused fork, too, lets it listen again.
func (i *instance) Fork(ctx context.Context, children []runtime.Spec) (_ []runtime.Instance, err error) {
	if len(children) == 0 {
		return nil, forkutil.Validate(i.spec.ID, children)
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.aliveLocked() {
		return nil, fmt.Errorf("fork sandbox %s: not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if err := i.agent.waitQuiesced(ctx); err != nil {
		return nil, fmt.Errorf("fork sandbox %s: %w", i.spec.ID, err)
	}
	// From here on the parent's agent is quiet: whatever fails, it must
	// listen again.
	agentBack := false
	defer func() {
		if err != nil && !agentBack && i.aliveLocked() {
			if rerr := i.agent.resume(ctx, i.exited); rerr != nil {
				err = errors.Join(err, fmt.Errorf("and the parent's agent did not listen again: %w", rerr))
			}
		}
	}()
	t0 := time.Now()
	image, err := os.MkdirTemp(i.files.dir, "fork-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(image)
	var tSnap time.Duration
	out, err := forkutil.Run(ctx, i.spec.ID, children, forkutil.Ops[*instance]{
		New: i.rt.newChild,
		Snapshot: func(ctx context.Context, kids []*instance) error {
			if err := i.ckpt.forkSnapshot(ctx, image, kids); err != nil {
				return err
			}
			agentBack = true
			if err := i.agent.resume(ctx, i.exited); err != nil {
				return fmt.Errorf("the parent's agent did not listen again: %w", err)
			}
			tSnap = time.Since(t0)
			return nil
		},
		// Children restore concurrently: much of a restore is waiting
		// (runsc start-up, the gofer, page loading), so a few at once
		// finish sooner even on two cores.
		Restore:  func(ctx context.Context, k *instance) error { return k.restoreChild(ctx, image) },
		Parallel: forkParallel,
		Log:      i.rt.log,
	})
	if err != nil {
		return nil, err
	}
	i.rt.log.Debug("sandbox forked", "id", i.spec.ID, "children", len(out), "snapshot", tSnap, "total", time.Since(t0))
	return out, nil
}

// forkSnapshot pauses the parent, checkpoints it into image (it keeps
// running: --leave-running), copies its frozen disk to every child, and
// resumes it whatever happened.
func (c *checkpointer) forkSnapshot(ctx context.Context, image string, kids []*instance) (err error) {
	if err := c.savePaused(ctx, image, true); err != nil {
		return err
	}
	defer func() {
		if rerr := c.resume(ctx); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}()
	for _, k := range kids {
		if err := makeAgentDir(k.files.agentDir()); err != nil {
			return err
		}
		if err := copyAgentDir(c.files.agentDir(), k.files.agentDir()); err != nil {
			return fmt.Errorf("copying /run/space to %s: %w", k.spec.ID, err)
		}
	}
	return withFrozen(c.files.rwDir(), func() error {
		for _, k := range kids {
			if err := hostfs.CopySparse(c.files.diskImage(), k.files.diskImage()); err != nil {
				return fmt.Errorf("copying the disk to %s: %w", k.spec.ID, err)
			}
		}
		return nil
	})
}

// FIFREEZE and FITHAW: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const (
	fiFreeze = 0xc0045877
	fiThaw   = 0xc0045878
)

// withFrozen runs fn with the filesystem mounted at dir frozen: flushed
// and consistent on its device, with writes blocked.
func withFrozen(dir string, fn func() error) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.IoctlSetInt(fd, fiFreeze, 0); err != nil {
		return fmt.Errorf("freezing %s: %w", dir, err)
	}
	ferr := fn()
	if err := unix.IoctlSetInt(fd, fiThaw, 0); err != nil {
		return errors.Join(ferr, fmt.Errorf("thawing %s: %w", dir, err))
	}
	return ferr
}

// newChild makes a fork child's directory (its disk comes from the
// parent). The child is removed by Destroy like any instance.
func (r *Runtime) newChild(spec runtime.Spec) (*instance, error) {
	k, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(spec.RootFS); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("template root %q is not a directory: %w", spec.RootFS, errdefs.ErrInvalidArgument)
	}
	if err := hostfs.MkdirSandbox(k.files.dir, spec.ID); err != nil {
		return nil, err
	}
	return k, nil
}

// restoreChild mounts the child's root over its disk copy, writes its
// bundle and restores it from the parent's image.
func (k *instance) restoreChild(ctx context.Context, image string) (err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if err := k.files.mountRoot(k.spec.RootFS, k.rt.usernsFD); err != nil {
		return err
	}
	hostname := k.spec.Hostname
	if hostname == "" {
		hostname = k.spec.ID
	}
	if err := prepareNIC(k.files.netnsPath(), k.spec.ID); err != nil {
		return err
	}
	if err := writeSpec(k.files.dir, bundleSpec(k.spec.ID, k.files.rootfsDir(), hostname, k.files.agentDir(), k.rt.cfg.AgentBinary, k.files.netnsPath(), k.spec.Limits)); err != nil {
		return err
	}
	if err := writeResumeMarker(k.files.agentDir()); err != nil {
		return err
	}
	if err := k.restoreFrom(ctx, image); err != nil {
		return err
	}
	if err := k.agent.waitPolling(ctx, k.exited); err != nil {
		return err
	}
	removeResumeMarker(k.files.agentDir())
	return nil
}

// Bounds of the agent directory a fork copies: the sandbox can write it.
const (
	agentDirMaxEntries = 256
	agentDirMaxBytes   = 4 << 20
	agentDirMaxDepth   = 8
)

// copyAgentDir copies the parent's agent directory (mounted at /run/space)
// into a child's: a restore walks again every path the sentry knew, so
// what the sandbox or ginit's guard made there must exist in the child as
// well. Owners and modes are kept; nothing is followed; the agent's socket
// and the resume marker are left out. The directory is the sandbox's to
// write, so the copy is bounded and a too large one fails the fork.
func copyAgentDir(src, dst string) error {
	sfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	dfd, err := unix.Open(dst, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	b := &copyBudget{entries: agentDirMaxEntries, bytes: agentDirMaxBytes}
	return copyDirAt(sfd, dfd, 0, b)
}

type copyBudget struct{ entries, bytes int64 }

func copyDirAt(sfd, dfd, depth int, b *copyBudget) error {
	if depth > agentDirMaxDepth {
		return fmt.Errorf("agent directory deeper than %d", agentDirMaxDepth)
	}
	dup, err := unix.Dup(sfd)
	if err != nil {
		return err
	}
	d := os.NewFile(uintptr(dup), "agentdir")
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return err
	}
	for _, name := range names {
		if depth == 0 && (name == agentSock || name == resumeMarker) {
			continue
		}
		if b.entries--; b.entries < 0 {
			return fmt.Errorf("agent directory has more than %d entries", agentDirMaxEntries)
		}
		var st unix.Stat_t
		if err := unix.Fstatat(sfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		mode := st.Mode & 0o7777
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
				return err
			}
			csfd, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			cdfd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				unix.Close(csfd)
				return err
			}
			err = copyDirAt(csfd, cdfd, depth+1, b)
			if err == nil {
				err = fchownmod(cdfd, st.Uid, st.Gid, mode)
			}
			unix.Close(csfd)
			unix.Close(cdfd)
			if err != nil {
				return err
			}
		case unix.S_IFREG:
			if b.bytes -= st.Size; b.bytes < 0 {
				return fmt.Errorf("agent directory holds more than %d bytes", agentDirMaxBytes)
			}
			in, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			out, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
			if err != nil {
				unix.Close(in)
				return err
			}
			inF, outF := os.NewFile(uintptr(in), name), os.NewFile(uintptr(out), name)
			_, err = io.Copy(outF, io.LimitReader(inF, st.Size))
			if err == nil {
				err = fchownmod(out, st.Uid, st.Gid, mode)
			}
			inF.Close()
			outF.Close()
			if err != nil {
				return err
			}
		case unix.S_IFLNK:
			buf := make([]byte, 4096)
			n, err := unix.Readlinkat(sfd, name, buf)
			if err != nil {
				return err
			}
			if err := unix.Symlinkat(string(buf[:n]), dfd, name); err != nil {
				return err
			}
			if err := unix.Fchownat(dfd, name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return err
			}
		default:
			// Sockets, fifos, devices: a bound socket already failed the
			// checkpoint; the rest cannot be copied meaningfully.
			return fmt.Errorf("agent directory holds %q of type %#o, which a fork cannot copy", name, st.Mode&unix.S_IFMT)
		}
	}
	return nil
}

func fchownmod(fd int, uid, gid, mode uint32) error {
	if err := unix.Fchown(fd, int(uid), int(gid)); err != nil {
		return err
	}
	return unix.Fchmod(fd, mode)
}
