package agent

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// resolveFlags confine every lookup: ".." and absolute symlinks are resolved
// as if dirfd were "/", and /proc magic links (which could point anywhere)
// are refused.
const resolveFlags = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS

// maxTreeDepth bounds recursion (one descriptor per level) in recursive
// remove and tar.
const maxTreeDepth = 256

// fsRoot is a directory that file operations cannot leave. Every path is
// resolved by the kernel relative to fd with RESOLVE_IN_ROOT, so a path or
// symlink swapped mid-operation still resolves inside. Operations on a
// final component (stat, remove, rename, create) open its parent through
// the root and then act on the name relative to that descriptor.
type fsRoot struct {
	fd int
	// resolve is added to resolveFlags on every lookup: RESOLVE_NO_SYMLINKS
	// for an exact root (see exact).
	resolve uint64
}

func openRoot(dir string) (*fsRoot, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening root %s: %w", dir, err)
	}
	return &fsRoot{fd: fd}, nil
}

// exact is the same root refusing every symlink on the way (ELOOP): the
// host resolved the path (handleResolve), the policy decided on the result,
// and a symlink planted since must fail the operation instead of moving it
// somewhere the policy did not see. It shares r's descriptor.
func (r *fsRoot) exact() *fsRoot {
	return &fsRoot{fd: r.fd, resolve: r.resolve | unix.RESOLVE_NO_SYMLINKS}
}

// sub is a root at dirfd (a directory below r) with r's lookup rules.
func (r *fsRoot) sub(dirfd int) *fsRoot { return &fsRoot{fd: dirfd, resolve: r.resolve} }

func (r *fsRoot) close() { unix.Close(r.fd) }

// cleanPath validates an API path and returns it relative to the root:
// "." for the root itself, else a clean path without leading "/" and
// without ".." components (they are folded lexically, which can only stay
// inside the root).
func cleanPath(p string) (string, error) {
	switch {
	case p == "":
		return "", fmt.Errorf("path is empty: %w", errdefs.ErrInvalidArgument)
	case len(p) > agentproto.MaxPathLen:
		return "", fmt.Errorf("path is longer than %d bytes: %w", agentproto.MaxPathLen, errdefs.ErrInvalidArgument)
	case strings.IndexByte(p, 0) >= 0:
		return "", fmt.Errorf("path contains a NUL byte: %w", errdefs.ErrInvalidArgument)
	}
	c := path.Clean("/" + p)
	if c == "/" {
		return ".", nil
	}
	return c[1:], nil
}

// apiPath is the path as the API shows it.
func apiPath(rel string) string {
	if rel == "." {
		return "/"
	}
	return "/" + rel
}

// at opens rel below dirfd with r's lookup rules (openat2With).
func (r *fsRoot) at(dirfd int, rel string, flags uint64) (int, error) {
	return openat2With(dirfd, rel, flags, 0, r.resolve)
}

// openat2With opens rel below dirfd, confined (resolveFlags plus resolve),
// retrying the transient EAGAIN the kernel returns when a concurrent rename
// might have let ".." escape.
func openat2With(dirfd int, rel string, flags, mode, resolve uint64) (int, error) {
	how := &unix.OpenHow{Flags: flags | unix.O_CLOEXEC, Mode: mode, Resolve: resolveFlags | resolve}
	for i := 0; ; i++ {
		fd, err := unix.Openat2(dirfd, rel, how)
		if (err == unix.EAGAIN || err == unix.EINTR) && i < 64 {
			continue
		}
		return fd, err
	}
}

// open opens rel (following symlinks, confined) with flags.
func (r *fsRoot) open(rel string, flags int) (int, error) {
	return r.at(r.fd, rel, uint64(flags))
}

// parent opens the directory containing rel and returns it with rel's last
// component. rel must not be the root.
func (r *fsRoot) parent(rel string) (int, string, error) {
	if rel == "." {
		return -1, "", fmt.Errorf("the root directory cannot be the target of this operation: %w", errdefs.ErrInvalidArgument)
	}
	dir, base := path.Split(rel)
	if dir == "" {
		dir = "."
	}
	fd, err := r.open(dir, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return -1, "", fsError("open parent of", apiPath(rel), err)
	}
	return fd, base, nil
}

