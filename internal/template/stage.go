package template

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// entryOverhead is what every entry costs against ImportOptions.MaxBytes on
// top of its content, so an archive of millions of empty files cannot exhaust
// inodes under a byte limit. It is the size of a tar header block.
const entryOverhead = 512

// meta is the ownership, permission and time metadata of one entry.
type meta struct {
	mode  uint32 // unix permission bits incl. setuid/setgid/sticky (07777)
	uid   int
	gid   int
	mtime time.Time
	atime time.Time
	// xattrs are extended attributes to set, already filtered by policy
	// (see keepXattr); only regular files and directories carry them.
	xattrs []xattr
}

// xattr is one extended attribute of an entry.
type xattr struct {
	name  string
	value []byte
}

// Bounds on what one entry's extended attributes may be (the kernel's
// XATTR_NAME_MAX and XATTR_SIZE_MAX, and a count no real file exceeds).
const (
	maxXattrName   = 255
	maxXattrValue  = 64 << 10
	maxXattrsEntry = 64
)

// keepXattr is the extended attribute policy. Only the user namespace is
// kept: it is plain data that any file owner may set. security.* is
// dropped — security.capability is a file capability, which would let a
// binary gain privileges on exec, so it is neutralised exactly like a
// setuid bit, and SELinux/SMACK labels belong to the host's policy, not an
// image's. trusted.* needs CAP_SYS_ADMIN to read and would be host-level
// metadata; system.* (POSIX ACLs) is not carried either.
func keepXattr(name string) bool {
	// user.overlay.* steer overlayfs mounted with userxattr (as native
	// does): a template must not carry whiteouts, opaque markers or
	// redirects into every sandbox's lower layer.
	return strings.HasPrefix(name, "user.") && len(name) > len("user.") && !strings.HasPrefix(name, "user.overlay.")
}

// stager writes a tree into a staging directory without ever following a
// symlink inside it and without touching anything outside it.
//
// Every path it is given is archive-relative and hostile: it is validated by
// cleanRel, then reached by opening one component at a time relative to the
// staging root with O_NOFOLLOW|O_DIRECTORY, so a symlink planted by an earlier
// entry (even one pointing at "/" or "..") can never redirect a later write.
// The final component is always created with *at calls on the parent's fd and
// O_EXCL|O_NOFOLLOW, and anything already there is unlinked first (tar's
// "last entry wins"), never written through.
//
// Policies, applied identically to directory and tar imports so that the
// same tree gives the same digest either way:
//   - setuid and setgid bits are dropped from non-directories: sandboxes run
//     with no_new_privs, and a setuid-root binary lying in the host's store
//     directory would be a host privilege escalation;
//   - character and block devices and sockets are skipped (logged): runtimes
//     provide their own minimal /dev, and a device node in a template would
//     be a way around the devices cgroup on the host side;
//   - FIFOs, symlinks (to any target: they are only ever resolved inside the
//     sandbox) and hard links within the tree are kept;
//   - ownership is preserved when running as root; extended attributes are
//     set only when an importer passes them in meta.xattrs (OCI layers do,
//     after keepXattr: user.* only, so file capabilities never are), and
//     only on regular files and directories; a filesystem without xattr
//     support drops them with a log line.
type stager struct {
	root     *os.File // the staging rootfs directory
	isRoot   bool
	maxBytes int64 // 0 = unlimited
	used     int64
	log      *slog.Logger
	dirs     map[string]meta // deferred directory metadata, applied by finish
	skipped  int

	// Parent directory cache: tar entries come grouped by directory.
	lastRel string
	lastDir *os.File

	// replaceDirs lets a non-directory entry replace a directory (and all
	// below it) instead of failing: a later OCI layer may turn a lower
	// layer's directory into a file or symlink.
	replaceDirs bool
	// layer, when set, records what the current OCI layer wrote so that
	// its whiteouts and opaque markers hide only lower layers' entries.
	layer *layerPaths
	// xattrUnsupported is set once the filesystem refused an xattr.
	xattrUnsupported bool
}

// layerPaths are the entries one layer wrote (written) and the directories
// above them (parents).
type layerPaths struct {
	written map[string]bool
	parents map[string]bool
}

// beginLayer starts tracking a new layer's entries (see remove, opaque).
func (s *stager) beginLayer() {
	s.layer = &layerPaths{written: map[string]bool{}, parents: map[string]bool{}}
}

