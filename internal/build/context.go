package build

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// buildContext is the host directory COPY and ADD read from. Every source
// path is resolved beneath it with openat2(RESOLVE_BENEATH): a "..", an
// absolute path, or a symlink that leads out of it (or is absolute) is an
// error, never followed. The directory is the server's own extraction of
// the client's upload, so it does not change while the build reads it.
type buildContext struct {
	dir  string   // real path
	root *os.File // O_PATH descriptor of dir
}

// source is one COPY/ADD source after resolution.
type source struct {
	name string // relative to the context, as matched ("" is the context itself)
	path string // real host path (symlinks in name resolved)
	dir  bool
}

func openContext(dir string) (*buildContext, error) {
	if dir == "" {
		return nil, fmt.Errorf("no build context directory was given: %w", errdefs.ErrInvalidArgument)
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	f, err := os.OpenFile(real, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	return &buildContext{dir: real, root: f}, nil
}

func (c *buildContext) close() {
	if c != nil {
		c.root.Close()
	}
}

func hasMeta(s string) bool { return strings.ContainsAny(s, `*?[\`) }

// resolve returns the sources pattern names: one path, or every match of a
// filepath.Match pattern, in lexical order.
func (c *buildContext) resolve(pattern string) ([]source, error) {
	if pattern == "" {
		return nil, invalidf("empty source")
	}
	if strings.HasPrefix(pattern, "/") {
		return nil, invalidf("source %q is an absolute path; sources are relative to the build context", pattern)
	}
	clean := path.Clean(pattern)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return nil, invalidf("source %q is outside the build context (it climbs out with ..)", pattern)
	}
	if clean == "." {
		clean = ""
	}
	if !hasMeta(clean) {
		s, err := c.open(clean, pattern)
		if err != nil {
			return nil, err
		}
		return []source{s}, nil
	}
	if _, err := path.Match(clean, ""); err != nil {
		return nil, invalidf("source pattern %q: %v", pattern, err)
	}
	cands := []string{""}
	for _, comp := range strings.Split(clean, "/") {
		var next []string
		for _, cand := range cands {
			if !hasMeta(comp) {
				next = append(next, path.Join(cand, comp))
				continue
			}
			names, err := c.list(cand, pattern)
			if err != nil {
				return nil, err
			}
			for _, n := range names {
				if ok, _ := path.Match(comp, n); ok {
					next = append(next, path.Join(cand, n))
				}
			}
		}
		cands = next
	}
	var out []source
	for _, cand := range cands {
		s, err := c.open(cand, pattern)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no file in the build context matches %q: %w", pattern, errdefs.ErrNotFound)
	}
	return out, nil
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
}

// openBeneath opens rel under the context root without ever leaving it.
func (c *buildContext) openBeneath(rel string, flags uint64) (int, error) {
	if rel == "" {
		rel = "."
	}
	return unix.Openat2(int(c.root.Fd()), rel, &unix.OpenHow{
		Flags:   flags | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS,
	})
}

func (c *buildContext) openErr(rel, pattern string, err error) error {
	switch {
	case errors.Is(err, unix.EXDEV):
		return invalidf("source %q resolves outside the build context (a symlink on the way leads out of it or is absolute)", pattern)
	case errors.Is(err, unix.ELOOP):
		return invalidf("source %q: too many levels of symlinks", pattern)
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("source %q: %q not found in the build context: %w", pattern, rel, errdefs.ErrNotFound)
	case errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("source %q: a component of %q is not a directory: %w", pattern, rel, errdefs.ErrNotFound)
	}
	return fmt.Errorf("source %q: %w", pattern, err)
}

// open resolves rel (following symlinks, but only inside the context).
func (c *buildContext) open(rel, pattern string) (source, error) {
	fd, err := c.openBeneath(rel, unix.O_PATH)
	if err != nil {
		return source{}, c.openErr(rel, pattern, err)
	}
	defer unix.Close(fd)
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return source{}, err
	}
	// Defence in depth: RESOLVE_BENEATH already guarantees this.
	if real != c.dir && !strings.HasPrefix(real, c.dir+"/") {
		return source{}, invalidf("source %q resolves outside the build context", pattern)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return source{}, err
	}
	return source{name: rel, path: real, dir: st.Mode&unix.S_IFMT == unix.S_IFDIR}, nil
}

// list returns the names in directory rel (none if it is not a directory).
func (c *buildContext) list(rel, pattern string) ([]string, error) {
	fd, err := c.openBeneath(rel, unix.O_RDONLY|unix.O_DIRECTORY)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return nil, nil
	}
	if err != nil {
		return nil, c.openErr(rel, pattern, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, fmt.Errorf("read %q in the build context: %w", rel, err)
	}
	sort.Strings(names)
	return names, nil
}

// digestSources hashes what a COPY reads: for each source its matched
// name, then every entry below it in a sorted walk with its relative name,
// type, permission bits, content digest, symlink target or hard link
// target. Times and owners are left out: COPY does not keep them (the
// owner is root or --chown), so they cannot change the result.
func digestSources(ctx context.Context, srcs []source) (string, error) {
	h := sha256.New()
	io.WriteString(h, "space-build-sources-v1\n")
	buf := make([]byte, 256<<10)
	for _, s := range srcs {
		fmt.Fprintf(h, "source %s\n", strconv.Quote(s.name))
		type inode struct{ dev, ino uint64 }
		seen := map[inode]string{}
		n := 0
		err := filepath.WalkDir(s.path, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if n++; n%256 == 0 {
				if err := ctx.Err(); err != nil {
					return err
				}
			}
			rel, err := filepath.Rel(s.path, p)
			if err != nil {
				return err
			}
			var st unix.Stat_t
			if err := unix.Lstat(p, &st); err != nil {
				return err
			}
			var typ, detail string
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFDIR:
				typ = "dir"
			case unix.S_IFLNK:
				target, err := os.Readlink(p)
				if err != nil {
					return err
				}
				typ, detail = "symlink", strconv.Quote(target)
			case unix.S_IFREG:
				typ = "file"
				key := inode{uint64(st.Dev), st.Ino}
				if first, ok := seen[key]; ok && st.Nlink > 1 {
					detail = "link " + strconv.Quote(first)
					break
				}
				if st.Nlink > 1 {
					seen[key] = rel
				}
				sum, err := fileDigest(p, buf)
				if err != nil {
					return err
				}
				detail = strconv.FormatInt(st.Size, 10) + " " + sum
			case unix.S_IFIFO:
				typ = "fifo"
			default:
				typ = "other" // skipped by the copy
			}
			fmt.Fprintf(h, "%s %s %o %s\n", strconv.Quote(filepath.ToSlash(rel)), typ, st.Mode&0o7777, detail)
			return nil
		})
		if err != nil {
			return "", fmt.Errorf("read source %q: %w", s.name, err)
		}
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

func fileDigest(p string, buf []byte) (string, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var fh hash.Hash = sha256.New()
	if _, err := io.CopyBuffer(fh, f, buf); err != nil {
		return "", err
	}
	return hex.EncodeToString(fh.Sum(nil)), nil
}

// archiveKind returns what kind of archive Docker's ADD would extract the
// file at p as ("" when it would copy it as is): a tar stream, plain or
// compressed. xz and zstd cannot be looked into here; they count as
// archives, so that ADD errors rather than silently differ from Docker.
func archiveKind(p string) (string, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	br := bufio.NewReader(f)
	head, _ := br.Peek(6)
	var r io.Reader = br
	kind := "tar"
	switch {
	case bytes.HasPrefix(head, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return "", nil
		}
		r, kind = zr, "gzip-compressed tar"
	case bytes.HasPrefix(head, []byte("BZh")):
		r, kind = bzip2.NewReader(br), "bzip2-compressed tar"
	case bytes.HasPrefix(head, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		return "xz-compressed file", nil
	case bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return "zstd-compressed file", nil
	}
	if _, err := tar.NewReader(r).Next(); err != nil {
		return "", nil
	}
	return kind, nil
}
