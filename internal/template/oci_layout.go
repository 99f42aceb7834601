package template

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// --- OCI image layouts (directory or tar) -----------------------------------

// blobFS is a directory or an archive holding an image layout or docker-save.
type blobFS interface {
	// open opens the named file; a missing one wraps os.ErrNotExist.
	open(name string) (io.ReadCloser, int64, error)
}

// readSmall reads the named file whole (it must be at most limit bytes)
// and, when want is set, checks its digest.
func readSmall(fsys blobFS, file, what string, limit int64, want v1.Hash) ([]byte, error) {
	rc, size, err := fsys.open(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil, invalid("%s: missing blob %s", what, file)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	defer rc.Close()
	if size > limit {
		return nil, invalid("%s is %d bytes (limit %d)", what, size, limit)
	}
	b, err := io.ReadAll(io.LimitReader(rc, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", what, err)
	}
	if want.Hex != "" {
		if got := sha256.Sum256(b); hex.EncodeToString(got[:]) != want.Hex {
			return nil, invalid("%s: digest mismatch: the blob is sha256:%s, it is referenced as %s", what, hex.EncodeToString(got[:]), want)
		}
	}
	return b, nil
}

func blobPath(d v1.Hash) string { return path.Join("blobs", d.Algorithm, d.Hex) }

// readDescriptor reads the blob d names, checking size and digest.
func readDescriptor(fsys blobFS, d v1.Descriptor, what string, limit int64) ([]byte, error) {
	if err := checkDescriptor(d, what, limit); err != nil {
		return nil, err
	}
	b, err := readSmall(fsys, blobPath(d.Digest), what, limit, d.Digest)
	if err != nil {
		return nil, err
	}
	if int64(len(b)) != d.Size {
		return nil, invalid("%s: blob is %d bytes, it is referenced with size %d", what, len(b), d.Size)
	}
	return b, nil
}

// resolveLayout finds the image in an OCI image layout.
func resolveLayout(fsys blobFS, ref string, plat v1.Platform) (*ociImage, error) {
	lb, err := readSmall(fsys, "oci-layout", "oci-layout", 4096, v1.Hash{})
	if err != nil {
		return nil, err
	}
	var lay struct {
		Version string `json:"imageLayoutVersion"`
	}
	if err := json.Unmarshal(lb, &lay); err != nil || lay.Version == "" {
		return nil, invalid("oci-layout is not an image layout marker: %q", truncate(lb))
	}
	ib, err := readSmall(fsys, "index.json", "index.json", maxIndexBytes, v1.Hash{})
	if err != nil {
		return nil, err
	}
	var idx v1.IndexManifest
	if err := json.Unmarshal(ib, &idx); err != nil {
		return nil, invalid("index.json is not valid JSON: %v", err)
	}
	desc, err := pickRef(idx.Manifests, ref)
	if err != nil {
		return nil, err
	}
	m, err := resolveManifest(fsys, desc, plat, 0)
	if err != nil {
		return nil, err
	}
	cb, err := readDescriptor(fsys, m.Config, "image config", maxConfigBytes)
	if err != nil {
		return nil, err
	}
	cfg, err := parseConfig(cb, len(m.Layers), plat)
	if err != nil {
		return nil, err
	}
	img := &ociImage{config: cfg}
	for _, l := range m.Layers {
		l := l
		img.layers = append(img.layers, ociLayer{digest: l.Digest, size: l.Size, mediaType: l.MediaType,
			open: func(context.Context) (io.ReadCloser, error) {
				rc, size, err := fsys.open(blobPath(l.Digest))
				if errors.Is(err, os.ErrNotExist) {
					return nil, invalid("missing blob %s", blobPath(l.Digest))
				}
				if err != nil {
					return nil, err
				}
				if size != l.Size {
					rc.Close()
					return nil, invalid("blob is %d bytes, the manifest says %d", size, l.Size)
				}
				return rc, nil
			}})
	}
	return img, nil
}

// pickRef picks the index entry named ref, or the only one.
func pickRef(ds []v1.Descriptor, ref string) (v1.Descriptor, error) {
	var names []string
	for _, d := range ds {
		for _, a := range []string{refNameAnno, containerdAnno} {
			if n := d.Annotations[a]; n != "" {
				names = append(names, n)
				if ref != "" && sameRef(n, ref) {
					return d, nil
				}
			}
		}
	}
	switch {
	case ref != "":
		return v1.Descriptor{}, fmt.Errorf("no image named %q (names: %s): %w", ref, strings.Join(names, ", "), errdefs.ErrNotFound)
	case len(ds) == 0:
		return v1.Descriptor{}, invalid("the index lists no image")
	case len(ds) > 1:
		return v1.Descriptor{}, invalid("the index lists %d images; pick one by name (names: %s)", len(ds), strings.Join(names, ", "))
	}
	return ds[0], nil
}

// sameRef reports whether two image names are the same, allowing
// "app:1" to match "docker.io/library/app:1".
func sameRef(a, b string) bool {
	if a == b {
		return true
	}
	ra, err1 := name.ParseReference(a)
	rb, err2 := name.ParseReference(b)
	return err1 == nil && err2 == nil && ra.Name() == rb.Name()
}

// resolveManifest reads the manifest d names, descending through image
// indexes to the one for plat.
func resolveManifest(fsys blobFS, d v1.Descriptor, plat v1.Platform, depth int) (*v1.Manifest, error) {
	what := fmt.Sprintf("manifest %s", d.Digest)
	if depth > maxIndexDepth {
		return nil, invalid("image indexes nested deeper than %d", maxIndexDepth)
	}
	if !manifestTypes[d.MediaType] && !indexTypes[d.MediaType] {
		return nil, invalid("%s: unsupported media type %q", what, d.MediaType)
	}
	b, err := readDescriptor(fsys, d, what, maxManifestBytes)
	if err != nil {
		return nil, err
	}
	if indexTypes[d.MediaType] {
		var idx v1.IndexManifest
		if err := json.Unmarshal(b, &idx); err != nil {
			return nil, invalid("image index %s is not valid JSON: %v", d.Digest, err)
		}
		child, err := pickPlatform(idx.Manifests, plat)
		if err != nil {
			return nil, fmt.Errorf("image index %s: %w", d.Digest, err)
		}
		return resolveManifest(fsys, child, plat, depth+1)
	}
	var m v1.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, invalid("%s is not valid JSON: %v", what, err)
	}
	if m.MediaType != "" && m.MediaType != d.MediaType {
		return nil, invalid("%s: has media type %q but is referenced as %q", what, m.MediaType, d.MediaType)
	}
	if err := checkManifest(&m); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return &m, nil
}

func pickPlatform(ds []v1.Descriptor, plat v1.Platform) (v1.Descriptor, error) {
	var have []string
	for _, d := range ds {
		if d.Platform == nil {
			continue
		}
		have = append(have, d.Platform.String())
		if d.Platform.Satisfies(plat) {
			return d, nil
		}
	}
	return v1.Descriptor{}, fmt.Errorf("no %s image (it has: %s): %w", plat, strings.Join(have, ", "), errdefs.ErrNotFound)
}

func truncate(b []byte) string {
	if len(b) > 64 {
		b = b[:64]
	}
	return string(b)
}

// dirBlobs reads a layout directory. Files are opened beneath the root
// (openat2 RESOLVE_BENEATH): a symlink in the layout cannot make us read
// a host file as a blob.
type dirBlobs struct{ root *os.File }

func openDirBlobs(dir string) (*dirBlobs, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(abs, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("OCI layout %s: %w", dir, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", dir, errdefs.ErrInvalidArgument)
	}
	return &dirBlobs{root: f}, nil
}

func (d *dirBlobs) close() { d.root.Close() }

func (d *dirBlobs) open(file string) (io.ReadCloser, int64, error) {
	fd, err := unix.Openat2(int(d.root.Fd()), file, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS,
	})
	if errors.Is(err, unix.ENOENT) {
		return nil, 0, fmt.Errorf("%s: %w", file, os.ErrNotExist)
	}
	if err != nil {
		return nil, 0, invalid("open %s in the layout: %v", file, err)
	}
	f := os.NewFile(uintptr(fd), file)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		f.Close()
		return nil, 0, invalid("%s in the layout is not a regular file", file)
	}
	return f, st.Size, nil
}