// fsError maps an errno to a sentinel with a message naming op and path.
func fsError(op, p string, err error) error {
	var sentinel error
	var errno unix.Errno
	if errors.As(err, &errno) {
		switch errno {
		case unix.ENOENT:
			sentinel = errdefs.ErrNotFound
		case unix.EEXIST, unix.ENOTEMPTY, unix.EISDIR, unix.ENOTDIR, unix.EBUSY, unix.ETXTBSY:
			sentinel = errdefs.ErrConflict
		case unix.EACCES, unix.EPERM, unix.EROFS, unix.EXDEV, unix.EMLINK:
			sentinel = errdefs.ErrUnprocessable
		case unix.ENAMETOOLONG, unix.EINVAL, unix.ELOOP:
			sentinel = errdefs.ErrInvalidArgument
		case unix.ENOSPC, unix.EDQUOT, unix.EFBIG:
			sentinel = errdefs.ErrTooLarge
		case unix.EMFILE, unix.ENFILE, unix.ENOMEM, unix.EAGAIN:
			sentinel = errdefs.ErrUnavailable
		}
	}
	if sentinel == nil {
		return fmt.Errorf("%s %s: %w", op, p, err)
	}
	return fmt.Errorf("%s %s: %w: %w", op, p, err, sentinel)
}

// readSmall reads a whole regular file of at most limit bytes.
func (r *fsRoot) readSmall(rel string, limit int64) ([]byte, error) {
	fd, err := r.open(rel, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY)
	if err != nil {
		return nil, err
	}
	// Raw reads, not an *os.File: this runs for every exec (passwd), and
	// a regular file gains nothing from the runtime poller.
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%s is not a regular file", rel)
	}
	b := make([]byte, 0, min(max(st.Size, 0), limit)+1) // +1: EOF in one read when the size holds
	for int64(len(b)) < limit {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := unix.Read(fd, b[len(b):min(int64(cap(b)), limit)])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: rel, Err: err}
		}
		if n == 0 {
			break
		}
		b = b[:len(b)+n]
	}
	return b, nil
}

// fileInfo builds the API description of a stat result.
func fileInfo(name, p string, st *unix.Stat_t, target string) api.FileInfo {
	typ := "other"
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		typ = "file"
	case unix.S_IFDIR:
		typ = "dir"
	case unix.S_IFLNK:
		typ = "symlink"
	}
	return api.FileInfo{
		Name:    name,
		Path:    p,
		Type:    typ,
		Size:    st.Size,
		Mode:    st.Mode & 0o7777,
		ModTime: time.Unix(st.Mtim.Unix()).UTC(),
		Target:  target,
		UID:     st.Uid,
		GID:     st.Gid,
	}
}

// lstatAt describes name in dirfd without following a final symlink.
func lstatAt(dirfd int, name, p string) (api.FileInfo, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return api.FileInfo{}, fsError("stat", p, err)
	}
	target := ""
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		target, _ = readlinkAt(dirfd, name)
	}
	return fileInfo(path.Base(p), p, &st, target), nil
}

func readlinkAt(dirfd int, name string) (string, error) {
	buf := make([]byte, agentproto.MaxPathLen+1)
	n, err := unix.Readlinkat(dirfd, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:min(n, agentproto.MaxPathLen)]), nil
}

// stat is lstat of rel inside the root.
func (r *fsRoot) stat(rel string) (api.FileInfo, error) {
	if rel == "." {
		var st unix.Stat_t
		if err := unix.Fstat(r.fd, &st); err != nil {
			return api.FileInfo{}, fsError("stat", "/", err)
		}
		return fileInfo("/", "/", &st, ""), nil
	}
	dfd, base, err := r.parent(rel)
	if err != nil {
		return api.FileInfo{}, err
	}
	defer unix.Close(dfd)
	return lstatAt(dfd, base, apiPath(rel))
}

// readDirNames lists a directory descriptor (which it does not close).
func readDirNames(fd int) ([]string, error) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(dup), "dir")
	defer f.Close()
	return f.Readdirnames(-1)
}

// list describes the entries of directory rel (following symlinks to it).
func (r *fsRoot) list(rel string) ([]api.FileInfo, error) {
	fd, err := r.open(rel, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return nil, fsError("list", apiPath(rel), err)
	}
	defer unix.Close(fd)
	names, err := readDirNames(fd)
	if err != nil {
		return nil, fsError("list", apiPath(rel), err)
	}
	out := make([]api.FileInfo, 0, len(names))
	for _, n := range names {
		fi, err := lstatAt(fd, n, path.Join(apiPath(rel), n))
		if err != nil {
			continue // removed while listing
		}
		out = append(out, fi)
	}
	return out, nil
}

