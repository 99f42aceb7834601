// Package hostfs holds the host-side filesystem plumbing runtimes share: a
// sandbox's writable layer as a sparse ext4 image on an autoclear loop
// device, and the mount-table walks that find and remove what a sandbox
// left mounted.
package hostfs

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// FormatExt4 creates img (sparse, sizeMiB) with an ext4 filesystem whose
// root belongs to host id rootID (the sandbox's root). Lazy inode-table and
// journal initialisation keep mkfs fast; the kernel finishes in the
// background. A failure removes img.
func FormatExt4(ctx context.Context, img string, sizeMiB int64, rootID int) error {
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
		"-E", fmt.Sprintf("lazy_itable_init=1,lazy_journal_init=1,root_owner=%d:%d", rootID, rootID), img)
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(img)
		return fmt.Errorf("mkfs.ext4: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// AttachLoop binds img to a free loop device with autoclear, so the device
// detaches by itself when its filesystem is finally unmounted (including
// when the last mount namespace holding it goes away).
func AttachLoop(img string) (*os.File, error) {
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

// loopReleaseTimeout bounds the wait for an earlier loop device of the
// same image to detach.
var loopReleaseTimeout = 10 * time.Second

// LoopDevicesOf lists the loop devices whose backing file is img (the same
// inode), from /sys/block/loop*/loop/backing_file.
func LoopDevicesOf(img string) ([]string, error) {
	var want unix.Stat_t
	if err := unix.Stat(img, &want); err != nil {
		return nil, err
	}
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		p := strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && st.Dev == want.Dev && st.Ino == want.Ino {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out, nil
}

// waitLoopReleased waits until no loop device is backed by img.
func waitLoopReleased(img string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		devs, err := LoopDevicesOf(img)
		if err != nil || len(devs) == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("disk image %s is still attached to %s after %v (an earlier mount of it not yet released): %w",
				img, strings.Join(devs, ", "), timeout, errdefs.ErrUnavailable)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// MountDisk mounts img at dir (nosuid, nodev) and makes sure upper/ and
// work/ exist for an overlay, owned by host id rootID (the upper's root is
// the sandbox's "/"). It does nothing when dir is a mount point already.
func MountDisk(img, dir string, rootID int) error {
	if IsMountPoint(dir) {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	// A previous mount of img that was unmounted lazily (something still
	// held it) keeps its ext4 alive on its own loop device until the last
	// user goes. Mounting the same image through a second device then
	// makes two filesystems over one file: the new one misses what the
	// old one has not written back, and the old one's write-back corrupts
	// the new one. Wait for the old device to go; refuse if it stays.
	if err := waitLoopReleased(img, loopReleaseTimeout); err != nil {
		return err
	}
	dev, err := AttachLoop(img)
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
		if err := os.Lchown(p, rootID, rootID); err != nil {
			return err
		}
	}
	return nil
}

// UnmountAll unmounts everything at or below dir, deepest first, falling
// back to a lazy unmount for a mount something still holds.
func UnmountAll(dir string) error {
	mps, err := MountsUnder(dir)
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

// MountsUnder lists the mount points at or below dir from
// /proc/self/mountinfo, deepest first; among equal depths the later (top)
// mount comes first, so stacked mounts unmount in order.
func MountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	dir = filepath.Clean(dir)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	// Stable insertion sort by depth: few entries, keeps the reversed
	// mount order among equal depths.
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && strings.Count(out[j], "/") > strings.Count(out[j-1], "/"); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out, nil
}

// IsMountPoint reports whether dir is the root of a mount. statx answers
// in O(1); the mount table, which grows with every running sandbox, is
// only read on kernels without STATX_ATTR_MOUNT_ROOT.
func IsMountPoint(dir string) bool {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx); err != nil {
		return false
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
	}
	m, err := MountsUnder(dir)
	if err != nil {
		return false
	}
	for _, p := range m {
		if p == filepath.Clean(dir) {
			return true
		}
	}
	return false
}

// unescapeMount decodes mountinfo's octal escapes (\040 for space, …).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			v, ok := 0, true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + int(c-'0')
			}
			if ok {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// DiskUsed is how many bytes of the filesystem mounted at dir are in use,
// as df counts them (blocks less free blocks; ext4 leaves its own metadata
// — journal, inode tables — out of both). It answers 0 when dir is not a
// mount point: statfs would then describe whatever holds dir (the host's
// disk), which is not the sandbox's.
func DiskUsed(dir string) (int64, error) {
	if !IsMountPoint(dir) {
		return 0, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, nil
}
