package template

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// DeriveOptions describe a template made from a parent.
type DeriveOptions struct {
	Config api.TemplateConfig // the new template's defaults (not merged: the caller decides)
	Layer  api.TemplateLayer  // provenance appended to the parent's layers (Digest is filled in)
	Source string             // default "build"
	Tags   []string
	// MaxBytes bounds what Apply writes (content + 512 bytes per entry).
	MaxBytes int64
	// Apply changes a copy of the parent's tree. Nil keeps the tree.
	Apply func(ctx context.Context, t *Tree) error
}

// Tree is a template tree being derived. Its writes never leave it.
type Tree struct {
	st *stager
}

// Upper is a stopped sandbox's writable layer as an overlayfs upper
// directory (see runtime.Changes).
type Upper struct {
	Dir         string
	OpaqueXattr string
	IDBase      uint32
}

// Derive makes a template from parent. With o.Apply, parent's tree is
// cloned (hard links: unchanged files share storage with the parent; the
// stager never writes into an existing inode, it replaces it) and changed.
func (s *Store) Derive(ctx context.Context, parent string, o DeriveOptions) (api.Template, error) {
	p, err := s.Get(ctx, parent)
	if err != nil {
		return api.Template{}, fmt.Errorf("parent template: %w", err)
	}
	defer s.Hold(p.Digest)()
	if err := ValidateConfig(o.Config); err != nil {
		return api.Template{}, err
	}
	tags := make([]string, 0, len(o.Tags))
	for _, t := range o.Tags {
		norm, err := ParseTag(t)
		if err != nil {
			return api.Template{}, err
		}
		tags = append(tags, norm)
	}
	if o.Source == "" {
		o.Source = "build"
	}
	layers := append(append([]api.TemplateLayer{}, p.Layers...), o.Layer)
	rec := record{tree: p.TreeDigest, size: p.SizeBytes, source: o.Source, parent: p.Digest, config: o.Config, layers: layers}
	if o.Apply == nil {
		rec.layers[len(layers)-1].Digest = imageDigest(rec.tree, rec.config)
		return s.commit(ctx, "", rec, tags)
	}
	stage, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "derive-")
	if err != nil {
		return api.Template{}, fmt.Errorf("create staging dir: %w", err)
	}
	defer os.RemoveAll(stage)
	rootfs := filepath.Join(stage, "rootfs")
	if err := cloneTree(ctx, s.rootfsDir(p.TreeDigest), rootfs); err != nil {
		return api.Template{}, fmt.Errorf("clone parent tree: %w", err)
	}
	st, err := newStager(rootfs, o.MaxBytes, s.log)
	if err != nil {
		return api.Template{}, err
	}
	// Keep the root's metadata as cloned unless the change sets it.
	var rst unix.Stat_t
	if err := unix.Fstat(int(st.root.Fd()), &rst); err != nil {
		st.close()
		return api.Template{}, err
	}
	st.dirs[""] = meta{mode: rst.Mode & 0o7777, uid: int(rst.Uid), gid: int(rst.Gid),
		mtime: time.Unix(rst.Mtim.Unix()), atime: time.Unix(rst.Atim.Unix())}
	err = o.Apply(ctx, &Tree{st: st})
	if err == nil {
		err = st.finish()
	}
	st.close()
	if err != nil {
		return api.Template{}, err
	}
	if err := ctx.Err(); err != nil {
		return api.Template{}, err
	}
	parentDir := filepath.Dir(s.rootfsDir(p.TreeDigest))
	var sums map[string]string
	rec.tree, rec.size, sums, err = treeDigest(rootfs, &treeRef{root: s.rootfsDir(p.TreeDigest), sums: readSums(parentDir)})
	if err != nil {
		return api.Template{}, err
	}
	if err := writeSums(stage, sums); err != nil {
		return api.Template{}, err
	}
	rec.layers[len(layers)-1].Digest = imageDigest(rec.tree, rec.config)
	if rec.tree == p.TreeDigest {
		stage = "" // unchanged: keep the stored copy
	}
	return s.commit(ctx, stage, rec, tags)
}