// mkdirAll is mkdir -p of rel below the root, with perm for the
// directories it creates. Every step is resolved through the root.
func (r *fsRoot) mkdirAll(rel string, perm uint32) error {
	dirfd := r.fd
	if rel == "." {
		return nil
	}
	comps := strings.Split(rel, "/")
	for i := range comps {
		prefix := strings.Join(comps[:i+1], "/")
		fd, err := r.at(dirfd, prefix, unix.O_PATH|unix.O_DIRECTORY)
		if err == nil {
			unix.Close(fd)
			continue
		}
		if err != unix.ENOENT {
			return fsError("mkdir", apiPath(prefix), err)
		}
		parent := "."
		if i > 0 {
			parent = strings.Join(comps[:i], "/")
		}
		pfd, err := r.at(dirfd, parent, unix.O_PATH|unix.O_DIRECTORY)
		if err != nil {
			return fsError("mkdir", apiPath(prefix), err)
		}
		err = unix.Mkdirat(pfd, comps[i], perm)
		if err == nil {
			// Undo the umask, and never create set-id directories. Through a
			// descriptor opened without following: the name may have been
			// swapped for a symlink since mkdirat.
			if dfd, oerr := unix.Openat(pfd, comps[i], unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); oerr == nil {
				unix.Fchmod(dfd, perm&0o1777)
				unix.Close(dfd)
			}
		}
		unix.Close(pfd)
		if err != nil && err != unix.EEXIST {
			return fsError("mkdir", apiPath(prefix), err)
		}
	}
	fd, err := r.at(dirfd, rel, unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return fsError("mkdir", apiPath(rel), err)
	}
	unix.Close(fd)
	return nil
}

// remove deletes rel; a non-empty directory only when recursive.
func (r *fsRoot) remove(rel string, recursive bool) error {
	dfd, base, err := r.parent(rel)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	err = unix.Unlinkat(dfd, base, 0)
	if err == unix.EISDIR {
		err = unix.Unlinkat(dfd, base, unix.AT_REMOVEDIR)
		if (err == unix.ENOTEMPTY || err == unix.EEXIST) && recursive {
			err = removeTree(dfd, base, 0)
		}
	}
	if err != nil {
		return fsError("remove", apiPath(rel), err)
	}
	return nil
}

