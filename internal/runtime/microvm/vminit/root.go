package vminit

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
)

// AgentPath is where the sandbox sees the agent binary: the initramfs's
// /init, bound read-only (after the switch the initramfs is out of reach).
const AgentPath = "/run/space/space-agent"

// Where PID 1 builds the new root in the initramfs.
const (
	lowerDir = "/mnt/root"  // the erofs template image
	diskDir  = "/mnt/disk"  // the ext4 disk: upper/, work/
	newRoot  = "/mnt/guest" // the overlay, then /
)

// diskWait bounds the wait for the disks' serials once a virtio-blk disk
// exists (virtio_blk probes as it loads; this only covers a slow device).
const diskWait = 10 * time.Second

// findDisks returns the device nodes of the root image and the writable
// disk, found by serial. No virtio-blk device at all is the boot-only mode
// (both ""); one without the other is an error.
func findDisks(wait time.Duration) (root, disk string, err error) {
	deadline := time.Now().Add(wait)
	for {
		ents, _ := filepath.Glob("/sys/block/vd*")
		if len(ents) == 0 {
			return "", "", nil
		}
		root, disk = "", ""
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join(e, "serial"))
			if err != nil {
				continue
			}
			dev := filepath.Join("/dev", filepath.Base(e))
			if _, err := os.Stat(dev); err != nil {
				continue
			}
			switch strings.TrimSpace(string(b)) {
			case RootSerial:
				root = dev
			case DiskSerial:
				disk = dev
			}
		}
		if root != "" && disk != "" {
			return root, disk, nil
		}
		if time.Now().After(deadline) {
			return "", "", fmt.Errorf("disks with serials %q and %q not both found after %v (block devices: %d, root %q, disk %q)",
				RootSerial, DiskSerial, wait, len(ents), root, disk)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// diskFD is an O_PATH descriptor of the disk's mount point, -1 until
// mountRoot opened it.
var diskFD = -1

// diskUsed is what the sandbox's writable disk holds, as df counts it.
func diskUsed() (int64, error) {
	if diskFD < 0 {
		return 0, nil
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(diskFD, &st); err != nil {
		return 0, err
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, nil
}

// mountRoot mounts the template image read-only and the disk, and joins
// them with overlayfs at newRoot. nodev everywhere: the sandbox's device
// nodes are the ones PID 1 gives it in /dev.
func mountRoot(rootDev, diskDev string) error {
	for _, d := range []string{lowerDir, diskDir, newRoot} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
	}
	if err := unix.Mount(rootDev, lowerDir, "erofs", unix.MS_RDONLY|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount the root image %s (erofs): %w", rootDev, err)
	}
	// discard: what the sandbox deletes is given back to the host (QEMU
	// punches holes in the sparse disk file, discard=unmap), so a disk
	// file is as large as what the sandbox keeps, and so are its copies
	// for forks and warm starts.
	if err := unix.Mount(diskDev, diskDir, "ext4", unix.MS_NODEV|unix.MS_NOSUID, "discard"); err != nil {
		return fmt.Errorf("mount the disk %s (ext4): %w", diskDev, err)
	}
	// Kept for Stats: after the switch of root the disk's mount point is
	// out of PID 1's reach by path.
	fd, err := unix.Open(diskDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the disk's mount point: %w", err)
	}
	diskFD = fd
	// The disk's top level is PID 1's: the sandbox only ever sees upper/.
	for _, d := range []string{"upper", "work"} {
		p := filepath.Join(diskDir, d)
		if err := realDir(p, 0o755, confine.IDBase); err != nil {
			return fmt.Errorf("disk: %w", err)
		}
	}
	opts := "lowerdir=" + lowerDir + ",upperdir=" + diskDir + "/upper,workdir=" + diskDir + "/work"
	if err := unix.Mount("overlay", newRoot, "overlay", unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount the root overlay: %w", err)
	}
	return nil
}

// realDir makes p a directory (not a symlink to one) owned by uid/gid id
// when it has to create it. Before the switch an absolute symlink in the
// sandbox's tree would resolve in the initramfs, so whatever else is at p
// is removed. The sandbox runs nothing yet, so nothing races this.
func realDir(p string, mode os.FileMode, id int) error {
	fi, err := os.Lstat(p)
	if err == nil && fi.IsDir() {
		return nil
	}
	if err == nil {
		if err := os.Remove(p); err != nil {
			return fmt.Errorf("replace %s (%v) by a directory: %w", p, fi.Mode().Type(), err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := os.Mkdir(p, mode); err != nil {
		return err
	}
	if err := os.Lchown(p, id, id); err != nil {
		return err
	}
	return os.Chmod(p, mode)
}

// prepareRoot puts into newRoot what the sandbox sees besides its tree:
// the agent binary, the kernel filesystems (moved from the initramfs) and
// cgroup2.
func prepareRoot() error {
	in := func(p string) string { return filepath.Join(newRoot, p) }
	// Mount points: required.
	for _, d := range []string{"proc", "sys", "dev", "run", "run/space"} {
		if err := realDir(in(d), 0o755, confine.IDBase); err != nil {
			return fmt.Errorf("new root: %w", err)
		}
	}
	// What a tree needs and a sandbox may have broken (or filled the disk
	// so that it cannot be mended): its own business past a console line.
	for _, d := range []string{"etc", "tmp"} {
		mode := os.FileMode(0o755)
		if d == "tmp" {
			mode = 0o777 | os.ModeSticky
		}
		if err := realDir(in(d), mode, confine.IDBase); err != nil {
			fmt.Fprintln(os.Stderr, "space-agent: vm init: new root:", err)
		}
	}
	if err := mountTmp(in("tmp")); err != nil {
		return err
	}
	// The agent binary, in a read-only tmpfs of its own so that nothing
	// can be added next to it.
	space := in("run/space")
	if err := unix.Mount("tmpfs", space, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=64k,mode=0755"); err != nil {
		return fmt.Errorf("tmpfs on %s: %w", AgentPath, err)
	}
	agent := in(AgentPath)
	if err := os.WriteFile(agent, nil, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("/init", agent, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind the agent at %s: %w", AgentPath, err)
	}
	if err := unix.Mount("", agent, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("agent binary read-only: %w", err)
	}
	if err := unix.Mount("", space, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "size=64k,mode=0755"); err != nil {
		return fmt.Errorf("%s read-only: %w", filepath.Dir(AgentPath), err)
	}
	for _, d := range []string{"/proc", "/sys", "/dev"} {
		if err := unix.Mount(d, in(d), "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the new root: %w", d, err)
		}
	}
	// /sys read-only: PID 1 only reads it; the sandbox writes nothing
	// there. cgroup2 below it stays writable for PID 1 (its files are
	// guest root's, out of the sandbox's reach).
	if err := unix.Mount("", in("sys"), "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("/sys read-only: %w", err)
	}
	if err := unix.Mount("cgroup2", in("sys/fs/cgroup"), "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount cgroup2: %w", err)
	}
	return nil
}

// mountTmp mounts a tmpfs on the tree's /tmp when the tree leaves it
// empty, as gVisor does: /tmp is memory — it goes with a snapshot and not
// with a stop, as in the gvisor runtime — and its pages are charged to the
// sandbox cgroup of whoever writes them, so memory.max bounds it.
func mountTmp(dir string) error {
	// Not a real directory (a sandbox's symlink realDir could not mend
	// would resolve in the initramfs now): nothing to cover.
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
		return nil
	}
	f, err := os.Open(dir)
	if err != nil {
		return nil
	}
	names, _ := f.Readdirnames(1)
	f.Close()
	if len(names) > 0 {
		return nil
	}
	opts := fmt.Sprintf("mode=1777,uid=%d,gid=%d", confine.IDBase, confine.IDBase)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("tmpfs on /tmp: %w", err)
	}
	return nil
}

// switchRoot makes newRoot the root of PID 1, as busybox's switch_root:
// move it onto / and chroot into it. The initramfs stays underneath,
// unreachable.
func switchRoot() error {
	if err := unix.Chdir(newRoot); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the new root onto /: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	return unix.Chdir("/")
}

// maxHostsFile bounds the /etc/hosts PID 1 reads back: the file is the
// sandbox's to write.
const maxHostsFile = 1 << 20

// setHostname sets the kernel's hostname and writes it to /etc/hostname
// and as the 127.0.1.1 line of /etc/hosts (as Debian's installer does), so
// that the name resolves. Both files are the sandbox's: they are opened
// beneath / without crossing a mount or following a magic link, must be
// regular files, and are written owned by sandbox root.
//
// Only the kernel's hostname is required. The files are the sandbox's,
// and it can make writing them fail (a full disk, an /etc that is not a
// directory): that is said on the console and otherwise left to it, so
// that a sandbox cannot make its own guest unbootable or unrestorable.
func setHostname(name string) error {
	if !hostnameRE.MatchString(name) {
		return fmt.Errorf("hostname %q: not one RFC 1123 label", name)
	}
	if err := unix.Sethostname([]byte(name)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	if err := writeHostnameFiles(name); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: vm init: hostname files not updated:", err)
	}
	return nil
}

func writeHostnameFiles(name string) error {
	if err := writeSandboxFile("/etc/hostname", []byte(name+"\n")); err != nil {
		return err
	}
	// Whatever stands at /etc/hosts that is not a readable regular file
	// (a FIFO, a symlink out of the root, a huge file) is replaced.
	old, _ := readSandboxFile("/etc/hosts", maxHostsFile)
	return writeSandboxFile("/etc/hosts", hostsWithName(old, name))
}

// defaultHosts is /etc/hosts when the sandbox has none.
const defaultHosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"

// hostsWithName returns hosts with its 127.0.1.1 lines replaced by one
// for name.
func hostsWithName(hosts []byte, name string) []byte {
	if len(bytes.TrimSpace(hosts)) == 0 {
		hosts = []byte(defaultHosts)
	}
	var out bytes.Buffer
	for _, line := range strings.SplitAfter(string(hosts), "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[0] == "127.0.1.1" {
			continue
		}
		out.WriteString(line)
	}
	if out.Len() > 0 && !bytes.HasSuffix(out.Bytes(), []byte("\n")) {
		out.WriteByte('\n')
	}
	fmt.Fprintf(&out, "127.0.1.1\t%s\n", name)
	return out.Bytes()
}

// openSandbox opens path of the sandbox's root safely for PID 1: resolved
// beneath / (symlinks stay inside), not across a mount point (not into
// /proc, /sys, /dev or the agent's directory), no magic links, and not
// blocking on a FIFO. Only regular files are returned.
func openSandbox(path string, flags int, mode uint32) (*os.File, error) {
	return openSandboxResolve(path, flags, mode, 0)
}

// openSandboxResolve is openSandbox with more RESOLVE_ flags.
func openSandboxResolve(path string, flags int, mode uint32, resolve uint64) (*os.File, error) {
	root, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, strings.TrimPrefix(path, "/"), &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC | unix.O_NONBLOCK | unix.O_NOCTTY),
		Mode:    uint64(mode),
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_MAGICLINKS | resolve,
	})
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file (%v)", path, fi.Mode().Type())
	}
	return f, nil
}