// wrote records that the current layer (if any) wrote rel.
func (s *stager) wrote(rel string) {
	if s.layer == nil {
		return
	}
	s.layer.written[rel] = true
	for d := path.Dir(rel); d != "." && d != "/" && !s.layer.parents[d]; d = path.Dir(d) {
		s.layer.parents[d] = true
	}
	s.layer.parents[""] = true
}

// ofLayer reports whether rel was written by the current layer or lies
// above something it wrote.
func (s *stager) ofLayer(rel string) bool {
	return s.layer != nil && (s.layer.written[rel] || s.layer.parents[rel])
}

func newStager(rootPath string, maxBytes int64, log *slog.Logger) (*stager, error) {
	f, err := os.OpenFile(rootPath, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	return &stager{
		root: f, isRoot: os.Geteuid() == 0, maxBytes: maxBytes, log: log,
		dirs: map[string]meta{"": {mode: 0o755, mtime: time.Now(), atime: time.Now()}},
	}, nil
}

func (s *stager) close() {
	if s.lastDir != nil {
		s.lastDir.Close()
		s.lastDir = nil
	}
	s.root.Close()
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
}

// cleanRel validates an archive path and returns it relative to the root
// ("" is the root itself). Absolute paths and ".." components are rejected
// rather than rewritten: an archive that contains them is hostile or broken.
func cleanRel(name string) (string, error) {
	if strings.IndexByte(name, 0) >= 0 {
		return "", invalid("entry name %q contains a NUL byte", name)
	}
	if strings.HasPrefix(name, "/") {
		return "", invalid("path %q is absolute", name)
	}
	var parts []string
	for _, p := range strings.Split(name, "/") {
		switch p {
		case "", ".":
			continue
		case "..":
			return "", invalid("path %q escapes the archive root with '..'", name)
		}
		if len(p) > 255 {
			return "", invalid("entry %q has a path component longer than 255 bytes", name)
		}
		parts = append(parts, p)
	}
	rel := strings.Join(parts, "/")
	if len(rel) > 4000 {
		return "", invalid("entry %q: path too long", name)
	}
	return rel, nil
}

// charge accounts n bytes against MaxBytes.
func (s *stager) charge(n int64, rel string) error {
	s.used += n
	if s.maxBytes > 0 && s.used > s.maxBytes {
		return fmt.Errorf("import exceeds the limit of %d bytes at entry %q: %w", s.maxBytes, rel, errdefs.ErrTooLarge)
	}
	return nil
}

// parent returns an fd for the directory containing rel (creating missing
// directories 0755 root:root) and rel's last component. The fd belongs to
// the stager's cache: callers must not close it.
func (s *stager) parent(rel string) (*os.File, string, error) {
	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if base == "" {
		return nil, "", invalid("entry %q has no name", rel)
	}
	if s.lastDir != nil && s.lastRel == dir {
		return s.lastDir, base, nil
	}
	f, err := s.openDir(dir, true)
	if err != nil {
		return nil, "", fmt.Errorf("entry %q: %w", rel, err)
	}
	if s.lastDir != nil {
		s.lastDir.Close()
	}
	s.lastRel, s.lastDir = dir, f
	return f, base, nil
}

// openDir opens the directory rel one component at a time, never following
// symlinks. With create, missing components are made.
func (s *stager) openDir(rel string, create bool) (*os.File, error) {
	fd, err := unix.Dup(int(s.root.Fd()))
	if err != nil {
		return nil, err
	}
	unix.CloseOnExec(fd)
	if rel == "" {
		return os.NewFile(uintptr(fd), "."), nil
	}
	walked := ""
	for _, comp := range strings.Split(rel, "/") {
		walked = path.Join(walked, comp)
		next, err := unix.Openat(fd, comp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) && create {
			if err = unix.Mkdirat(fd, comp, 0o700); err == nil || errors.Is(err, unix.EEXIST) {
				if _, ok := s.dirs[walked]; !ok {
					now := time.Now()
					s.dirs[walked] = meta{mode: 0o755, mtime: now, atime: now}
				}
				next, err = unix.Openat(fd, comp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			}
		}
		unix.Close(fd)
		if err != nil {
			if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
				return nil, invalid("%q is not a directory (a symlink or file) and may not be traversed", walked)
			}
			if errors.Is(err, unix.ENOENT) {
				return nil, invalid("path %q: %q does not exist", rel, walked)
			}
			return nil, fmt.Errorf("open %q: %w", walked, err)
		}
		fd = next
	}
	return os.NewFile(uintptr(fd), rel), nil
}

// clear removes whatever is at parent/base unless it is a directory and
// keepDir is set. It reports whether a directory is (still) there.
func (s *stager) clear(parent *os.File, base, rel string, keepDir bool) (isDir bool, err error) {
	var st unix.Stat_t
	err = unix.Fstatat(int(parent.Fd()), base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat %q: %w", rel, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if keepDir {
			return true, nil
		}
		if !s.replaceDirs {
			return false, invalid("entry %q would replace a directory with a non-directory", rel)
		}
		// parent is rel's parent, so it survives the removal.
		if err := s.removeTree(int(parent.Fd()), base, rel); err != nil {
			return false, err
		}
		return false, nil
	}
	if err := unix.Unlinkat(int(parent.Fd()), base, 0); err != nil {
		return false, fmt.Errorf("replace %q: %w", rel, err)
	}
	return false, nil
}