// cloneTree recreates src at dst (which must not exist) with directories
// copied and everything else hard-linked.
func cloneTree(ctx context.Context, src, dst string) error {
	type dirMeta struct {
		path string
		st   unix.Stat_t
	}
	var dirs []dirMeta
	n := 0
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if n++; n%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			if err := os.Mkdir(target, 0o700); err != nil {
				return err
			}
			dirs = append(dirs, dirMeta{target, st})
			return nil
		}
		// Flags 0: link a symlink itself, never its target.
		return unix.Linkat(unix.AT_FDCWD, p, unix.AT_FDCWD, target, 0)
	})
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		if err := os.Lchown(d.path, int(d.st.Uid), int(d.st.Gid)); err != nil {
			return err
		}
		if err := unix.Chmod(d.path, d.st.Mode&0o7777); err != nil {
			return err
		}
		if err := copyUserXattrs(filepath.Join(src, strings.TrimPrefix(d.path, dst)), d.path); err != nil {
			return err
		}
		ts := []unix.Timespec{d.st.Atim, d.st.Mtim}
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, d.path, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	return nil
}

// ResolveDir returns dir (an absolute path inside the tree) with every
// symlink resolved as the sandbox would resolve it, but never leaving the
// tree (openat2 RESOLVE_IN_ROOT), so that COPY into /bin/x on a merged-/usr
// system lands in /usr/bin/x. Missing trailing components are kept as
// given (they will be created as directories). The result is relative.
func (t *Tree) ResolveDir(dir string) (string, error) {
	rel, err := cleanRel(strings.TrimPrefix(path.Clean("/"+dir), "/"))
	if err != nil {
		return "", err
	}
	if rel == "" {
		return "", nil
	}
	parts := strings.Split(rel, "/")
	// Find the longest existing prefix and resolve it.
	for i := len(parts); i > 0; i-- {
		prefix := strings.Join(parts[:i], "/")
		fd, err := unix.Openat2(int(t.st.root.Fd()), prefix, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
		})
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("resolve %q in template: %w", prefix, err)
		}
		real, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
		var st unix.Stat_t
		serr := unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil || serr != nil {
			return "", fmt.Errorf("resolve %q in template: %v %v", prefix, err, serr)
		}
		rootReal, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", t.st.root.Fd()))
		if err != nil {
			return "", err
		}
		r, ok := strings.CutPrefix(real, rootReal)
		if !ok || (r != "" && !strings.HasPrefix(r, "/")) {
			return "", fmt.Errorf("resolve %q: left the template tree: %w", prefix, errdefs.ErrInvalidArgument)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return "", invalid("%q is not a directory in the template", "/"+prefix)
		}
		return strings.TrimPrefix(path.Join(append([]string{r}, parts[i:]...)...), "/"), nil
	}
	return rel, nil
}

// ApplyUpperDir applies an overlayfs upper directory: new and changed
// entries replace the tree's, 0/0 character devices delete, and directories
// marked opaque lose their previous contents. Owners are shifted back by
// u.IDBase (ids outside the sandbox's range become 65534). The upper
// directory comes from a sandbox and is treated as hostile: it is read
// without following symlinks and written through the stager.
func (t *Tree) ApplyUpperDir(ctx context.Context, u Upper) error {
	unshift := func(id uint32) int {
		if u.IDBase == 0 {
			return int(id)
		}
		if id < u.IDBase || id-u.IDBase >= 65536 {
			return 65534
		}
		return int(id - u.IDBase)
	}
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	n := 0
	return filepath.WalkDir(u.Dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("read changes: %w", err)
		}
		if n++; n%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		rel, err := filepath.Rel(u.Dir, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil // the upper root carries no change of its own
		}
		rel = filepath.ToSlash(rel)
		var sys unix.Stat_t
		if err := unix.Lstat(p, &sys); err != nil {
			return fmt.Errorf("stat %s: %w", p, err)
		}
		m := meta{mode: sys.Mode & 0o7777, uid: unshift(sys.Uid), gid: unshift(sys.Gid),
			mtime: time.Unix(sys.Mtim.Unix()), atime: time.Unix(sys.Atim.Unix())}
		if typ := sys.Mode & unix.S_IFMT; typ == unix.S_IFDIR || typ == unix.S_IFREG {
			if m.xattrs, err = readXattrs(p); err != nil {
				return err
			}
		}
		switch sys.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			if u.OpaqueXattr != "" && isOpaque(p, u.OpaqueXattr) {
				if err := t.st.opaque(rel); err != nil {
					return err
				}
			}
			return t.st.dir(rel, m)
		case unix.S_IFCHR:
			if sys.Rdev == 0 {
				return t.st.remove(rel)
			}
			t.st.skip(rel, "device node")
			return nil
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return t.st.symlink(rel, target, m)
		case unix.S_IFREG:
			if sys.Nlink > 1 {
				key := inode{uint64(sys.Dev), sys.Ino}
				if first, ok := links[key]; ok {
					return t.st.hardlink(rel, first)
				}
				links[key] = rel
			}
			f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			return t.st.file(rel, m, sys.Size, f)
		case unix.S_IFIFO:
			return t.st.fifo(rel, m)
		default:
			t.st.skip(rel, "socket or block device")
			return nil
		}
	})
}

