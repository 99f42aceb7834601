package template

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"context"
	"encoding/json"
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

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// ImportDir copies the tree at src into the store (never following symlinks
// inside it) and returns the resulting template. Identical trees dedup to
// one template; the options' tags are applied either way.
func (s *Store) ImportDir(ctx context.Context, src string, o ImportOptions) (api.Template, error) {
	fi, err := os.Stat(src) // src itself may be a symlink to the tree
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return api.Template{}, fmt.Errorf("import source %s: %w", src, errdefs.ErrNotFound)
		}
		return api.Template{}, fmt.Errorf("import source: %w", err)
	}
	if !fi.IsDir() {
		return api.Template{}, fmt.Errorf("import source %s is not a directory: %w", src, errdefs.ErrInvalidArgument)
	}
	if src, err = filepath.EvalSymlinks(src); err != nil {
		return api.Template{}, err
	}
	if o.Source == "" {
		o.Source = "dir"
	}
	total := 0
	if o.Progress != nil {
		// One cheap extra walk buys progress with a known total.
		_ = filepath.WalkDir(src, func(string, fs.DirEntry, error) error { total++; return nil })
	}
	return s.importWith(ctx, o, func(st *stager) error { return copyTree(ctx, st, src, "", nil, total, o.Progress) })
}

// ImportTar extracts a plain or gzip-compressed tar stream into the store.
// The archive is untrusted: see stager for what is rejected, skipped and
// dropped. A truncated or corrupt archive fails with ErrInvalidArgument, a
// too large one with ErrTooLarge, and neither leaves anything behind.
func (s *Store) ImportTar(ctx context.Context, r io.Reader, o ImportOptions) (api.Template, error) {
	if o.Source == "" {
		o.Source = "tar"
	}
	return s.importWith(ctx, o, func(st *stager) error { return extractTar(ctx, st, r, o.Progress, nil) })
}

// importWith stages a tree with fill, digests it and commits it. late
// functions may change the options after fill (an archive's header is
// read by fill); a parent they set is kept verbatim (it may live on
// another host).
func (s *Store) importWith(ctx context.Context, o ImportOptions, fill func(*stager) error, late ...func(*ImportOptions)) (api.Template, error) {
	tags := make([]string, 0, len(o.Tags))
	for _, t := range o.Tags {
		norm, err := ParseTag(t)
		if err != nil {
			return api.Template{}, err
		}
		tags = append(tags, norm)
	}
	if o.MaxBytes < 0 {
		return api.Template{}, fmt.Errorf("negative MaxBytes: %w", errdefs.ErrInvalidArgument)
	}
	parent := ""
	if o.Parent != "" {
		d, err := s.resolveDigest(ctx, o.Parent)
		if err != nil {
			return api.Template{}, fmt.Errorf("parent: %w", err)
		}
		parent = d
	}

	stage, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "import-")
	if err != nil {
		return api.Template{}, fmt.Errorf("create staging dir: %w", err)
	}
	// Whatever happens below, the staging dir goes (after a successful
	// commit it has been renamed away and this is a no-op).
	defer os.RemoveAll(stage)
	rootfs := filepath.Join(stage, "rootfs")
	if err := os.Mkdir(rootfs, 0o700); err != nil {
		return api.Template{}, err
	}
	st, err := newStager(rootfs, o.MaxBytes, s.log)
	if err != nil {
		return api.Template{}, err
	}
	err = fill(st)
	if err == nil {
		err = st.finish()
	}
	skipped := st.skipped
	st.close()
	if err != nil {
		return api.Template{}, err
	}
	if err := ctx.Err(); err != nil {
		return api.Template{}, err
	}
	for _, f := range late {
		before := o.Parent
		f(&o)
		if o.Parent != before {
			if !strings.HasPrefix(o.Parent, "sha256:") || !hexDigest.MatchString(strings.TrimPrefix(o.Parent, "sha256:")) {
				return api.Template{}, invalid("parent %q is not a digest", o.Parent)
			}
			parent = o.Parent
		}
	}
	if err := ValidateConfig(o.Config); err != nil {
		return api.Template{}, err
	}
	progress(o.Progress, Progress{Phase: PhaseImport, Message: "computing digest"})
	tree, size, sums, err := treeDigest(rootfs, nil)
	if err != nil {
		return api.Template{}, err
	}
	if err := writeSums(stage, sums); err != nil {
		return api.Template{}, err
	}
	rec := record{tree: tree, size: size, source: o.Source, parent: parent, config: o.Config, layers: o.Layers}
	if o.ExpectDigest != "" {
		if d := imageDigest(tree, o.Config); d != o.ExpectDigest {
			return api.Template{}, invalid("digest mismatch: the content is %s, the archive claims %s", d, o.ExpectDigest)
		}
	}
	t, err := s.commit(ctx, stage, rec, tags)
	if err != nil {
		return api.Template{}, err
	}
	s.log.Info("template imported", "digest", t.Digest, "size", t.SizeBytes, "source", t.Source,
		"tags", t.Tags, "skipped_entries", skipped)
	return t, nil
}