// dir records a directory entry; its metadata is applied by finish, after
// its contents are written.
func (s *stager) dir(rel string, m meta) error {
	if err := s.charge(entryOverhead, rel); err != nil {
		return err
	}
	m.mode &= 0o7777
	if err := s.chargeXattrs(m, rel); err != nil {
		return err
	}
	s.wrote(rel)
	if rel == "" {
		s.dirs[""] = m
		return nil
	}
	parent, base, err := s.parent(rel)
	if err != nil {
		return err
	}
	isDir, err := s.clear(parent, base, rel, true)
	if err != nil {
		return err
	}
	if !isDir {
		// 0700 until finish: nobody else may use a half-built tree.
		if err := unix.Mkdirat(int(parent.Fd()), base, 0o700); err != nil {
			return fmt.Errorf("mkdir %q: %w", rel, err)
		}
	}
	s.dirs[rel] = m
	return nil
}

// file writes a regular file of exactly size bytes from r.
func (s *stager) file(rel string, m meta, size int64, r io.Reader) error {
	if size < 0 {
		return invalid("entry %q has a negative size", rel)
	}
	if err := s.charge(entryOverhead+size, rel); err != nil {
		return err
	}
	if err := s.chargeXattrs(m, rel); err != nil {
		return err
	}
	parent, base, err := s.parent(rel)
	if err != nil {
		return err
	}
	if _, err := s.clear(parent, base, rel, false); err != nil {
		return err
	}
	fd, err := unix.Openat(int(parent.Fd()), base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create %q: %w", rel, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	// io.CopyN hands *os.File sources to copy_file_range.
	n, err := io.CopyN(f, r, size)
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return &shortReadError{rel: rel, got: n, want: size}
		}
		return fmt.Errorf("write %q: %w", rel, err)
	}
	if err := s.setMeta(f, parent, base, rel, m, false); err != nil {
		return err
	}
	if err := s.setXattrs(int(f.Fd()), rel, m.xattrs); err != nil {
		return err
	}
	s.wrote(rel)
	return f.Close()
}

// chargeXattrs validates m's extended attributes and accounts for them.
func (s *stager) chargeXattrs(m meta, rel string) error {
	if len(m.xattrs) > maxXattrsEntry {
		return invalid("entry %q has %d extended attributes (at most %d)", rel, len(m.xattrs), maxXattrsEntry)
	}
	var n int64
	for _, x := range m.xattrs {
		if !keepXattr(x.name) || len(x.name) > maxXattrName || strings.IndexByte(x.name, 0) >= 0 {
			return invalid("entry %q: extended attribute %q is not allowed", rel, x.name)
		}
		if len(x.value) > maxXattrValue {
			return invalid("entry %q: extended attribute %q is larger than %d bytes", rel, x.name, maxXattrValue)
		}
		n += int64(len(x.name) + len(x.value))
	}
	if n == 0 {
		return nil
	}
	return s.charge(n, rel)
}

// setXattrs sets xattrs on the open file or directory fd. A filesystem
// without (user) xattr support drops them, logged once per import.
func (s *stager) setXattrs(fd int, rel string, xs []xattr) error {
	for _, x := range xs {
		err := unix.Fsetxattr(fd, x.name, x.value, 0)
		if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
			if !s.xattrUnsupported {
				s.log.Warn("template import: the store's filesystem does not support extended attributes; dropping them",
					"path", rel, "xattr", x.name)
				s.xattrUnsupported = true
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("set extended attribute %q on %q: %w", x.name, rel, err)
		}
	}
	return nil
}