// tarBlobs reads files of an uncompressed tar in place: one pass records
// where each regular file's content lies, reads are then section reads.
type tarBlobs struct {
	f       *os.File
	entries map[string]tarBlob
}

type tarBlob struct {
	off, size int64
	link      string // symlink target (relative to the entry) or hard link target (archive-relative)
	hard      bool
}

func openTarBlobs(p string) (*tarBlobs, error) {
	// O_NONBLOCK: a FIFO at p must not hang the import.
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no such file: %w", errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, invalid("not a regular file")
	}
	t := &tarBlobs{f: f, entries: map[string]tarBlob{}}
	if err := t.index(); err != nil {
		f.Close()
		return nil, err
	}
	return t, nil
}

func (t *tarBlobs) close() { t.f.Close() }

func (t *tarBlobs) index() error {
	var head [512]byte
	n, _ := io.ReadFull(t.f, head[:])
	if n >= 2 && head[0] == 0x1f && head[1] == 0x8b {
		return invalid("the archive is gzip-compressed; decompress it first (only plain tar archives are read in place)")
	}
	if n < 512 {
		return invalid("not a tar archive (%d bytes)", n)
	}
	end, err := t.f.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	if _, err := t.f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	tr := tar.NewReader(t.f)
	for count := 0; ; count++ {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return archiveErr(err, "archive index", 0, false)
		}
		if count >= maxOuterEntries {
			return invalid("the archive has more than %d entries", maxOuterEntries)
		}
		rel, err := cleanRel(hdr.Name)
		if err != nil || rel == "" {
			continue // nothing an image refers to
		}
		switch hdr.Typeflag {
		case tar.TypeReg: // tar.Reader turns legacy TypeRegA into TypeReg (or TypeDir)
			if isSparse(hdr) {
				continue // content not stored contiguously: never a blob
			}
			// The tar reader reads headers unbuffered, so the file offset
			// is where this entry's content starts.
			off, err := t.f.Seek(0, io.SeekCurrent)
			if err != nil {
				return err
			}
			// Seeking past the end is not an error: check truncation here.
			if off+hdr.Size > end {
				return invalid("the archive is truncated inside entry %q", hdr.Name)
			}
			t.entries[rel] = tarBlob{off: off, size: hdr.Size}
		case tar.TypeSymlink:
			t.entries[rel] = tarBlob{link: hdr.Linkname}
		case tar.TypeLink:
			t.entries[rel] = tarBlob{link: hdr.Linkname, hard: true}
		}
	}
}

