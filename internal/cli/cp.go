package cli

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/sdk"
)

func newCpCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy files and directories between the host and a sandbox",
		Long: "Copy files and directories between the host and a sandbox. Exactly one side is ID:/path.\n" +
			"If DST is an existing directory SRC is copied into it; otherwise SRC is copied to the name DST.\n" +
			"`-` as SRC reads a tar archive from stdin and extracts it into the sandbox directory DST;\n" +
			"`-` as DST writes a tar archive of the sandbox path SRC to stdout.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, err := parseCpArg(args[0])
			if err != nil {
				return err
			}
			dst, err := parseCpArg(args[1])
			if err != nil {
				return err
			}
			switch {
			case src.remote() && dst.remote():
				return usagef("cp: copying between two sandboxes is not supported; copy through the host")
			case !src.remote() && !dst.remote():
				return usagef("cp: one of SRC and DST must be ID:/path")
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			if dst.remote() {
				return a.copyIn(c, src.path, dst)
			}
			return a.copyOut(c, src, dst.path)
		},
	}
}

// cpArg is one side of cp: a sandbox path (sandbox != "") or a local one.
type cpArg struct {
	sandbox string
	path    string
}

func (c cpArg) remote() bool { return c.sandbox != "" }

// parseCpArg: "ID:/abs/path" is remote when ID has no slash; anything else
// (./a:b, /tmp/x, -) is local.
func parseCpArg(s string) (cpArg, error) {
	if s == "" {
		return cpArg{}, usagef("cp: empty path")
	}
	id, p, ok := strings.Cut(s, ":")
	if !ok || id == "" || strings.Contains(id, "/") {
		return cpArg{path: s}, nil
	}
	if !strings.HasPrefix(p, "/") {
		return cpArg{}, usagef("cp: %q: the sandbox path must be absolute (ID:/path); write ./%s for a local file", s, s)
	}
	return cpArg{sandbox: id, path: path.Clean(p)}, nil
}

// copyIn copies a local file/dir (or a tar on stdin) into the sandbox.
func (a *app) copyIn(c *sdk.Client, local string, dst cpArg) error {
	if local == "-" {
		return c.UploadTar(a.ctx, dst.sandbox, dst.path, a.in)
	}
	fi, err := os.Lstat(local)
	if err != nil {
		return err
	}
	dir, name := dst.path, filepath.Base(filepath.Clean(local))
	st, err := c.StatFile(a.ctx, dst.sandbox, dst.path)
	switch {
	case err == nil && st.Type == "dir":
		// copy into the directory under the source's name
	case err == nil && fi.IsDir():
		return fmt.Errorf("cp: cannot copy directory %s onto non-directory %s:%s: %w", local, dst.sandbox, dst.path, sdk.ErrConflict)
	case err == nil, errors.Is(err, sdk.ErrNotFound):
		dir, name = path.Dir(dst.path), path.Base(dst.path)
	default:
		return err
	}
	if name == "/" || name == "." || name == ".." {
		return usagef("cp: cannot copy to %s:%s", dst.sandbox, dst.path)
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(pw, local, name, false)) }()
	err = c.UploadTar(a.ctx, dst.sandbox, dir, pr)
	pr.CloseWithError(err) // unblocks the writer if the upload stopped early
	return err
}

// copyOut copies a sandbox path to a local path (or stdout as a tar). The
// server's archive of a directory holds the entries below it (relative
// names); of a file, one entry named by its base name.
func (a *app) copyOut(c *sdk.Client, src cpArg, local string) error {
	st, err := c.StatFile(a.ctx, src.sandbox, src.path)
	if err != nil {
		return err
	}
	rc, err := c.DownloadTar(a.ctx, src.sandbox, src.path)
	if err != nil {
		return err
	}
	defer rc.Close()
	if local == "-" {
		_, err := io.Copy(a.out, rc)
		return err
	}
	// Like cp: into an existing directory under the source's name,
	// otherwise to the name given.
	dir, name := local, path.Base(src.path)
	if fi, err := os.Stat(local); err != nil || !fi.IsDir() {
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		dir, name = filepath.Dir(local), filepath.Base(local)
	}
	if name == "/" || name == "." || name == ".." {
		return usagef("cp: cannot copy %s:%s to %s", src.sandbox, src.path, local)
	}
	return extractTar(rc, dir, name, st.Type != "dir")
}

// writeTar archives the file or directory src with its root entry named
// root (the empty root means the directory's contents at the top, as a
// template rootfs). keepOwner keeps numeric uid/gid (a rootfs); otherwise
// entries belong to 0:0 so the sandbox user owns them.
func writeTar(w io.Writer, src, root string, keepOwner bool) error {
	tw := tar.NewWriter(w)
	src = filepath.Clean(src)
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		name := path.Join(root, filepath.ToSlash(rel))
		if name == "." || name == "" {
			return nil // the root directory itself, when root is empty
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		var link string
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		hdr.Name = name
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		if !keepOwner {
			hdr.Uid, hdr.Gid = 0, 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeReg {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// extractTar unpacks a tar from a sandbox into dir/name. For a directory
// the archive's entries are placed below name; for a single file
// (single) the archive must hold exactly one entry, which becomes name.
//
// The archive is hostile input: every operation goes through an os.Root, so
// no entry (including one that travels through a symlink the archive itself
// created) can land outside dir. Only files, directories, symlinks and hard
// links are created; permission bits are kept without setuid, setgid or
// sticky; ownership is not kept.
func extractTar(r io.Reader, dir, name string, single bool) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	mapName := func(n string) (string, error) {
		clean := path.Clean(strings.TrimPrefix(n, "./"))
		if path.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") {
			return "", fmt.Errorf("cp: archive entry %q escapes the destination", n)
		}
		if single {
			return name, nil
		}
		return path.Join(name, clean), nil
	}
	if !single {
		if err := root.MkdirAll(name, 0o755); err != nil {
			return err
		}
	}
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if err == io.EOF {
			if single && n != 1 {
				return fmt.Errorf("cp: archive of a file has %d entries, want 1", n)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("cp: reading archive: %w", err)
		}
		if single && n > 0 {
			return fmt.Errorf("cp: archive of a file has more than one entry")
		}
		target, err := mapName(hdr.Name)
		if err != nil {
			return err
		}
		perm := fs.FileMode(hdr.Mode).Perm()
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(target, 0o755); err != nil {
				return err
			}
			if err := root.Chmod(target, perm|0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := replaceable(root, target); err != nil {
				return err
			}
			f, err := root.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("cp: writing %s: %w", target, err)
			}
			_ = root.Chtimes(target, hdr.ModTime, hdr.ModTime)
		case tar.TypeSymlink:
			if err := replaceable(root, target); err != nil {
				return err
			}
			if err := root.Symlink(hdr.Linkname, target); err != nil {
				return err
			}
		case tar.TypeLink:
			if single {
				return fmt.Errorf("cp: archive of a file holds a hard link")
			}
			old, err := mapName(hdr.Linkname)
			if err != nil {
				return err
			}
			if err := replaceable(root, target); err != nil {
				return err
			}
			if err := root.Link(old, target); err != nil {
				return err
			}
		default:
			// Devices, fifos and the like are never recreated on the host.
			continue
		}
	}
}

// replaceable removes a non-directory at name so a new entry never writes
// through an existing symlink or file.
func replaceable(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return err
	case fi.IsDir():
		return fmt.Errorf("cp: %s: is a directory", name)
	}
	return root.Remove(name)
}
