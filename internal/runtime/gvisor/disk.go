package gvisor

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

	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
)

// The writable layer of a sandbox is a sparse ext4 image of Limits.DiskMiB
// mounted on the host, so a full disk is a real ENOSPC inside the sandbox
// and never a full host. The sandbox's root is a host overlayfs of the
// template tree (lower, never written) and the image's upper/ directory;
// runsc serves that merged directory to the sandbox through its gofer.

// formatDisk creates img (sparse) with an ext4 filesystem on it.
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
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-m", "0",
		"-E", fmt.Sprintf("lazy_itable_init=1,lazy_journal_init=1,root_owner=%d:%d", ginit.IDBase, ginit.IDBase), img)
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(img)
		return fmt.Errorf("mkfs.ext4: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// attachLoop binds img to a free loop device with autoclear, so the device
// detaches by itself when its filesystem is unmounted.
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

// mountDisk mounts img at dir (nosuid, nodev) with upper/ and work/ for the
// overlay. It does nothing when dir is a mount point already.
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
	// The mount is the device's last user once this closes; autoclear then
	// detaches it on unmount.
	defer dev.Close()
	if err := unix.Mount(dev.Name(), dir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount %s: %w", img, err)
	}
	for _, sub := range []string{"upper", "work"} {
		p := filepath.Join(dir, sub)
		if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		// The upper's root is the sandbox's "/": owned by its root.
		if err := os.Lchown(p, ginit.IDBase, ginit.IDBase); err != nil {
			return err
		}
	}
	return nil
}

// mountOverlay mounts the sandbox's root at merged: lower is the template
// tree, read-only to overlayfs by construction.
func mountOverlay(lower, upper, work, merged string) error {
	if isMountPoint(merged) {
		return nil
	}
	if err := os.MkdirAll(merged, 0o755); err != nil {
		return err
	}
	for _, p := range []string{lower, upper, work} {
		if strings.ContainsAny(p, ",:") {
			return fmt.Errorf("overlay layer path %q contains ',' or ':'", p)
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount overlay at %s: %w", merged, err)
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

// mountsUnder lists the mount points at or below dir, deepest first.
func mountsUnder(dir string) ([]string, error) {
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
	// Deepest first; among equals, the later (top) mount first.
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	sortByDepth(out)
	return out, nil
}

func sortByDepth(mps []string) {
	// Stable insertion sort: few entries, keeps the reversed mount order
	// among equal depths.
	for i := 1; i < len(mps); i++ {
		for j := i; j > 0 && strings.Count(mps[j], "/") > strings.Count(mps[j-1], "/"); j-- {
			mps[j], mps[j-1] = mps[j-1], mps[j]
		}
	}
}

// unescapeMount decodes the octal escapes (\040 …) of /proc/self/mountinfo.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			v := 0
			ok := true
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

func isMountPoint(dir string) bool {
	mps, err := mountsUnder(dir)
	if err != nil {
		return false
	}
	for _, mp := range mps {
		if mp == filepath.Clean(dir) {
			return true
		}
	}
	return false
}