// shortReadError is a file whose content ended early; the tar importer turns
// it into "archive truncated", the dir importer into "changed during import".
type shortReadError struct {
	rel       string
	got, want int64
}

func (e *shortReadError) Error() string {
	return fmt.Sprintf("entry %q: content ended after %d of %d bytes", e.rel, e.got, e.want)
}

func (s *stager) symlink(rel, target string, m meta) error {
	if err := s.charge(entryOverhead+int64(len(target)), rel); err != nil {
		return err
	}
	if target == "" || strings.IndexByte(target, 0) >= 0 || len(target) > 4095 {
		return invalid("symlink %q has an invalid target", rel)
	}
	parent, base, err := s.parent(rel)
	if err != nil {
		return err
	}
	if _, err := s.clear(parent, base, rel, false); err != nil {
		return err
	}
	if err := unix.Symlinkat(target, int(parent.Fd()), base); err != nil {
		return fmt.Errorf("symlink %q: %w", rel, err)
	}
	s.wrote(rel)
	return s.setMeta(nil, parent, base, rel, m, true)
}

// hardlink makes rel another name of the already extracted entry target.
// target is archive-relative and is reached without following symlinks, so
// it cannot name anything outside the tree.
func (s *stager) hardlink(rel, target string) error {
	if err := s.charge(entryOverhead, rel); err != nil {
		return err
	}
	trel, err := cleanRel(target)
	if err != nil {
		return fmt.Errorf("hard link %q: target: %w", rel, err)
	}
	if trel == "" {
		return invalid("hard link %q points at the archive root", rel)
	}
	tdir, tbase := path.Split(trel)
	tparent, err := s.openDir(strings.TrimSuffix(tdir, "/"), false)
	if err != nil {
		return fmt.Errorf("hard link %q -> %q: %w", rel, target, err)
	}
	defer tparent.Close()
	var st unix.Stat_t
	if err := unix.Fstatat(int(tparent.Fd()), tbase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return invalid("hard link %q -> %q: target is not in the archive before it", rel, target)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return invalid("hard link %q -> %q: target is a directory", rel, target)
	}
	if trel == rel {
		s.wrote(rel)
		return nil // a link to itself: nothing to do
	}
	parent, base, err := s.parent(rel)
	if err != nil {
		return err
	}
	if _, err := s.clear(parent, base, rel, false); err != nil {
		return err
	}
	// Flags 0: link the target entry itself, never what it may point to.
	if err := unix.Linkat(int(tparent.Fd()), tbase, int(parent.Fd()), base, 0); err != nil {
		return fmt.Errorf("hard link %q -> %q: %w", rel, target, err)
	}
	s.wrote(rel)
	return nil
}

func (s *stager) fifo(rel string, m meta) error {
	if err := s.charge(entryOverhead, rel); err != nil {
		return err
	}
	parent, base, err := s.parent(rel)
	if err != nil {
		return err
	}
	if _, err := s.clear(parent, base, rel, false); err != nil {
		return err
	}
	if err := unix.Mkfifoat(int(parent.Fd()), base, 0o600); err != nil {
		return fmt.Errorf("mkfifo %q: %w", rel, err)
	}
	s.wrote(rel)
	return s.setMeta(nil, parent, base, rel, m, false)
}

// skip records an entry the policy leaves out.
func (s *stager) skip(rel, why string) {
	s.skipped++
	s.log.Debug("template import: skipping entry", "path", rel, "reason", why)
}

// setMeta applies ownership, mode and times. f, when set, is the open file.
func (s *stager) setMeta(f *os.File, parent *os.File, base, rel string, m meta, isLink bool) error {
	pfd := int(parent.Fd())
	if s.isRoot {
		var err error
		if f != nil {
			err = f.Chown(m.uid, m.gid)
		} else {
			err = unix.Fchownat(pfd, base, m.uid, m.gid, unix.AT_SYMLINK_NOFOLLOW)
		}
		if err != nil {
			return fmt.Errorf("chown %q: %w", rel, err)
		}
	}
	if !isLink {
		// After chown, which may clear setuid bits anyway.
		mode := m.mode & 0o7777 &^ (unix.S_ISUID | unix.S_ISGID)
		var err error
		if f != nil {
			err = unix.Fchmod(int(f.Fd()), mode)
		} else {
			err = unix.Fchmodat(pfd, base, mode, 0)
		}
		if err != nil {
			return fmt.Errorf("chmod %q: %w", rel, err)
		}
	}
	return setTimes(pfd, base, rel, m)
}

