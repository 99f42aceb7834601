package native

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/hostfs"
)

// The writable layer of a sandbox is a sparse ext4 image of Limits.DiskMiB,
// so a full disk is a real ENOSPC inside the sandbox and not a full host.

// formatDisk creates img (sparse) with an ext4 filesystem whose root
// belongs to the sandbox's root user.
func formatDisk(ctx context.Context, img string, sizeMiB int64) error {
	return hostfs.FormatExt4(ctx, img, sizeMiB, hostIDBase)
}

// mountDisk mounts img at dir with upper/ and work/ owned by the sandbox's root.
func mountDisk(img, dir string) error { return hostfs.MountDisk(img, dir, hostIDBase) }

// mountDetached mounts img like mountDisk but attaches the mount nowhere:
// it is held only by the returned descriptor, so it is in no mount table
// and goes away with the descriptor (and autoclear then frees the loop
// device), even when this process dies. attachMount puts it in place.
func mountDetached(img string) (int, error) {
	mfd, err := fsmountImage(img, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return -1, err
	}
	for _, sub := range []string{"upper", "work"} {
		if err := unix.Mkdirat(mfd, sub, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
			unix.Close(mfd)
			return -1, err
		}
		if err := unix.Fchownat(mfd, sub, hostIDBase, hostIDBase, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			unix.Close(mfd)
			return -1, err
		}
	}
	return mfd, nil
}

// fsmountImage mounts the ext4 image img, detached, with the mount
// attributes attrs (unix.MOUNT_ATTR_*), on a new autoclear loop device.
func fsmountImage(img string, attrs int) (int, error) {
	dev, err := hostfs.AttachLoop(img)
	if err != nil {
		return -1, err
	}
	defer dev.Close()
	fsfd, err := unix.Fsopen("ext4", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen ext4: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", dev.Name()); err != nil {
		return -1, fmt.Errorf("ext4 source: %w", err)
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("mount %s: %w", img, err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, attrs)
	if err != nil {
		return -1, fmt.Errorf("fsmount %s: %w", img, err)
	}
	return mfd, nil
}

// attachMount attaches a detached mount at dir. It closes mfd.
func attachMount(mfd int, dir string) error {
	defer unix.Close(mfd)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach disk at %s: %w", dir, err)
	}
	return nil
}

// takeDisk puts a formatted disk image of sizeMiB at img: a spare one from
// the pool (mounted at mnt already, when it could be) when there is one,
// else one formatted now.
func (r *Runtime) takeDisk(ctx context.Context, img, mnt string, sizeMiB int64) error {
	if mfd, ok := r.disks.take(sizeMiB, img); ok {
		if mfd >= 0 {
			// On failure mountDisk mounts it the usual way.
			_ = attachMount(mfd, mnt)
		}
		return nil
	}
	return formatDisk(ctx, img, sizeMiB)
}