func readSandboxFile(path string, limit int64) ([]byte, error) {
	f, err := openSandbox(path, unix.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return b, nil
}

// writeSandboxFile replaces the contents of path (owned by sandbox root,
// mode 0644). A non-regular file there is removed first.
func writeSandboxFile(path string, data []byte) error {
	return writeSandboxFileResolve(path, data, 0)
}

// writeSandboxFileResolve is writeSandboxFile with more RESOLVE_ flags
// (RESOLVE_NO_SYMLINKS: a symlink at path is replaced, one on the way to
// it fails the write).
func writeSandboxFileResolve(path string, data []byte, resolve uint64) error {
	f, err := openSandboxResolve(path, unix.O_WRONLY|unix.O_CREAT, 0o644, resolve)
	if err != nil {
		// Not a regular file (a FIFO, a directory, a symlink across a
		// mount or dangling): replace it. Only the last component is
		// removed, in its directory resolved as openSandbox does.
		if rmErr := removeSandboxEntry(path); rmErr != nil {
			return fmt.Errorf("%v; replacing it: %w", err, rmErr)
		}
		f, err = openSandboxResolve(path, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL, 0o644, resolve)
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(0); err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := f.Chown(confine.IDBase, confine.IDBase); err != nil {
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		return err
	}
	return f.Close()
}

// removeSandboxEntry removes the last component of path (a symlink, a
// FIFO, an empty directory) within its directory, resolved as openSandbox
// does.
func removeSandboxEntry(path string) error {
	root, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(root)
	dir, name := filepath.Split(strings.TrimPrefix(path, "/"))
	if dir == "" {
		dir = "."
	}
	dfd, err := unix.Openat2(root, dir, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	if err := unix.Unlinkat(dfd, name, 0); err == nil || !errors.Is(err, unix.EISDIR) {
		return err
	}
	return unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR)
}
