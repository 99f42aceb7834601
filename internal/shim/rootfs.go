package shim

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/containerd/api/types"
	"golang.org/x/sys/unix"
)

// mountRootfs mounts containerd's rootfs mounts (from the snapshotter:
// overlay, or a bind for a view) on target, in order.
func mountRootfs(mounts []*types.Mount, target string) error {
	if len(mounts) == 0 {
		return fmt.Errorf("no rootfs mounts: the space runtime copies the image from containerd's snapshot and needs one")
	}
	if err := os.MkdirAll(target, 0o711); err != nil {
		return err
	}
	for i, m := range mounts {
		flags, data := mountOptions(m.GetOptions())
		typ := m.GetType()
		if flags&unix.MS_BIND != 0 {
			typ = ""
		}
		if err := unix.Mount(m.GetSource(), target, typ, flags&^unix.MS_RDONLY, data); err != nil {
			unmountAll(target)
			return fmt.Errorf("mount rootfs %d (%s %s): %w", i, m.GetType(), m.GetSource(), err)
		}
		if flags&unix.MS_BIND != 0 && flags&unix.MS_RDONLY != 0 {
			// A read-only bind needs a remount to take the flag.
			if err := unix.Mount("", target, "", flags|unix.MS_REMOUNT, ""); err != nil {
				unmountAll(target)
				return fmt.Errorf("remount rootfs read-only: %w", err)
			}
		}
	}
	return nil
}

// mountOptions splits fstab-style options into flags and filesystem data.
func mountOptions(opts []string) (uintptr, string) {
	known := map[string]uintptr{
		"ro": unix.MS_RDONLY, "bind": unix.MS_BIND, "rbind": unix.MS_BIND | unix.MS_REC,
		"nosuid": unix.MS_NOSUID, "nodev": unix.MS_NODEV, "noexec": unix.MS_NOEXEC,
		"noatime": unix.MS_NOATIME, "relatime": unix.MS_RELATIME,
	}
	var flags uintptr
	var data []string
	for _, o := range opts {
		switch f, ok := known[o]; {
		case ok:
			flags |= f
		case o == "rw", o == "defaults":
		default:
			data = append(data, o)
		}
	}
	return flags, strings.Join(data, ",")
}

// unmountAll unmounts target until nothing is mounted there (a bind over
// an overlay, say); errors other than "not mounted" are returned.
func unmountAll(target string) error {
	for i := 0; i < 16; i++ {
		err := unix.Unmount(target, unix.MNT_DETACH)
		switch {
		case err == nil:
			continue
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			return nil
		default:
			return fmt.Errorf("unmount %s: %w", target, err)
		}
	}
	return nil
}

// writeTree writes the tree at root as a tar stream: directories,
// regular files (hard links as copies), symlinks; devices, sockets and
// FIFOs are left out (the sandbox's agent refuses them, and the sandbox
// has its own /dev). Ownership is carried in the headers, but the agent
// extracts as the sandbox's root.
func writeTree(w io.Writer, root string) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		case fi.IsDir(), fi.Mode().IsRegular():
		default:
			return nil
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.CopyN(tw, f, hdr.Size)
			f.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", rel, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}
