package native

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

// OpaqueXattr is the attribute overlayfs marks opaque directories with in a
// native sandbox's upper layer: the overlay is mounted inside the sandbox's
// user namespace with userxattr, so it uses the user.* namespace rather
// than trusted.* (which needs CAP_SYS_ADMIN in the initial namespace).
const OpaqueXattr = "user.overlay.opaque"

// Changes implements runtime.ChangeExporter. The sandbox must be stopped.
// The init's own writes at start (/etc/hostname, the hostname's line in
// /etc/hosts) are taken out first: they are not the sandbox's changes.
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
	if !hostfs.IsMountPoint(i.exportDir()) {
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
	if hostfs.IsMountPoint(i.rwDir()) {
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
		// Read-write at first, private to this process (detached), to
		// take the runtime's own writes out; then read-only.
		fd, err := fsmountImage(i.diskImage(), attrs&^unix.MOUNT_ATTR_RDONLY)
		if err != nil {
			return err
		}
		if err := i.revertHostFiles(fd); err != nil {
			i.rt.log.Warn("could not take the runtime's host files out of a sandbox's changes", "id", i.spec.ID, "err", err)
		}
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("make disk mount read-only: %w", err)
		}
		mfd = fd
	}
	return attachMount(mfd, i.exportDir())
}

// revertHostFiles takes the sandbox init's own start-up writes out of the
// upper layer on the disk mounted (detached, read-write) at mfd: every
// start writes /etc/hostname and /etc/resolv.conf and adds the hostname to
// /etc/hosts (nsinit.writeHostFiles, writeResolvConf), and those are not changes the sandbox's code
// made — a template built from its changes would otherwise carry the build
// sandbox's name. Only content exactly as the init writes it is taken out.
// Everything in upper/ was written by the sandbox, so nothing is resolved
// through a symlink and only single-link regular files are rewritten.
func (i *instance) revertHostFiles(mfd int) error {
	hostname := i.spec.Hostname
	if hostname == "" {
		hostname = i.spec.ID // as Start does
	}
	etc, err := openBeneath(mfd, "upper/etc", unix.O_DIRECTORY)
	if err != nil {
		return nil // no /etc in the changes (or not a plain directory)
	}
	defer unix.Close(etc)
	if b, ok := readSmall(etc, "hostname", 4096); ok && bytes.Equal(b, nsinit.HostnameFile(hostname)) {
		if err := unix.Unlinkat(etc, "hostname", 0); err != nil {
			return fmt.Errorf("remove etc/hostname: %w", err)
		}
	}
	// resolv.conf as the init writes it (writeResolvConf): the template's
	// own file shows again.
	if b, ok := readSmall(etc, "resolv.conf", 4096); ok && string(b) == hostnet.ResolvConf {
		if err := unix.Unlinkat(etc, "resolv.conf", 0); err != nil {
			return fmt.Errorf("remove etc/resolv.conf: %w", err)
		}
	}
	hosts, ok := readSmall(etc, "hosts", nsinit.MaxHostsFile+4096)
	if !ok {
		return nil
	}
	line := []byte(nsinit.HostnameLine(hostname))
	at := bytes.Index(hosts, line)
	if at < 0 {
		return nil
	}
	// What the init made of the template's file, if the template has one.
	var before []byte
	if name, err := rootfsName(i.spec.TemplateDigest); err == nil {
		if root, err := unix.Open(filepath.Join(i.rt.rootfsBase(), name), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
			if lowerEtc, err := openBeneath(root, "etc", unix.O_DIRECTORY); err == nil {
				before, _ = readSmall(lowerEtc, "hosts", nsinit.MaxHostsFile)
				unix.Close(lowerEtc)
			}
			unix.Close(root)
		}
	}
	if made, _ := nsinit.AddHostname(before, hostname); bytes.Equal(hosts, made) {
		if err := unix.Unlinkat(etc, "hosts", 0); err != nil {
			return fmt.Errorf("remove etc/hosts: %w", err)
		}
		return nil
	}
	// The sandbox changed the file too: keep its changes, drop the line.
	rest := append(append([]byte{}, hosts[:at]...), hosts[at+len(line):]...)
	fd, err := unix.Openat(etc, "hosts", unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("open etc/hosts: %w", err)
	}
	f := os.NewFile(uintptr(fd), "etc/hosts")
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink != 1 {
		return nil
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err = f.WriteAt(rest, 0)
	return err
}

// openBeneath opens path below dirfd without following any symlink or
// leaving the mount.
func openBeneath(dirfd int, path string, flags int) (int, error) {
	return unix.Openat2(dirfd, path, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
}

// readSmall reads name in dirfd when it is a regular file of at most max
// bytes.
func readSmall(dirfd int, name string, max int64) ([]byte, bool) {
	fd, err := openBeneath(dirfd, name, unix.O_NONBLOCK)
	if err != nil {
		return nil, false
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size > max {
		return nil, false
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil || int64(len(b)) > max {
		return nil, false
	}
	return b, true
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
	if err := hostfs.UnmountAll(dir); err != nil {
		return err
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
