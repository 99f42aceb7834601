package native

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// OpaqueXattr is the attribute overlayfs marks opaque directories with in a
// native sandbox's upper layer: the overlay is mounted inside the sandbox's
// user namespace with userxattr, so it uses the user.* namespace rather
// than trusted.* (which needs CAP_SYS_ADMIN in the initial namespace).
const OpaqueXattr = "user.overlay.opaque"

// Changes implements runtime.ChangeExporter. The sandbox must be stopped.
// Its disk is exposed read-only (and nosuid, nodev, noexec: everything in it
// was written by the sandbox) at DataDir/sandboxes/<id>/export, and Dir is
// its upper/ directory, whose owners are host ids (IDBase is the sandbox's
// root). Calling it again returns the same export; Release, Start and
// Destroy end it.
func (i *instance) Changes(ctx context.Context) (runtime.Changes, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.aliveLocked() {
		return runtime.Changes{}, fmt.Errorf("sandbox %s is running; stop it before reading its changes: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if i.pid != 0 {
		// Its init died on its own and nobody stopped it yet: its
		// processes and mounts may still be going away.
		return runtime.Changes{}, fmt.Errorf("sandbox %s exited without being stopped; stop it before reading its changes: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if _, err := os.Stat(i.dir); err != nil {
		return runtime.Changes{}, fmt.Errorf("sandbox %s: %w", i.spec.ID, errdefs.ErrNotFound)
	}
	if err := ctx.Err(); err != nil {
		return runtime.Changes{}, err
	}
	if !isMountPoint(i.exportDir()) {
		if err := i.exportLocked(); err != nil {
			return runtime.Changes{}, fmt.Errorf("expose changes of sandbox %s: %w", i.spec.ID, err)
		}
	}
	upper := filepath.Join(i.exportDir(), "upper")
	var st unix.Stat_t
	if err := unix.Lstat(upper, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		_ = i.releaseChangesLocked()
		return runtime.Changes{}, fmt.Errorf("sandbox %s has no upper directory on its disk (%v): %w", i.spec.ID, err, errdefs.ErrUnavailable)
	}
	return runtime.Changes{Dir: upper, OpaqueXattr: OpaqueXattr, IDBase: hostIDBase, Release: i.releaseChanges}, nil
}

// exportLocked mounts the sandbox's disk read-only at exportDir: a second
// mount of the superblock that is already mounted at rwDir (a sandbox that
// was created but never started), or else the image itself.
func (i *instance) exportLocked() error {
	attrs := unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC
	var mfd int
	if isMountPoint(i.rwDir()) {
		fd, err := unix.OpenTree(unix.AT_FDCWD, i.rwDir(), unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_SYMLINK_NOFOLLOW)
		if err != nil {
			return fmt.Errorf("clone disk mount: %w", err)
		}
		attr := unix.MountAttr{Attr_set: uint64(attrs)}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("make disk mount read-only: %w", err)
		}
		mfd = fd
	} else {
		fd, err := fsmountImage(i.diskImage(), attrs)
		if err != nil {
			return err
		}
		mfd = fd
	}
	return attachMount(mfd, i.exportDir())
}

// releaseChanges is Changes.Release.
func (i *instance) releaseChanges() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.releaseChangesLocked()
}

// releaseChangesLocked unmounts the export, if any; the loop device of an
// image mounted for it detaches by itself (autoclear).
func (i *instance) releaseChangesLocked() error {
	dir := i.exportDir()
	if err := unmountAll(dir); err != nil {
		return err
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
