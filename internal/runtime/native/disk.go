package native

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The writable layer of a sandbox is a sparse ext4 image of Limits.DiskMiB,
// so a full disk is a real ENOSPC inside the sandbox and not a full host.

// formatDisk creates img (sparse) and makes an ext4 filesystem on it whose
// root belongs to the sandbox's root user. Lazy inode-table and journal
// initialisation keep mkfs fast; the kernel finishes it in the background.
func formatDisk(ctx context.Context, img string, sizeMiB int64) error {
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("create disk image: %w", err)
	}
	err = f.Truncate(sizeMiB << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(img)
		return fmt.Errorf("size disk image: %w", err)
	}
	cmd := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-m", "0",
		"-E", fmt.Sprintf("lazy_itable_init=1,lazy_journal_init=1,root_owner=%d:%d", hostIDBase, hostIDBase),
		img)
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(img)
		return fmt.Errorf("mkfs.ext4: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// attachLoop binds img to a free loop device with autoclear, so the device
// detaches by itself when its filesystem is finally unmounted (including
// when the last sandbox mount namespace holding it goes away).
func attachLoop(img string) (*os.File, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer ctl.Close()
	backing, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer backing.Close()
	// LOOP_CTL_GET_FREE races with other attachers: retry on EBUSY.
	for attempt := 0; attempt < 20; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("get free loop device: %w", err)
		}
		dev, err := os.OpenFile(fmt.Sprintf("/dev/loop%d", n), os.O_RDWR, 0)
		if err != nil {
			return nil, err
		}
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:], img)
		err = unix.IoctlLoopConfigure(int(dev.Fd()), &cfg)
		if err == nil {
			return dev, nil
		}
		dev.Close()
		if !errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("configure loop device: %w", err)
		}
		time.Sleep(time.Millisecond)
	}
	return nil, errors.New("no free loop device after 20 attempts")
}

// mountDisk mounts img at dir (nosuid, nodev) and makes sure upper/ and
// work/ exist for the overlay, owned by the sandbox's root.
func mountDisk(img, dir string) error {
	if isMountPoint(dir) {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	dev, err := attachLoop(img)
	if err != nil {
		return err
	}
	// Closing our descriptor after the mount leaves the mount as the only
	// user; autoclear then detaches the device on the last unmount.
	defer dev.Close()
	if err := unix.Mount(dev.Name(), dir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount %s: %w", img, err)
	}
	for _, sub := range []string{"upper", "work"} {
		p := filepath.Join(dir, sub)
		if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		if err := os.Lchown(p, hostIDBase, hostIDBase); err != nil {
			return err
		}
	}
	return nil
}

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
	dev, err := attachLoop(img)
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

// unmountAll unmounts everything at or below dir, deepest first, falling
// back to a lazy unmount for a mount something still holds.
func unmountAll(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, mp := range mps {
		if err := unix.Unmount(mp, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				errs = append(errs, fmt.Errorf("unmount %s: %w", mp, err))
			}
		}
	}
	return errors.Join(errs...)
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
