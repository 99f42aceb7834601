package sdk

import (
	"archive/tar"
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// BuildFileDir is the top-level directory of a build context tar that
// carries a build file from outside the context. The server reads the
// build file from it and removes it before the build, so COPY never sees
// it.
const BuildFileDir = ".space-build"

// maxDockerignore bounds a .dockerignore file.
const maxDockerignore = 1 << 20

// buildFileEntry resolves the build file of a context directory: its path
// inside the context (the `file` parameter), and, for a build file outside
// the context, the host path to send as BuildFileDir/<name>.
func buildFileEntry(contextDir, file string) (inContext, extra string, err error) {
	if file == "" {
		file = "Dockerfile"
	}
	root, err := filepath.Abs(contextDir)
	if err != nil {
		return "", "", err
	}
	p := file
	if !filepath.IsAbs(p) {
		p = filepath.Join(root, p)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return "", "", fmt.Errorf("build file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return "", "", fmt.Errorf("build file %s is not a regular file: %w", p, errdefs.ErrInvalidArgument)
	}
	rel, err := filepath.Rel(root, p)
	if err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		if lfi, err := os.Lstat(p); err == nil && lfi.Mode().IsRegular() {
			return filepath.ToSlash(rel), "", nil
		}
		// A symlink inside the context may point anywhere; send the file
		// it names instead.
	}
	return BuildFileDir + "/" + filepath.Base(p), p, nil
}

// ignoreRule is one line of a .dockerignore.
type ignoreRule struct {
	neg  bool
	segs []string
}

// dockerignore decides which context paths are left out. Supported syntax:
// blank lines and "#" comments; one pattern per line, relative to the
// context root (a leading "/" is ignored, the pattern is path.Clean'ed);
// "*", "?", "[…]" and "\" escapes within one path component (path.Match);
// "**" as a whole component matches any number of components; a pattern
// that matches a directory excludes everything below it; "!" re-includes
// what an earlier pattern excluded (the last matching line wins). Not
// supported (refused with the line number): patterns that climb out of the
// context with "..", and malformed patterns.
type dockerignore struct {
	rules     []ignoreRule
	negations bool
}

func readDockerignore(dir string) (*dockerignore, error) {
	f, err := os.Open(filepath.Join(dir, ".dockerignore"))
	if errors.Is(err, os.ErrNotExist) {
		return &dockerignore{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	defer f.Close()
	return parseDockerignore(io.LimitReader(f, maxDockerignore))
}

func parseDockerignore(r io.Reader) (*dockerignore, error) {
	d := &dockerignore{}
	sc := bufio.NewScanner(r)
	n := 0
	for sc.Scan() {
		n++
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		neg := strings.HasPrefix(l, "!")
		if neg {
			l = strings.TrimSpace(l[1:])
		}
		l = path.Clean(strings.TrimLeft(l, "/"))
		if l == "." {
			continue
		}
		if l == ".." || strings.HasPrefix(l, "../") {
			return nil, fmt.Errorf(".dockerignore line %d: pattern %q points outside the context: %w", n, sc.Text(), errdefs.ErrInvalidArgument)
		}
		segs := strings.Split(l, "/")
		for _, s := range segs {
			if _, err := path.Match(s, ""); err != nil {
				return nil, fmt.Errorf(".dockerignore line %d: bad pattern %q: %w: %w", n, sc.Text(), err, errdefs.ErrInvalidArgument)
			}
		}
		d.rules = append(d.rules, ignoreRule{neg: neg, segs: segs})
		d.negations = d.negations || neg
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf(".dockerignore: %w", err)
	}
	return d, nil
}

// excluded reports whether the context path rel ("a/b", slash-separated)
// is left out.
func (d *dockerignore) excluded(rel string) bool {
	if len(d.rules) == 0 {
		return false
	}
	parts := strings.Split(rel, "/")
	ex := false
	for _, r := range d.rules {
		// A rule matches a path or any directory above it.
		for n := len(parts); n >= 1; n-- {
			if matchSegs(r.segs, parts[:n]) {
				ex = !r.neg
				break
			}
		}
	}
	return ex
}

// matchSegs matches path components against pattern components, "**"
// standing for any number of components.
func matchSegs(pat, name []string) bool {
	for len(pat) > 0 {
		if pat[0] == "**" {
			pat = pat[1:]
			if len(pat) == 0 {
				return true
			}
			for i := 0; i <= len(name); i++ {
				if matchSegs(pat, name[i:]) {
					return true
				}
			}
			return false
		}
		if len(name) == 0 {
			return false
		}
		if ok, _ := path.Match(pat[0], name[0]); !ok {
			return false
		}
		pat, name = pat[1:], name[1:]
	}
	return len(name) == 0
}

// writeBuildContext writes dir as a tar to w: regular files, directories
// and symlinks (as symlinks, never followed) with their modes and times,
// owned by 0:0 (a build copies files as root unless told otherwise, and the
// host's uids are nobody's business); other file types are left out.
// Entries ign excludes are skipped, except buildFile, which is always sent.
// extra, if set, is a host file sent as BuildFileDir/<name> (the context's
// own BuildFileDir is then left out).
func writeBuildContext(w io.Writer, dir string, ign *dockerignore, buildFile, extra string) error {
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return fmt.Errorf("build context: %w", err)
	}
	tw := tar.NewWriter(w)
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("build context: %w", err)
		}
		if p == root {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if extra != "" && (rel == BuildFileDir || strings.HasPrefix(rel, BuildFileDir+"/")) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if rel != buildFile && ign.excluded(rel) {
			if d.IsDir() && !ign.negations && !strings.HasPrefix(buildFile, rel+"/") {
				return filepath.SkipDir
			}
			return nil // children may still be re-included; parents are implied
		}
		return addEntry(tw, p, rel)
	})
	if err != nil {
		return err
	}
	if extra != "" {
		now := time.Now()
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: BuildFileDir + "/", Mode: 0o755, ModTime: now, Format: tar.FormatPAX}); err != nil {
			return err
		}
		if err := addEntry(tw, extra, BuildFileDir+"/"+filepath.Base(extra)); err != nil {
			return err
		}
	}
	return tw.Close()
}

// addEntry writes the file at host path p as the tar entry name.
func addEntry(tw *tar.Writer, p, name string) error {
	fi, err := os.Lstat(p)
	if err != nil {
		return fmt.Errorf("build context: %w", err)
	}
	link := ""
	switch {
	case fi.Mode().IsRegular(), fi.IsDir():
	case fi.Mode()&fs.ModeSymlink != 0:
		if link, err = os.Readlink(p); err != nil {
			return fmt.Errorf("build context: %w", err)
		}
	default:
		return nil // devices, sockets, FIFOs have no place in a build context
	}
	h, err := tar.FileInfoHeader(fi, link)
	if err != nil {
		return fmt.Errorf("build context: %s: %w", p, err)
	}
	h.Name = name
	if fi.IsDir() {
		h.Name += "/"
	}
	h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
	h.AccessTime, h.ChangeTime = time.Time{}, time.Time{}
	h.Format = tar.FormatPAX
	if !fi.Mode().IsRegular() {
		return tw.WriteHeader(h)
	}
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("build context: %w", err)
	}
	defer f.Close()
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	if n, err := io.CopyN(tw, f, h.Size); err != nil {
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("build context: %s shrank while being read (%d of %d bytes)", p, n, h.Size)
		}
		return fmt.Errorf("build context: %s: %w", p, err)
	}
	return nil
}