func isSparse(hdr *tar.Header) bool {
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

func (t *tarBlobs) has(file string) bool { _, ok := t.entries[file]; return ok }

func (t *tarBlobs) open(file string) (io.ReadCloser, int64, error) {
	rel, err := cleanRel(file)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", file, os.ErrNotExist)
	}
	for hops := 0; hops < 16; hops++ {
		e, ok := t.entries[rel]
		if !ok {
			return nil, 0, fmt.Errorf("%s: %w", file, os.ErrNotExist)
		}
		if e.link == "" {
			return io.NopCloser(io.NewSectionReader(t.f, e.off, e.size)), e.size, nil
		}
		target := e.link
		if !e.hard {
			if path.IsAbs(target) {
				break
			}
			target = path.Join(path.Dir(rel), target)
		}
		if rel, err = cleanRel(target); err != nil {
			break
		}
	}
	return nil, 0, fmt.Errorf("%s: a link that leaves the archive or loops: %w", file, os.ErrNotExist)
}

// --- docker save ------------------------------------------------------------

// blobName matches archive paths that name their content digest.
var blobName = regexp.MustCompile(`^(?:blobs/sha256/|sha256:)?([0-9a-f]{64})(?:\.json)?$`)

func digestFromName(p string) v1.Hash {
	if m := blobName.FindStringSubmatch(p); m != nil {
		return v1.Hash{Algorithm: "sha256", Hex: m[1]}
	}
	return v1.Hash{}
}

// resolveDockerSave finds the image in a `docker save` archive. Its layers
// have no media type (they are sniffed) and, in the legacy format, no
// recorded blob digest: the config's diff_ids are what verifies them.
func resolveDockerSave(fsys *tarBlobs, ref string, plat v1.Platform) (*ociImage, error) {
	mb, err := readSmall(fsys, "manifest.json", "manifest.json", maxManifestBytes, v1.Hash{})
	if err != nil {
		return nil, err
	}
	var entries []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(mb, &entries); err != nil {
		return nil, invalid("manifest.json is not valid JSON: %v", err)
	}
	pick := -1
	var names []string
	for i, e := range entries {
		for _, t := range e.RepoTags {
			names = append(names, t)
			if ref != "" && sameRef(t, ref) && pick < 0 {
				pick = i
			}
		}
	}
	switch {
	case ref != "" && pick < 0:
		return nil, fmt.Errorf("no image named %q (names: %s): %w", ref, strings.Join(names, ", "), errdefs.ErrNotFound)
	case ref == "" && len(entries) != 1:
		return nil, invalid("manifest.json lists %d images; pick one by name (names: %s)", len(entries), strings.Join(names, ", "))
	case ref == "":
		pick = 0
	}
	e := entries[pick]
	cb, err := readSmall(fsys, e.Config, "image config "+e.Config, maxConfigBytes, digestFromName(e.Config))
	if err != nil {
		return nil, err
	}
	cfg, err := parseConfig(cb, len(e.Layers), plat)
	if err != nil {
		return nil, err
	}
	img := &ociImage{config: cfg}
	for _, lp := range e.Layers {
		lp := lp
		rc, size, err := fsys.open(lp)
		if errors.Is(err, os.ErrNotExist) {
			return nil, invalid("missing layer blob %s", lp)
		}
		if err != nil {
			return nil, err
		}
		rc.Close()
		img.layers = append(img.layers, ociLayer{digest: digestFromName(lp), size: size, file: lp,
			open: func(context.Context) (io.ReadCloser, error) {
				rc, _, err := fsys.open(lp)
				return rc, err
			}})
	}
	return img, nil
}
