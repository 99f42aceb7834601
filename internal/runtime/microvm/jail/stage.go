package jail

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Main is the jail stage, the whole of the space-jail binary, which Start
// starts: it never returns: it execs QEMU or exits with status 125 after
// telling Start why.
func Main() {
	// no_new_privs, the capability sets and exec are per thread: one
	// thread does all of it.
	runtime.LockOSThread()
	fd, err := strconv.Atoi(os.Getenv(EnvFD))
	if err != nil || fd < 3 {
		fmt.Fprintf(os.Stderr, "space-jail: bad %s=%q (space-jail is started by the microvm runtime, not by hand)\n", EnvFD, os.Getenv(EnvFD))
		os.Exit(125)
	}
	ctl := os.NewFile(uintptr(fd), "jail-control")
	err = stage(ctl)
	// stage returns only on failure.
	fmt.Fprintf(ctl, "jail: %v\n", err)
	os.Exit(125)
}

func stage(ctl *os.File) error {
	// Blocks until the host has moved this process into its cgroup and
	// sent the plan.
	b, err := io.ReadAll(io.LimitReader(ctl, 1<<20))
	if err != nil {
		return fmt.Errorf("reading the plan: %w", err)
	}
	var p plan
	if err := json.Unmarshal(b, &p); err != nil {
		return fmt.Errorf("decoding the plan: %w", err)
	}
	if len(p.Argv) == 0 || p.UID == 0 || p.GID == 0 {
		return errors.New("plan without program or with uid/gid 0")
	}
	unix.Umask(0)
	capLast = lastCap()
	if err := buildRoot(&p); err != nil {
		return err
	}
	// What QEMU creates (its sockets, the console log) is its own: a
	// world-connectable agent socket would let any host user into the
	// sandbox.
	unix.Umask(0o077)
	if err := unix.Sethostname([]byte(Hostname)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	// No core dumps: they would hold the guest's memory.
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return fmt.Errorf("rlimit core: %w", err)
	}
	if _, err := unix.FcntlInt(ctl.Fd(), unix.F_SETFD, unix.FD_CLOEXEC); err != nil {
		return fmt.Errorf("control socket close-on-exec: %w", err)
	}
	if err := dropPrivileges(p.UID, p.GID); err != nil {
		return err
	}
	err = unix.Exec(p.Argv[0], p.Argv, []string{})
	return fmt.Errorf("exec %s in the jail: %w", p.Argv[0], err)
}

// stagingDir is where the new root is mounted before pivot_root, in this
// mount namespace only. Everything the binds need was opened before it is
// covered, so a bind from under /tmp works.
const stagingDir = "/tmp"

// buildRoot makes the jail's root and pivots into it.
func buildRoot(p *plan) error {
	// Nothing that follows may reach the host's mount table.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	// Detached copies of every bind, made while the host's tree is in
	// view, flagged before they are attached.
	srcs := make([]int, len(p.Binds))
	for i, b := range p.Binds {
		fd, err := unix.OpenTree(unix.AT_FDCWD, b.Path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_SYMLINK_NOFOLLOW)
		if err != nil {
			return fmt.Errorf("bind %s: open_tree: %w", b.Path, err)
		}
		srcs[i] = fd
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return fmt.Errorf("bind %s: %w", b.Path, err)
		}
		if isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR; isDir != b.Dir {
			return fmt.Errorf("bind %s: changed type since the host looked", b.Path)
		}
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
		if b.Writable {
			attr.Attr_set |= unix.MOUNT_ATTR_NOEXEC
		} else {
			attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
		}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			return fmt.Errorf("bind %s: mount_setattr: %w", b.Path, err)
		}
	}
	// The root: a tmpfs only this process sees, holding directories,
	// links and device nodes (so not nodev).
	if err := unix.Mount("tmpfs", stagingDir, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=0755,size=1m,nr_inodes=4096"); err != nil {
		return fmt.Errorf("mount the jail's root: %w", err)
	}
	root, err := unix.Open(stagingDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the jail's root: %w", err)
	}
	defer unix.Close(root)
	for i, b := range p.Binds {
		if err := attach(root, srcs[i], b); err != nil {
			return fmt.Errorf("bind %s: %w", b.Path, err)
		}
		unix.Close(srcs[i])
	}
	for _, l := range p.Links {
		dir, err := mkdirAllAt(root, filepath.Dir(l.Path))
		if err != nil {
			return fmt.Errorf("link %s: %w", l.Path, err)
		}
		err = unix.Symlinkat(l.Target, dir, filepath.Base(l.Path))
		unix.Close(dir)
		// Inside a bind the link is there already (it is the host's).
		if err != nil && !errors.Is(err, unix.EEXIST) && !errors.Is(err, unix.EROFS) {
			return fmt.Errorf("link %s: %w", l.Path, err)
		}
	}
	for _, d := range p.Devices {
		if err := makeDevice(root, d, p.UID, p.GID); err != nil {
			return fmt.Errorf("device %s: %w", d.Path, err)
		}
	}
	if err := unix.Fchdir(root); err != nil {
		return fmt.Errorf("chdir to the jail's root: %w", err)
	}
	// pivot_root(".", ".") stacks the old root on the new one; detaching
	// it leaves only the new root (runc's way, no put_old directory).
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host's root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("make the jail's root read-only: %w", err)
	}
	return nil
}

