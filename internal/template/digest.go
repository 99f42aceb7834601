package template

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
)

// digestVersion is hashed first, so a future change of the canonical form
// can never collide with today's digests.
const digestVersion = "space-template-tree-v1\n"

// treeDigest computes the content digest of the tree at root and its size
// (bytes of regular file content, each inode once).
//
// The canonical description is one line per entry in the deterministic order
// of a sorted depth-first walk:
//
//	<quoted path> <type> <mode octal> <uid> <gid> <size> <detail>
//
// where detail is the SHA-256 of a regular file's content, the quoted target
// of a symlink, "link <quoted path>" for the second and later names of a
// hard-linked inode (pointing at its first name in walk order), or "-".
// An entry with user.* extended attributes (the only namespace the stager
// ever sets, see keepXattr) gets a suffix of one ` x <quoted name>=<hex
// value>` per attribute, sorted by name; entries without any have none, so
// trees without xattrs keep the digests they always had. Other namespaces
// are host-specific (SELinux labels, ACLs) and not part of the content.
// Times and inode numbers are not part of it, so the same tree imported
// twice, from a directory or from a tar, has the same digest.
//
// With ref, a file that is the very inode ref's tree has at the same path
// (a Derive clone shares unchanged files with its parent by hard links, and
// stored inodes are never written) takes its content hash from ref.sums
// instead of being read again. sums returns every regular file's hash by
// path, for the next tree to reuse.
func treeDigest(root string, ref *treeRef) (digest string, size int64, sums map[string]string, err error) {
	sums = map[string]string{}
	h := sha256.New()
	io.WriteString(h, digestVersion)
	type inode struct{ dev, ino uint64 }
	seen := map[inode]string{}
	buf := make([]byte, 1<<20)
	xbuf := make([]byte, 4096)
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return fmt.Errorf("stat %s: %w", p, err)
		}
		mode := st.Mode & 0o7777
		var typ, detail string
		var esize int64
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			typ, detail = "dir", "-"
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			typ, detail = "symlink", strconv.Quote(target)
			esize = int64(len(target))
			mode = 0o777 // symlink modes mean nothing on Linux
		case unix.S_IFREG:
			typ, esize = "file", st.Size
			key := inode{uint64(st.Dev), st.Ino}
			if first, ok := seen[key]; ok && st.Nlink > 1 {
				detail = "link " + strconv.Quote(first)
				break
			}
			if st.Nlink > 1 {
				seen[key] = rel
			}
			sum, ok := ref.reuse(rel, &st)
			if !ok {
				if sum, err = fileSHA256(p, buf); err != nil {
					return err
				}
			}
			sums[rel] = sum
			detail = sum
			size += st.Size
		case unix.S_IFIFO:
			typ, detail = "fifo", "-"
		default:
			// The stager never creates anything else.
			return fmt.Errorf("unexpected file type %o at %s", st.Mode&unix.S_IFMT, p)
		}
		xs, err := xattrSuffix(p, &xbuf)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s %s %o %d %d %d %s%s\n", strconv.Quote(filepath.ToSlash(rel)), typ, mode, st.Uid, st.Gid, esize, detail, xs)
		return nil
	})
	if err != nil {
		return "", 0, nil, fmt.Errorf("digest %s: %w", root, err)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), size, sums, nil
}

// xattrSuffix returns the digest suffix for p's user.* extended attributes
// ("" when it has none or the filesystem has no xattrs).
func xattrSuffix(p string, buf *[]byte) (string, error) {
	n, err := unix.Llistxattr(p, *buf)
	if errors.Is(err, unix.ERANGE) {
		if n, err = unix.Llistxattr(p, nil); err == nil {
			*buf = make([]byte, n+64)
			n, err = unix.Llistxattr(p, *buf)
		}
	}
	if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("list xattrs of %s: %w", p, err)
	}
	var names []string
	for _, name := range strings.Split(string((*buf)[:n]), "\x00") {
		if keepXattr(name) {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return "", nil
	}
	sort.Strings(names)
	var b strings.Builder
	for _, name := range names {
		v, err := lgetxattr(p, name)
		if errors.Is(err, unix.ENODATA) {
			continue // removed meanwhile
		}
		if err != nil {
			return "", fmt.Errorf("read xattr %s of %s: %w", name, p, err)
		}
		fmt.Fprintf(&b, " x %s=%s", strconv.Quote(name), hex.EncodeToString(v))
	}
	return b.String(), nil
}

func lgetxattr(p, name string) ([]byte, error) {
	v := make([]byte, 256)
	for {
		n, err := unix.Lgetxattr(p, name, v)
		if errors.Is(err, unix.ERANGE) {
			if n, err = unix.Lgetxattr(p, name, nil); err != nil {
				return nil, err
			}
			v = make([]byte, n+64)
			continue
		}
		if err != nil {
			return nil, err
		}
		return v[:n], nil
	}
}

func fileSHA256(p string, buf []byte) (string, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var fh hash.Hash = sha256.New()
	if _, err := io.CopyBuffer(fh, f, buf); err != nil {
		return "", fmt.Errorf("read %s: %w", p, err)
	}
	return hex.EncodeToString(fh.Sum(nil)), nil
}

// imageDigest is the digest of a template: its tree's digest when it has no
// defaults (so plain trees keep the digest they always had), otherwise the
// SHA-256 of the tree digest and the canonical JSON of the defaults
// (encoding/json sorts map keys, so the form is deterministic).
func imageDigest(tree string, cfg api.TemplateConfig) string {
	if isZeroConfig(cfg) {
		return tree
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		panic(err) // only strings, maps and slices: cannot fail
	}
	h := sha256.New()
	io.WriteString(h, "space-template-v1\n")
	io.WriteString(h, tree+"\n")
	h.Write(b)
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

func isZeroConfig(c api.TemplateConfig) bool {
	return len(c.Env) == 0 && c.Workdir == "" && c.User == "" && c.Start == nil
}

// treeRef is a stored tree whose file hashes a digest may reuse.
type treeRef struct {
	root string
	sums map[string]string
}

func (r *treeRef) reuse(rel string, st *unix.Stat_t) (string, bool) {
	if r == nil {
		return "", false
	}
	sum, ok := r.sums[rel]
	if !ok {
		return "", false
	}
	// rel is a regular file's walked path in r's tree (no symlink on the
	// way), so this lstat names exactly that file.
	var pst unix.Stat_t
	if unix.Lstat(filepath.Join(r.root, rel), &pst) != nil || pst.Dev != st.Dev || pst.Ino != st.Ino {
		return "", false
	}
	return sum, true
}

// sumsFile sits next to a stored tree's rootfs: its files' content hashes.
const sumsFile = "sums"

func writeSums(dir string, sums map[string]string) error {
	keys := make([]string, 0, len(sums))
	for k := range sums {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		b.WriteString(sums[k])
		b.WriteByte(' ')
		b.WriteString(strconv.Quote(k))
		b.WriteByte('\n')
	}
	return os.WriteFile(filepath.Join(dir, sumsFile), []byte(b.String()), 0o600)
}

// readSums loads a stored tree's hashes; a missing or damaged file just
// means nothing is reused.
func readSums(dir string) map[string]string {
	b, err := os.ReadFile(filepath.Join(dir, sumsFile))
	if err != nil {
		return nil
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		sum, q, ok := strings.Cut(line, " ")
		if !ok || len(sum) != 64 {
			continue
		}
		rel, err := strconv.Unquote(q)
		if err != nil {
			return nil
		}
		out[rel] = sum
	}
	return out
}