func setTimes(dirfd int, base, rel string, m meta) error {
	if m.mtime.IsZero() {
		return nil
	}
	at := m.atime
	if at.IsZero() {
		at = m.mtime
	}
	// Times outside what the kernel can store (archives may claim any
	// year) are not worth failing an import over: the entry keeps "now".
	ats, err1 := unix.TimeToTimespec(at)
	mts, err2 := unix.TimeToTimespec(m.mtime)
	if err1 != nil || err2 != nil || at.Year() > 2200 || m.mtime.Year() > 2200 {
		return nil
	}
	if err := unix.UtimesNanoAt(dirfd, base, []unix.Timespec{ats, mts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times of %q: %w", rel, err)
	}
	return nil
}

// finish applies the deferred directory metadata, deepest first so that
// setting a child's times does not disturb its parent's.
func (s *stager) finish() error {
	if s.lastDir != nil {
		s.lastDir.Close()
		s.lastDir = nil
	}
	rels := make([]string, 0, len(s.dirs))
	for rel := range s.dirs {
		rels = append(rels, rel)
	}
	sort.Sort(sort.Reverse(sort.StringSlice(rels)))
	for _, rel := range rels {
		m := s.dirs[rel]
		var parent *os.File
		base := "."
		if rel == "" {
			parent = s.root
		} else {
			var err error
			dir, b := path.Split(rel)
			parent, err = s.openDir(strings.TrimSuffix(dir, "/"), false)
			if err != nil {
				return err
			}
			base = b
		}
		pfd := int(parent.Fd())
		var err error
		if s.isRoot {
			err = unix.Fchownat(pfd, base, m.uid, m.gid, unix.AT_SYMLINK_NOFOLLOW)
		}
		if err == nil {
			// Directories keep setgid (group inheritance, not privilege).
			err = unix.Fchmodat(pfd, base, m.mode&0o7777&^unix.S_ISUID, 0)
		}
		if err == nil && len(m.xattrs) > 0 {
			err = s.setDirXattrs(pfd, base, rel, m.xattrs)
		}
		if err == nil {
			err = setTimes(pfd, base, rel, m)
		}
		if parent != s.root {
			parent.Close()
		}
		if err != nil {
			return fmt.Errorf("directory %q: %w", rel, err)
		}
	}
	return nil
}

// remove deletes whatever is at rel (recursively), without following
// symlinks: an OCI or overlay whiteout. A missing path is not an error, but
// a path through a symlink is: a whiteout names an entry of the tree, and
// "hiding" something behind a symlink could only be an attempt to reach
// outside it. While a layer is tracked (beginLayer), entries that layer
// wrote itself are kept: a whiteout hides only lower layers.
func (s *stager) remove(rel string) error {
	if err := s.charge(entryOverhead, rel); err != nil {
		return err
	}
	if rel == "" {
		return invalid("a whiteout may not delete the root")
	}
	dir, base := path.Split(rel)
	parent, err := s.openExisting(strings.TrimSuffix(dir, "/"))
	if err != nil || parent == nil {
		return err
	}
	defer parent.Close()
	s.dropCache()
	if s.ofLayer(rel) {
		// This layer's own entry stays; if it is a directory, what lies
		// below it from lower layers goes.
		return s.pruneLower(int(parent.Fd()), base, rel)
	}
	return s.removeTree(int(parent.Fd()), base, rel)
}

// opaque removes every entry inside the directory rel (creating it if
// missing): an opaque directory hides what the layers below put there.
// While a layer is tracked, that layer's own entries below rel stay, in
// whatever order the marker and they came.
func (s *stager) opaque(rel string) error {
	if err := s.charge(entryOverhead, rel); err != nil {
		return err
	}
	d, err := s.openDir(rel, true)
	if err != nil {
		return err
	}
	defer d.Close()
	s.dropCache()
	names, err := readNames(int(d.Fd()))
	if err != nil {
		return fmt.Errorf("read %q: %w", rel, err)
	}
	for _, n := range names {
		crel := path.Join(rel, n)
		if s.ofLayer(crel) {
			if err := s.pruneLower(int(d.Fd()), n, crel); err != nil {
				return err
			}
			continue
		}
		if err := s.removeTree(int(d.Fd()), n, crel); err != nil {
			return err
		}
	}
	return nil
}

// pruneLower removes, below the directory name in dirfd (at rel), every
// entry the current layer did not write, keeping directories that lead to
// entries it did. A non-directory at name is left alone.
func (s *stager) pruneLower(dirfd int, name, rel string) error {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open %q: %w", rel, err)
	}
	defer unix.Close(fd)
	names, err := readNames(fd)
	if err != nil {
		return fmt.Errorf("read %q: %w", rel, err)
	}
	for _, n := range names {
		crel := path.Join(rel, n)
		if s.ofLayer(crel) {
			if err := s.pruneLower(fd, n, crel); err != nil {
				return err
			}
			continue
		}
		if err := s.removeTree(fd, n, crel); err != nil {
			return err
		}
	}
	return nil
}

