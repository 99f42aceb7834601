package template

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"path"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/klauspost/compress/zstd"

	"github.com/spacehq/space/internal/errdefs"
)

// --- layers -----------------------------------------------------------------

// blobReader reads a layer blob, hashing and counting it; it fails when the
// blob runs past its declared size.
type blobReader struct {
	r    io.Reader
	h    hash.Hash
	n    int64
	size int64
}

// blobError is an error of the blob source (I/O, network, registry-side
// verification), as opposed to a decoding error of its content.
type blobError struct{ err error }

func (e blobError) Error() string { return e.err.Error() }
func (e blobError) Unwrap() error { return e.err }

func (b *blobReader) Read(p []byte) (int, error) {
	if b.n > b.size {
		return 0, invalid("the blob is longer than the %d bytes the manifest says", b.size)
	}
	if rest := b.size + 1 - b.n; int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := b.r.Read(p)
	b.h.Write(p[:n])
	b.n += int64(n)
	if err != nil && err != io.EOF {
		err = blobError{err}
	}
	return n, err
}

// budgetReader hashes decompressed content and charges it to a budget
// (negative = unlimited).
type budgetReader struct {
	r      io.Reader
	h      hash.Hash
	budget *int64
}

func (b *budgetReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.h.Write(p[:n])
	if *b.budget >= 0 {
		if *b.budget -= int64(n); *b.budget < 0 {
			return n, fmt.Errorf("decompressed layer data exceeds the import limit: %w", errdefs.ErrTooLarge)
		}
	}
	return n, err
}

// decodeError marks a failure to decode the layer's compression or tar.
type decodeError struct{ err error }

func (e decodeError) Error() string { return e.err.Error() }
func (e decodeError) Unwrap() error { return e.err }

// applyLayer streams one layer onto the tree and verifies it. It returns
// the blob's digest (as computed).
func applyLayer(ctx context.Context, st *stager, l ociLayer, diffID v1.Hash, budget *int64) (v1.Hash, error) {
	rc, err := l.open(ctx)
	if err != nil {
		return v1.Hash{}, err
	}
	defer rc.Close()
	blob := &blobReader{r: rc, h: sha256.New(), size: l.size}
	digest := func() v1.Hash { return v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(blob.h.Sum(nil))} }

	err = decodeLayer(ctx, st, l, blob, diffID, budget)
	var dec decodeError
	if errors.As(err, &dec) && l.digest.Hex != "" {
		// Damaged content is most often a blob that is not what its digest
		// names: say that rather than what the decoder tripped over.
		if _, derr := io.Copy(io.Discard, blob); derr == nil && digest() != l.digest {
			return v1.Hash{}, invalid("blob digest mismatch: the content is %s, the manifest says %s", digest(), l.digest)
		} else if derr != nil {
			return v1.Hash{}, sourceErr(derr)
		}
	}
	if err != nil {
		return v1.Hash{}, sourceErr(err)
	}
	got := digest()
	if blob.n != l.size {
		return v1.Hash{}, invalid("the blob is %d bytes, the manifest says %d", blob.n, l.size)
	}
	if l.digest.Hex != "" && got != l.digest {
		return v1.Hash{}, invalid("blob digest mismatch: the content is %s, the manifest says %s", got, l.digest)
	}
	return got, nil
}

// sourceErr classifies blob source errors (decode errors already carry a
// sentinel).
func sourceErr(err error) error {
	var be blobError
	if !errors.As(err, &be) {
		return err
	}
	if errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return be.err
	}
	return registryErr(be.err, "layer blob")
}

// decodeLayer decompresses blob and applies its tar to st, then checks the
// uncompressed content against the config's diff_id.
func decodeLayer(ctx context.Context, st *stager, l ociLayer, blob *blobReader, diffID v1.Hash, budget *int64) error {
	br := bufio.NewReaderSize(blob, 64<<10)
	head, err := br.Peek(4)
	if err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	sniffed := "tar"
	switch {
	case bytes.HasPrefix(head, []byte{0x1f, 0x8b}):
		sniffed = "gzip"
	case bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		sniffed = "zstd"
	}
	if want, ok := layerTypes[l.mediaType]; ok && want != sniffed {
		return invalid("media type %q says %s, the content is %s", l.mediaType, want, sniffed)
	}
	var stream io.Reader
	switch sniffed {
	case "gzip":
		gz, err := gzip.NewReader(br)
		if err != nil {
			return decodeError{invalid("corrupt gzip header: %v", err)}
		}
		defer gz.Close()
		stream = gz
	case "zstd":
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
			zstd.WithDecoderMaxWindow(maxZstdWindow))
		if err != nil {
			return decodeError{invalid("corrupt zstd stream: %v", err)}
		}
		defer zr.Close()
		stream = zr
	default:
		stream = br
	}
	un := &budgetReader{r: stream, h: sha256.New(), budget: budget}
	cr := &countingReader{r: un}
	if err := applyLayerTar(ctx, st, cr, sniffed); err != nil {
		return err
	}
	// Read to the end so the compression's checksum and both digests
	// cover the whole blob, without inflating unbounded trailing data.
	n, err := io.Copy(io.Discard, io.LimitReader(cr, maxTrailing+1))
	if err != nil {
		return decodeErr(err, "after the end of the tar", cr.n, sniffed)
	}
	if n > maxTrailing {
		return decodeError{invalid("more than %d bytes of data after the end of the layer tar", maxTrailing)}
	}
	if _, err := io.Copy(io.Discard, br); err != nil {
		return err
	}
	if got := hex.EncodeToString(un.h.Sum(nil)); got != diffID.Hex {
		return invalid("uncompressed content is sha256:%s, the image config's diff_id says %s", got, diffID)
	}
	return nil
}