// removeTree removes directory name in dirfd and everything below it,
// never following symlinks.
func removeTree(dirfd int, name string, depth int) error {
	if depth > maxTreeDepth {
		return fmt.Errorf("directory tree deeper than %d: %w", maxTreeDepth, unix.ELOOP)
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	names, err := readDirNames(fd)
	if err != nil {
		unix.Close(fd)
		return err
	}
	for _, n := range names {
		err := unix.Unlinkat(fd, n, 0)
		if err == unix.EISDIR {
			err = removeTree(fd, n, depth+1)
		}
		if err != nil && err != unix.ENOENT {
			unix.Close(fd)
			return err
		}
	}
	unix.Close(fd)
	return unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

// rename moves from to to (replacing a file or empty directory at to).
func (r *fsRoot) rename(from, to string) error {
	ffd, fbase, err := r.parent(from)
	if err != nil {
		return err
	}
	defer unix.Close(ffd)
	tfd, tbase, err := r.parent(to)
	if err != nil {
		return err
	}
	defer unix.Close(tfd)
	if err := unix.Renameat(ffd, fbase, tfd, tbase); err != nil {
		return fsError("rename "+apiPath(from)+" to", apiPath(to), err)
	}
	return nil
}

// writeFile atomically replaces rel with the content of body: a temporary
// file in the same (already resolved) directory, fsync, renameat. The
// parent must exist. A symlink at rel is replaced, not followed. mode < 0
// keeps the mode of an existing file (0644 for a new one).
func (r *fsRoot) writeFile(rel string, mode int64, body io.Reader) (api.FileInfo, error) {
	dfd, base, err := r.parent(rel)
	if err != nil {
		return api.FileInfo{}, err
	}
	defer unix.Close(dfd)
	p := apiPath(rel)
	perm := uint32(0o644)
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			return api.FileInfo{}, fmt.Errorf("write %s: is a directory: %w", p, errdefs.ErrConflict)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFREG {
			perm = st.Mode & 0o7777
		}
	}
	if mode >= 0 {
		perm = uint32(mode)
	}
	var tmp string
	var fd int
	for i := 0; ; i++ {
		tmp = fmt.Sprintf(".space-tmp-%d-%d", os.Getpid(), time.Now().UnixNano()+int64(i))
		fd, err = unix.Openat(dfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != unix.EEXIST || i > 16 {
			break
		}
	}
	if err != nil {
		return api.FileInfo{}, fsError("write", p, err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	fail := func(err error) (api.FileInfo, error) {
		f.Close()
		unix.Unlinkat(dfd, tmp, 0)
		return api.FileInfo{}, err
	}
	if _, err := io.Copy(f, body); err != nil {
		var errno unix.Errno
		if errors.As(err, &errno) {
			return fail(fsError("write", p, err))
		}
		return fail(fmt.Errorf("write %s: reading request body: %w: %w", p, err, errdefs.ErrInvalidArgument))
	}
	if err := unix.Fchmod(fd, perm); err != nil {
		return fail(fsError("chmod", p, err))
	}
	if err := f.Sync(); err != nil {
		return fail(fsError("fsync", p, err))
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return fail(fsError("stat", p, err))
	}
	if err := unix.Renameat(dfd, tmp, dfd, base); err != nil {
		return fail(fsError("write", p, err))
	}
	f.Close()
	unix.Fsync(dfd) // make the rename durable
	return fileInfo(base, p, &st, ""), nil
}

// maxSymlinks bounds the symlinks one resolution follows, as the kernel's
// MAXSYMLINKS does.
const maxSymlinks = 40

// resolvePath is the path rel reaches with every symlink on the way
// resolved inside the root, as RESOLVE_IN_ROOT resolves it ("/" and ".."
// stop at the root). With followLeaf false the final component is kept as
// named (the operation acts on it, not on what it points to). From the
// first component that does not exist on, the rest is kept lexically: the
// operation creates it, or fails. Each step opens the part resolved so far
// with symlinks refused, so a swap mid-walk is an error, not a detour.
func (r *fsRoot) resolvePath(rel string, followLeaf bool) (string, error) {
	todo := splitPath(rel)
	var done []string
	links := 0
	for len(todo) > 0 {
		c := todo[0]
		todo = todo[1:]
		if c == ".." {
			if len(done) > 0 {
				done = done[:len(done)-1]
			}
			continue
		}
		if len(todo) == 0 && !followLeaf {
			done = append(done, c)
			break
		}
		dir := "."
		if len(done) > 0 {
			dir = strings.Join(done, "/")
		}
		dfd, err := openat2With(r.fd, dir, unix.O_PATH|unix.O_DIRECTORY, 0, unix.RESOLVE_NO_SYMLINKS)
		if err != nil {
			return "", fsError("resolve", apiPath(dir), err)
		}
		var st unix.Stat_t
		err = unix.Fstatat(dfd, c, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
			var target string
			target, err = readlinkAt(dfd, c)
			unix.Close(dfd)
			if err != nil {
				return "", fsError("resolve", apiPath(path.Join(dir, c)), err)
			}
			if links++; links > maxSymlinks {
				return "", fsError("resolve", apiPath(rel), unix.ELOOP)
			}
			if strings.HasPrefix(target, "/") {
				done = done[:0]
			}
			todo = append(splitPath(target), todo...)
			continue
		}
		unix.Close(dfd)
		if err != nil {
			// Missing (or not a directory): the rest is what the operation
			// will try to create or fail on, named as asked.
			if err != unix.ENOENT && err != unix.ENOTDIR {
				return "", fsError("resolve", apiPath(path.Join(dir, c)), err)
			}
			rest := path.Clean("/" + strings.Join(append([]string{c}, todo...), "/"))
			return path.Clean("/" + strings.Join(done, "/") + rest), nil
		}
		done = append(done, c)
	}
	return "/" + strings.Join(done, "/"), nil
}

// splitPath is the non-empty, non-"." components of p.
func splitPath(p string) []string {
	var out []string
	for _, c := range strings.Split(p, "/") {
		if c != "" && c != "." {
			out = append(out, c)
		}
	}
	return out
}