func isOpaque(p, xattr string) bool {
	buf := make([]byte, 8)
	n, err := unix.Lgetxattr(p, xattr, buf)
	return err == nil && n == 1 && buf[0] == 'y'
}

// CopyOptions tune Tree.CopyIn.
type CopyOptions struct {
	// Owner, when set, owns every copied entry (COPY --chown); otherwise
	// root does, as in Docker.
	Owner *[2]int
}

// CopyIn copies the host file or directory src into the tree: a file to
// dest (an absolute in-tree path; "dir/" or an existing directory means
// dest/<name of src>), a directory's contents into dest. src is read
// without following symlinks inside it.
func (t *Tree) CopyIn(ctx context.Context, src, dest string, o CopyOptions) error {
	fi, err := os.Lstat(src)
	if err != nil {
		return err
	}
	owner := [2]int{0, 0}
	if o.Owner != nil {
		owner = *o.Owner
	}
	trailing := strings.HasSuffix(dest, "/")
	if fi.IsDir() {
		dir, err := t.ResolveDir(dest)
		if err != nil {
			return err
		}
		return copyTree(ctx, t.st, src, dir, &owner, 0, nil)
	}
	destDir, name := path.Split(path.Clean("/" + dest))
	if trailing || dest == "/" {
		destDir, name = path.Clean("/"+dest), filepath.Base(src)
	} else if rd, err := t.ResolveDir(path.Clean("/" + dest)); err == nil {
		// An existing directory at dest takes the file inside it.
		if _, err := t.st.openDir(rd, false); err == nil {
			destDir, name = path.Clean("/"+dest), filepath.Base(src)
		}
	}
	dir, err := t.ResolveDir(destDir)
	if err != nil {
		return err
	}
	return copyTree(ctx, t.st, src, path.Join(dir, name), &owner, 0, nil)
}

// CacheGet returns the template a build step with this key produced, when
// both the record and the template are still there.
func (s *Store) CacheGet(ctx context.Context, key string) (string, bool, error) {
	var d string
	err := s.db.QueryRowContext(ctx, `SELECT c.digest FROM template_build_cache c
JOIN template_images i ON i.digest = c.digest WHERE c.key = ?`, key).Scan(&d)
	if errors.Is(err, sql.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("build cache: %w", err)
	}
	return d, true, nil
}

// CachePut records that the build step key produced template digest.
func (s *Store) CachePut(ctx context.Context, key, digest string) error {
	_, err := s.db.ExecContext(ctx, `INSERT INTO template_build_cache (key, digest, created_at) VALUES (?, ?, ?)
ON CONFLICT (key) DO UPDATE SET digest = excluded.digest, created_at = excluded.created_at`, key, digest, time.Now().UnixNano())
	if err != nil {
		return fmt.Errorf("build cache: %w", err)
	}
	return nil
}

// Mkdir makes the directory dir (absolute in the tree) and its missing
// parents, 0755 root:root like Docker's WORKDIR; existing ones are kept.
func (t *Tree) Mkdir(dir string) error {
	rel, err := t.ResolveDir(dir)
	if err != nil {
		return err
	}
	d, err := t.st.openDir(rel, true)
	if err != nil {
		return err
	}
	return d.Close()
}

// readXattrs returns the extended attributes of p a template keeps.
func readXattrs(p string) ([]xattr, error) {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list xattrs of %s: %w", p, err)
	}
	var out []xattr
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if !keepXattr(name) {
			continue
		}
		v, err := lgetxattr(p, name)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read xattr %s of %s: %w", name, p, err)
		}
		out = append(out, xattr{name: name, value: v})
	}
	return out, nil
}