// resolveHow opens one component at a time below the jail's root and
// never follows a symlink: a writable bind's contents belong to QEMU (of
// an earlier run) and must not redirect a mount.
func resolveHow(flags uint64) *unix.OpenHow {
	return &unix.OpenHow{Flags: flags | unix.O_CLOEXEC | unix.O_NOFOLLOW, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS}
}

// mkdirAllAt makes the directories of abs below root and returns the last.
func mkdirAllAt(root int, abs string) (int, error) {
	dir, err := unix.Dup(root)
	if err != nil {
		return -1, err
	}
	for _, c := range strings.Split(strings.Trim(abs, "/"), "/") {
		if c == "" {
			continue
		}
		next, err := unix.Openat2(dir, c, resolveHow(unix.O_PATH|unix.O_DIRECTORY))
		if errors.Is(err, unix.ENOENT) {
			if err = unix.Mkdirat(dir, c, 0o755); err == nil || errors.Is(err, unix.EEXIST) {
				next, err = unix.Openat2(dir, c, resolveHow(unix.O_PATH|unix.O_DIRECTORY))
			}
		}
		unix.Close(dir)
		if err != nil {
			return -1, fmt.Errorf("directory %s of %s: %w", c, abs, err)
		}
		dir = next
	}
	return dir, nil
}

// attach mounts the detached bind src at b.Path below root.
func attach(root, src int, b bind) error {
	dir, err := mkdirAllAt(root, filepath.Dir(b.Path))
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	name := filepath.Base(b.Path)
	if b.Dir {
		err = unix.Mkdirat(dir, name, 0o755)
	} else {
		var fd int
		fd, err = unix.Openat2(dir, name, &unix.OpenHow{Flags: unix.O_CREAT | unix.O_EXCL | unix.O_WRONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW, Mode: 0o444, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS})
		if err == nil {
			unix.Close(fd)
		}
	}
	// Inside an earlier bind the mount point exists already (it is the
	// same host path).
	if err != nil && !errors.Is(err, unix.EEXIST) && !errors.Is(err, unix.EROFS) {
		return fmt.Errorf("mount point: %w", err)
	}
	target, err := unix.Openat2(dir, name, resolveHow(unix.O_PATH))
	if err != nil {
		return fmt.Errorf("mount point: %w", err)
	}
	defer unix.Close(target)
	if err := unix.MoveMount(src, "", target, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return fmt.Errorf("move_mount: %w", err)
	}
	return nil
}

// makeDevice makes a node in the jail's /dev (never the host's: the nodes
// are the jail's own, so their owner can be the jail's uid).
func makeDevice(root int, d devNode, uid, gid uint32) error {
	dir, err := mkdirAllAt(root, filepath.Dir(d.Path))
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	name := filepath.Base(d.Path)
	if err := unix.Mknodat(dir, name, unix.S_IFCHR|d.Mode, int(d.Rdev)); err != nil {
		return fmt.Errorf("mknod: %w", err)
	}
	if d.Own {
		if err := unix.Fchownat(dir, name, int(uid), int(gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("chown: %w", err)
		}
	}
	return nil
}

// lastCap is the highest capability this kernel knows (read before the
// host's /proc is gone from view).
func lastCap() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 63
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 63
	}
	return n
}

// capLast is lastCap(), read by the stage while /proc is in view.
var capLast = 63

// dropPrivileges leaves this thread (the one that execs QEMU) with the
// jail's uid and gid, no groups, no capabilities in any set, and
// no_new_privs. setgroups/setresgid/setresuid apply to every thread (Go
// runs them on all); the rest is per thread.
func dropPrivileges(uid, gid uint32) error {
	for c := 0; c <= capLast; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(int(gid), int(gid), int(gid)); err != nil {
		return fmt.Errorf("setresgid %d: %w", gid, err)
	}
	// Leaving uid 0 (without keep-caps) clears the effective and
	// permitted sets.
	if err := syscall.Setresuid(int(uid), int(uid), int(uid)); err != nil {
		return fmt.Errorf("setresuid %d: %w", uid, err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}