// decodeErr turns a decoding failure into a decodeError with a sentinel.
func decodeErr(err error, where string, off int64, compression string) error {
	var be blobError
	if errors.As(err, &be) || errors.Is(err, errdefs.ErrTooLarge) || errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	if compression == "zstd" && !errors.Is(err, io.ErrUnexpectedEOF) && !strings.HasPrefix(err.Error(), "archive/tar") {
		return decodeError{invalid("corrupt zstd stream %s (tar byte %d): %v", where, off, err)}
	}
	mapped := archiveErr(err, where, off, compression == "gzip")
	if !errors.Is(mapped, errdefs.ErrInvalidArgument) {
		mapped = invalid("corrupt layer %s (tar byte %d): %v", where, off, err)
	}
	return decodeError{mapped}
}

// applyLayerTar applies one layer's tar entries. Whiteouts and opaque
// markers hide lower layers' entries only (st tracks this layer's own).
func applyLayerTar(ctx context.Context, st *stager, cr *countingReader, compression string) error {
	st.beginLayer()
	tr := tar.NewReader(cr)
	last := "(start of layer)"
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			if cr.n == 0 {
				return decodeError{invalid("the layer is empty (not a tar)")}
			}
			if cr.zeroTail < 512 {
				return decodeError{invalid("layer tar truncated after entry %q: no end-of-archive marker", last)}
			}
			return nil
		}
		if err != nil {
			return decodeErr(err, fmt.Sprintf("header after entry %q", last), cr.n, compression)
		}
		last = hdr.Name
		if err := applyEntry(st, tr, hdr, cr, compression); err != nil {
			return err
		}
	}
}

func applyEntry(st *stager, tr *tar.Reader, hdr *tar.Header, cr *countingReader, compression string) error {
	rel, err := cleanRel(hdr.Name)
	if err != nil {
		return err
	}
	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	for _, c := range strings.Split(dir, "/") {
		if strings.HasPrefix(c, whiteoutPrefix) {
			return invalid("entry %q: a whiteout name may not be a directory", hdr.Name)
		}
	}
	if strings.HasPrefix(base, whiteoutPrefix) {
		// Whiteout files carry no content; a body is still charged so
		// that skipping it is not free.
		if err := st.charge(hdr.Size, rel); err != nil {
			return err
		}
		switch {
		case base == whiteoutOpaque:
			return st.opaque(dir)
		case strings.HasPrefix(base, whiteoutMeta):
			st.skip(rel, "aufs whiteout metadata")
			return nil
		}
		target := strings.TrimPrefix(base, whiteoutPrefix)
		if target == "" || target == "." || target == ".." {
			return invalid("whiteout %q names no entry (or the directory itself or its parent)", hdr.Name)
		}
		return st.remove(path.Join(dir, target))
	}
	if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid > 1<<31 || hdr.Gid > 1<<31 {
		return invalid("entry %q has an invalid owner %d:%d", hdr.Name, hdr.Uid, hdr.Gid)
	}
	m := meta{mode: uint32(hdr.Mode) & 0o7777, uid: hdr.Uid, gid: hdr.Gid, mtime: hdr.ModTime, atime: hdr.AccessTime}
	xs := paxXattrs(hdr, rel, st.log)
	if rel == "" && hdr.Typeflag != tar.TypeDir {
		return invalid("entry %q: the layer root must be a directory", hdr.Name)
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		m.xattrs = xs
		return st.dir(rel, m)
	case tar.TypeReg: // tar.Reader turns legacy TypeRegA into TypeReg (or TypeDir)
		m.xattrs = xs
		err := st.file(rel, m, hdr.Size, sourceReader{tr})
		var short *shortReadError
		var src sourceError
		switch {
		case errors.As(err, &short):
			return decodeError{invalid("layer truncated inside entry %q (%d of %d bytes)", hdr.Name, short.got, short.want)}
		case errors.As(err, &src):
			return decodeErr(src.err, fmt.Sprintf("content of entry %q", hdr.Name), cr.n, compression)
		}
		return err
	case tar.TypeSymlink:
		return st.symlink(rel, hdr.Linkname, m)
	case tar.TypeLink:
		return st.hardlink(rel, hdr.Linkname)
	case tar.TypeFifo:
		return st.fifo(rel, m)
	case tar.TypeChar, tar.TypeBlock:
		st.skip(rel, "device node")
		return st.charge(entryOverhead+max(hdr.Size, 0), rel)
	case tar.TypeXGlobalHeader:
		return nil
	}
	return invalid("entry %q has unsupported type %q", hdr.Name, hdr.Typeflag)
}

// paxXattrs returns the extended attributes recorded in hdr's PAX records
// (SCHILY.xattr.*) that the policy keeps (keepXattr: user.* only), sorted.
// Dropped ones are logged; a file capability (security.capability) is
// dropped like a setuid bit is stripped. Only regular files and
// directories keep any: the kernel allows user.* on nothing else.
func paxXattrs(hdr *tar.Header, rel string, log *slog.Logger) []xattr {
	var out []xattr
	for k, v := range hdr.PAXRecords {
		n, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		switch {
		case !keepXattr(n):
			log.Debug("template import: dropping extended attribute", "path", rel, "xattr", n,
				"file_capability", n == "security.capability")
		case hdr.Typeflag != tar.TypeDir && hdr.Typeflag != tar.TypeReg: // tar.Reader turns legacy TypeRegA into TypeReg
			log.Debug("template import: dropping extended attribute of a special file", "path", rel, "xattr", n)
		default:
			out = append(out, xattr{name: n, value: []byte(v)})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}