// record is one template's metadata row.
type record struct {
	tree   string
	size   int64
	source string
	parent string
	config api.TemplateConfig
	layers []api.TemplateLayer
}

// commit moves a staged tree to <dir>/<tree hex> and records the template,
// or, when that tree is already stored, keeps the existing copy (stage may
// then be ""). Either way the tags then point at the template.
func (s *Store) commit(ctx context.Context, stage string, rec record, tags []string) (api.Template, error) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	digest := imageDigest(rec.tree, rec.config)
	cfg, err := json.Marshal(rec.config)
	if err != nil {
		return api.Template{}, err
	}
	if rec.layers == nil {
		rec.layers = []api.TemplateLayer{}
	}
	layers, err := json.Marshal(rec.layers)
	if err != nil {
		return api.Template{}, err
	}
	final := filepath.Join(s.dir, strings.TrimPrefix(rec.tree, "sha256:"))
	if _, err := os.Stat(final); errors.Is(err, os.ErrNotExist) {
		if stage == "" {
			return api.Template{}, fmt.Errorf("tree %s is not stored: %w", rec.tree, errdefs.ErrNotFound)
		}
		// Durability order: staged data on disk, then the rename, then the
		// record. A crash before the record leaves an unrecorded content
		// directory, which the next import of it adopts or Open removes.
		if err := syncFS(stage); err != nil {
			return api.Template{}, err
		}
		if err := os.Chmod(stage, 0o700); err != nil {
			return api.Template{}, err
		}
		if err := os.Rename(stage, final); err != nil && !errors.Is(err, os.ErrExist) && !errors.Is(err, unix.ENOTEMPTY) {
			return api.Template{}, fmt.Errorf("move template into place: %w", err)
		}
		if err := syncDir(s.dir); err != nil {
			return api.Template{}, err
		}
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return api.Template{}, err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO template_images (digest, tree, size_bytes, source, parent, config, layers, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (digest) DO NOTHING`,
		digest, rec.tree, rec.size, rec.source, rec.parent, string(cfg), string(layers), time.Now().UnixNano()); err != nil {
		return api.Template{}, fmt.Errorf("record template %s: %w", digest, err)
	}
	for _, t := range tags {
		if _, err := tx.ExecContext(ctx, `INSERT INTO template_tags (ref, digest) VALUES (?, ?)
ON CONFLICT (ref) DO UPDATE SET digest = excluded.digest`, t, digest); err != nil {
			return api.Template{}, fmt.Errorf("tag %s as %s: %w", digest, t, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return api.Template{}, fmt.Errorf("record template %s: %w", digest, err)
	}
	return s.Get(ctx, digest)
}

func syncFS(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return fmt.Errorf("syncfs %s: %w", p, err)
	}
	return nil
}

func syncDir(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

func progress(fn func(Progress), p Progress) {
	if fn != nil {
		fn(p)
	}
}

// copyTree feeds the tree at src to st, below prefix ("" = the root). With
// owner set, every entry gets that uid and gid instead of its own.
func copyTree(ctx context.Context, st *stager, src, prefix string, owner *[2]int, total int, prog func(Progress)) error {
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	n := 0
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("read source: %w", err)
		}
		if n++; n%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
			progress(prog, Progress{Phase: PhaseImport, Done: n, Total: max(total, n), Message: "copying files"})
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if rel == "." {
			rel = ""
		}
		rel = path.Join(prefix, rel)
		var sys unix.Stat_t
		if err := unix.Lstat(p, &sys); err != nil {
			return fmt.Errorf("stat %s: %w", p, err)
		}
		m := meta{
			mode:  sys.Mode & 0o7777,
			uid:   int(sys.Uid),
			gid:   int(sys.Gid),
			mtime: time.Unix(sys.Mtim.Unix()),
			atime: time.Unix(sys.Atim.Unix()),
		}
		if owner != nil {
			m.uid, m.gid = owner[0], owner[1]
		}
		switch sys.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			return st.dir(rel, m)
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return st.symlink(rel, target, m)
		case unix.S_IFREG:
			if sys.Nlink > 1 {
				key := inode{uint64(sys.Dev), sys.Ino}
				if first, ok := links[key]; ok {
					return st.hardlink(rel, first)
				}
				links[key] = rel
			}
			f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			err = st.file(rel, m, sys.Size, f)
			var short *shortReadError
			if errors.As(err, &short) {
				return fmt.Errorf("%s changed during import (%v): %w", p, err, errdefs.ErrConflict)
			}
			return err
		case unix.S_IFIFO:
			return st.fifo(rel, m)
		case unix.S_IFCHR, unix.S_IFBLK:
			st.skip(rel, "device node")
			return nil
		default:
			st.skip(rel, "socket")
			return nil
		}
	})
}

// countingReader counts the bytes the tar reader consumed and whether the
// stream ended on end-of-archive zero blocks.
type countingReader struct {
	r        io.Reader
	n        int64
	zeroTail int64 // length of the run of zero bytes at the end of what was read
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	chunk := p[:n]
	i := len(chunk)
	for i > 0 && chunk[i-1] == 0 {
		i--
	}
	if i == 0 {
		c.zeroTail += int64(n)
	} else {
		c.zeroTail = int64(len(chunk) - i)
	}
	return n, err
}

// unsupportedCompression are formats recognised only to say so clearly.
var unsupportedCompression = []struct {
	name  string
	magic []byte
}{
	{"zstd", []byte{0x28, 0xb5, 0x2f, 0xfd}},
	{"xz", []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}},
	{"bzip2", []byte("BZh")},
}

// maxTrailing bounds how much of a compressed stream after the tar's end is
// decompressed to verify the gzip checksum (tar pads to 10 KiB records).
const maxTrailing = 1 << 20

// tarHooks adapt extractTar to archives that wrap a tree.
type tarHooks struct {
	// first, if set, consumes the first entry (a header file); it fails
	// the import when it returns an error.
	first func(hdr *tar.Header, r io.Reader) error
	// prefix is the directory the tree lives under; entries outside it are
	// an error.
	prefix string
}

func extractTar(ctx context.Context, st *stager, r io.Reader, prog func(Progress), hooks *tarHooks) error {
	br := bufio.NewReaderSize(r, 64<<10)
	// A tar's first member name could start with any of these magics, so
	// only a stream without the ustar magic at offset 257 is suspected.
	if head, _ := br.Peek(512); len(head) > 0 && !(len(head) >= 262 && string(head[257:262]) == "ustar") {
		for _, c := range unsupportedCompression {
			if bytes.HasPrefix(head, c.magic) {
				return invalid("archive is %s-compressed; only plain and gzip tar are supported", c.name)
			}
		}
	}
	magic, err := br.Peek(2)
	if len(magic) == 0 {
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("read archive: %w", err)
		}
		return invalid("archive is empty")
	}
	var (
		stream io.Reader = br
		gz     *gzip.Reader
	)
	if len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err = gzip.NewReader(br)
		if err != nil {
			return archiveErr(err, "gzip header", 0, true)
		}
		defer gz.Close()
		stream = gz
	}
	cr := &countingReader{r: stream}
	tr := tar.NewReader(cr)
	last := "(start of archive)"
	entries := 0
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			if cr.n == 0 {
				return invalid("archive is empty")
			}
			// Go's reader also returns EOF when the stream stops cleanly
			// between entries; a real archive ends with zero blocks.
			if cr.zeroTail < 512 {
				return invalid("archive truncated after entry %q at byte %d: no end-of-archive marker", last, cr.n)
			}
			break
		}
		if err != nil {
			return archiveErr(err, fmt.Sprintf("header after entry %q", last), cr.n, gz != nil)
		}
		entries++
		if entries%1024 == 0 {
			progress(prog, Progress{Phase: PhaseImport, Done: entries, Message: "extracting " + hdr.Name})
		}
		if hooks != nil && hooks.first != nil && entries == 1 {
			if err := hooks.first(hdr, tr); err != nil {
				return err
			}
			last = hdr.Name
			continue
		}
		rel, err := cleanRel(hdr.Name)
		if err != nil {
			return err
		}
		if hooks != nil && hooks.prefix != "" {
			in, ok := strings.CutPrefix(rel, hooks.prefix)
			if !ok || (in != "" && in[0] != '/') {
				return invalid("entry %q is outside %s/", hdr.Name, hooks.prefix)
			}
			rel = strings.TrimPrefix(in, "/")
			if hdr.Typeflag == tar.TypeLink {
				target, err := cleanRel(hdr.Linkname)
				if err != nil {
					return err
				}
				in, ok := strings.CutPrefix(target, hooks.prefix+"/")
				if !ok {
					return invalid("hard link %q points outside %s/", hdr.Name, hooks.prefix)
				}
				hdr.Linkname = in
			}
		}
		last = hdr.Name
		m := meta{mode: uint32(hdr.Mode) & 0o7777, uid: hdr.Uid, gid: hdr.Gid, mtime: hdr.ModTime, atime: hdr.AccessTime,
			xattrs: paxXattrs(hdr, rel, st.log)}
		if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid > 1<<31 || hdr.Gid > 1<<31 {
			return invalid("entry %q has an invalid owner %d:%d", hdr.Name, hdr.Uid, hdr.Gid)
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			err = st.dir(rel, m)
		case tar.TypeReg: // tar.Reader turns legacy TypeRegA into TypeReg (or TypeDir)
			if rel == "" {
				return invalid("entry %q: the archive root must be a directory", hdr.Name)
			}
			err = st.file(rel, m, hdr.Size, sourceReader{tr})
			var short *shortReadError
			var src sourceError
			switch {
			case errors.As(err, &short):
				return invalid("archive truncated inside entry %q (%d of %d bytes)", hdr.Name, short.got, short.want)
			case errors.As(err, &src):
				return archiveErr(src.err, fmt.Sprintf("content of entry %q", hdr.Name), cr.n, gz != nil)
			}
		case tar.TypeSymlink:
			if rel == "" {
				return invalid("entry %q: the archive root must be a directory", hdr.Name)
			}
			err = st.symlink(rel, hdr.Linkname, m)
		case tar.TypeLink:
			if rel == "" {
				return invalid("entry %q: the archive root must be a directory", hdr.Name)
			}
			err = st.hardlink(rel, hdr.Linkname)
		case tar.TypeFifo:
			err = st.fifo(rel, m)
		case tar.TypeChar, tar.TypeBlock:
			st.skip(rel, "device node")
			err = st.charge(entryOverhead, rel)
		case tar.TypeXGlobalHeader:
			// PAX global headers carry defaults Go's reader already applied.
		default:
			return invalid("entry %q has unsupported type %q", hdr.Name, hdr.Typeflag)
		}
		if err != nil {
			return err
		}
	}
	if gz != nil {
		// Read to the end of the gzip stream so its CRC and length are
		// checked, but do not decompress unbounded trailing garbage.
		n, err := io.Copy(io.Discard, io.LimitReader(gz, maxTrailing+1))
		if err != nil {
			return archiveErr(err, "gzip trailer", cr.n, true)
		}
		if n > maxTrailing {
			return invalid("more than %d bytes of data after the end of the tar archive", maxTrailing)
		}
	}
	return nil
}

// archiveErr maps decoding failures to ErrInvalidArgument with the place
// they happened; other errors (the reader's own) pass through wrapped.
func archiveErr(err error, where string, off int64, gzipped bool) error {
	var corrupt flate.CorruptInputError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		if gzipped {
			return invalid("gzip-compressed archive truncated in %s at tar byte %d", where, off)
		}
		return invalid("archive truncated in %s at byte %d", where, off)
	case errors.Is(err, tar.ErrHeader), errors.Is(err, tar.ErrFieldTooLong):
		return invalid("corrupt tar %s at byte %d: %v", where, off, err)
	case errors.Is(err, gzip.ErrHeader), errors.Is(err, gzip.ErrChecksum), errors.As(err, &corrupt):
		return invalid("corrupt gzip stream in %s (tar byte %d): %v", where, off, err)
	case errors.Is(err, tar.ErrInsecurePath):
		return invalid("insecure path in %s: %v", where, err)
	}
	if strings.HasPrefix(err.Error(), "archive/tar:") {
		return invalid("corrupt tar %s at byte %d: %v", where, off, err)
	}
	return fmt.Errorf("read archive (%s): %w", where, err)
}

// sourceReader marks errors that come from reading the archive (as opposed
// to writing the staged file), so they can be reported as archive damage.
type sourceReader struct{ r io.Reader }

type sourceError struct{ err error }

func (e sourceError) Error() string { return e.err.Error() }
func (e sourceError) Unwrap() error { return e.err }

func (s sourceReader) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		err = sourceError{err}
	}
	return n, err
}
