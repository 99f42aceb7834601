package nsinit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
)

// Devices bind-mounted from the host into the sandbox's /dev. A user
// namespace cannot mknod, and binding the host's nodes is how rootless
// containers provide them.
var devices = []string{"null", "zero", "full", "random", "urandom", "tty"}

// fdPath names a descriptor the host passed.
func fdPath(fd int) string { return fmt.Sprintf("/proc/self/fd/%d", fd) }

// mountOverlay builds the overlay from the host's layer descriptors with
// the new mount API, attaches it at FDRoot and makes it the working
// directory. Everything after works relative to ".", because the path the
// overlay is attached at may not be resolvable by this process.
func mountOverlay() error {
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fsfd)
	steps := []struct {
		key, val string
	}{
		{"source", "overlay"},
		{"lowerdir", fdPath(FDLower)},
		{"upperdir", fdPath(FDUpper)},
		{"workdir", fdPath(FDWork)},
	}
	for _, st := range steps {
		if err := unix.FsconfigSetString(fsfd, st.key, st.val); err != nil {
			return fmt.Errorf("overlay %s: %w%s", st.key, err, fsLog(fsfd))
		}
	}
	// Overlay xattrs in the user.* namespace: a user namespace cannot
	// write trusted.*.
	if err := unix.FsconfigSetFlag(fsfd, "userxattr"); err != nil {
		return fmt.Errorf("overlay userxattr: %w%s", err, fsLog(fsfd))
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("create overlay: %w%s", err, fsLog(fsfd))
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fmt.Errorf("fsmount overlay: %w", err)
	}
	defer unix.Close(mfd)
	// pivot_root needs the new root attached to this namespace's tree.
	if err := unix.MoveMount(mfd, "", FDRoot, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach overlay: %w", err)
	}
	if err := unix.Fchdir(mfd); err != nil {
		return fmt.Errorf("enter overlay: %w", err)
	}
	return nil
}

// fsLog drains the kernel's messages about a failed fsconfig.
func fsLog(fsfd int) string {
	var b strings.Builder
	buf := make([]byte, 256)
	for i := 0; i < 8; i++ {
		n, err := unix.Read(fsfd, buf)
		if err != nil || n <= 0 {
			break
		}
		b.WriteString("; ")
		b.Write(buf[:n])
	}
	return b.String()
}

// buildRoot assembles the sandbox's root: overlay, /proc, /dev, /sys,
// masks. It leaves the working directory at the new root.
func buildRoot() error {
	// Nothing we mount may propagate back to the host, and pivot_root needs
	// a non-shared old root.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := mountOverlay(); err != nil {
		return err
	}
	in := func(p string) string { return "." + p }

	if err := mountAt("proc", in("/proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := buildDev(in("/dev")); err != nil {
		return err
	}
	// sysfs can be mounted because the sandbox owns its network namespace;
	// it shows only the sandbox's loopback and is read-only. Where the kernel
	// refuses (sysfs not fully visible to us), an empty read-only tmpfs keeps
	// /sys present but bare.
	sysFlags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_RDONLY)
	if err := mountAt("sysfs", in("/sys"), "sysfs", sysFlags, ""); err != nil {
		if err := mountAt("tmpfs", in("/sys"), "tmpfs", sysFlags, "size=0,mode=555"); err != nil {
			return err
		}
	}
	for _, p := range confine.MaskedPaths {
		if err := confine.Mask(in(p)); err != nil {
			return err
		}
	}
	for _, p := range confine.ReadonlyPaths {
		if err := bindReadonly(in(p)); err != nil {
			return err
		}
	}
	return nil
}

func mountAt(source, target, fstype string, flags uintptr, data string) error {
	if err := ensureDir(target); err != nil {
		return err
	}
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", fstype, target, err)
	}
	return nil
}

// ensureDir makes path a real directory. The writable layer survives stop
// and start, so code in the sandbox may have left a symlink at /proc or /dev
// pointing at a host path; mounting through it must never happen.
func ensureDir(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case err == nil && fi.IsDir():
		return nil
	case err == nil:
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("replace non-directory %s: %w", path, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return err
	}
	if err := os.Mkdir(path, 0o755); err != nil {
		return fmt.Errorf("mkdir %s: %w", path, err)
	}
	return nil
}

// buildDev makes a minimal /dev: a small tmpfs, host device nodes bound in,
// a private devpts instance, /dev/shm and the usual symlinks.
func buildDev(dev string) error {
	if err := mountAt("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=755,size=1m"); err != nil {
		return err
	}
	for _, name := range devices {
		target := filepath.Join(dev, name)
		if err := os.WriteFile(target, nil, 0o666); err != nil {
			return err
		}
		if err := unix.Mount("/dev/"+name, target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", name, err)
		}
	}
	if err := mountAt("devpts", filepath.Join(dev, "pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC,
		"newinstance,ptmxmode=0666,mode=0620,gid=5"); err != nil {
		return err
	}
	if err := mountAt("shm", filepath.Join(dev, "shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size=65536k"); err != nil {
		return err
	}
	// POSIX message queues of the sandbox's own IPC namespace.
	if err := mountAt("mqueue", filepath.Join(dev, "mqueue"), "mqueue", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	links := [][2]string{
		{"pts/ptmx", "ptmx"},
		{"/proc/self/fd", "fd"},
		{"/proc/self/fd/0", "stdin"},
		{"/proc/self/fd/1", "stdout"},
		{"/proc/self/fd/2", "stderr"},
	}
	for _, l := range links {
		if err := os.Symlink(l[0], filepath.Join(dev, l[1])); err != nil {
			return err
		}
	}
	return nil
}

// bindReadonly turns path into a read-only view of itself. A remount in a
// user namespace must keep the flags the kernel locked on the original
// mount (nosuid, nodev, noexec), so they are read back and kept.
func bindReadonly(path string) error {
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := unix.Mount(path, path, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s: %w", path, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return err
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY)
	for _, f := range []struct{ st, ms int64 }{
		{unix.ST_NOSUID, unix.MS_NOSUID},
		{unix.ST_NODEV, unix.MS_NODEV},
		{unix.ST_NOEXEC, unix.MS_NOEXEC},
		{unix.ST_NOATIME, unix.MS_NOATIME},
		{unix.ST_NODIRATIME, unix.MS_NODIRATIME},
		{unix.ST_RELATIME, unix.MS_RELATIME},
	} {
		if st.Flags&f.st != 0 {
			flags |= uintptr(f.ms)
		}
	}
	if err := unix.Mount(path, path, "", flags, ""); err != nil {
		return fmt.Errorf("remount %s read-only: %w", path, err)
	}
	return nil
}

// pivotRoot makes the working directory the filesystem root and detaches
// the host's.
func pivotRoot() error {
	// pivot_root(".", ".") stacks the old root on top of the new one; the
	// lazy unmount then drops it without needing a directory for it.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	return unix.Chdir("/")
}