// dropCache forgets the cached parent directory: a removal may have taken
// it out of the tree.
func (s *stager) dropCache() {
	if s.lastDir != nil {
		s.lastDir.Close()
		s.lastDir, s.lastRel = nil, ""
	}
}

// openExisting opens directory rel without creating or following anything;
// it returns nil, nil when rel does not exist or a component is not a
// directory (there is then nothing below it to remove), and an error when
// a component is a symlink.
func (s *stager) openExisting(rel string) (*os.File, error) {
	fd, err := unix.Dup(int(s.root.Fd()))
	if err != nil {
		return nil, err
	}
	unix.CloseOnExec(fd)
	if rel != "" {
		walked := ""
		for _, comp := range strings.Split(rel, "/") {
			walked = path.Join(walked, comp)
			next, err := unix.Openat(fd, comp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
				var st unix.Stat_t
				if unix.Fstatat(fd, comp, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
					unix.Close(fd)
					return nil, invalid("whiteout below %q: %q is a symlink and may not be traversed", rel, walked)
				}
			}
			unix.Close(fd)
			if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
				return nil, nil
			}
			if err != nil {
				return nil, fmt.Errorf("open %q: %w", rel, err)
			}
			fd = next
		}
	}
	return os.NewFile(uintptr(fd), rel), nil
}

// removeAt removes name in dirfd, recursing into directories by
// descriptor so that no symlink is ever followed. onDir, if set, is told
// the path of every directory removed.
func removeAt(dirfd int, name, rel string, onDir ...func(rel string)) error {
	err := unix.Unlinkat(dirfd, name, 0)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EPERM) {
		return fmt.Errorf("remove %q: %w", rel, err)
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("remove %q: %w", rel, err)
	}
	names, err := readNames(fd)
	if err == nil {
		for _, n := range names {
			if err = removeAt(fd, n, path.Join(rel, n), onDir...); err != nil {
				break
			}
		}
	}
	unix.Close(fd)
	if err != nil {
		return err
	}
	if err := unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %q: %w", rel, err)
	}
	for _, f := range onDir {
		f(rel)
	}
	return nil
}

// removeTree removes rel (name in dirfd) and forgets the deferred metadata
// of every directory that goes with it, in time linear in what is removed.
func (s *stager) removeTree(dirfd int, name, rel string) error {
	return removeAt(dirfd, name, rel, func(d string) { delete(s.dirs, d) })
}

// readNames lists a directory by descriptor (the descriptor stays open).
func readNames(fd int) ([]string, error) {
	dup, err := unix.Dup(fd)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(dup), "dir")
	defer f.Close()
	return f.Readdirnames(-1)
}

// setDirXattrs sets xattrs on the directory base in dirfd ("." = dirfd).
func (s *stager) setDirXattrs(dirfd int, base, rel string, xs []xattr) error {
	fd, err := unix.Openat(dirfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %q: %w", rel, err)
	}
	defer unix.Close(fd)
	return s.setXattrs(fd, rel, xs)
}

// copyUserXattrs copies the user.* extended attributes of src to dst (both
// trusted paths, neither followed if a symlink). It is for code that
// re-creates a tree's directories instead of linking them (Derive's clone),
// so that the copy keeps the tree digest; ENOTSUP on dst is ignored like
// the stager does.
func copyUserXattrs(src, dst string) error {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(src, buf)
	if errors.Is(err, unix.ERANGE) {
		if n, err = unix.Llistxattr(src, nil); err == nil {
			buf = make([]byte, n+64)
			n, err = unix.Llistxattr(src, buf)
		}
	}
	if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list xattrs of %s: %w", src, err)
	}
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if !keepXattr(name) {
			continue
		}
		v, err := lgetxattr(src, name)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return fmt.Errorf("read xattr %s of %s: %w", name, src, err)
		}
		err = unix.Lsetxattr(dst, name, v, 0)
		if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("set xattr %s on %s: %w", name, dst, err)
		}
	}
	return nil
}
