package template

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// OCISource names an OCI (or Docker) image to import. Exactly one of
// LayoutDir, ArchivePath and Image is set.
type OCISource struct {
	// LayoutDir is an OCI image layout directory (oci-layout, index.json,
	// blobs/).
	LayoutDir string
	// ArchivePath is a tar file: `docker save` output or a tar of an OCI
	// image layout (which one is detected). It must be a seekable file, not
	// compressed: blobs are read in place, nothing is extracted.
	ArchivePath string
	// Ref picks the image in a layout or archive that holds several: an
	// index.json entry whose org.opencontainers.image.ref.name (or
	// io.containerd.image.name) annotation, or a docker-save entry whose
	// RepoTags, is Ref. Empty: the layout or archive must hold one image.
	Ref string
	// Image is a registry reference, e.g. "127.0.0.1:5000/app:1" or
	// "ghcr.io/org/app@sha256:…". Pulls are anonymous.
	Image string
	// Insecure allows plain HTTP to a registry that is not on a loopback
	// address (loopback registries may always use HTTP).
	Insecure bool
	// Platform is "os/arch[/variant]" picked from a multi-platform image;
	// default linux/amd64.
	Platform string
	// AllowPrivate lets a pull connect to loopback, private (RFC 1918,
	// ULA), link-local and unspecified addresses. Off, a pull can only
	// reach public addresses, checked on every connection after DNS (so a
	// name that re-resolves to 127.0.0.1 is refused too): an API client
	// must not be able to make the server probe its own network.
	AllowPrivate bool
}

// Bounds on image metadata, which is read into memory.
const (
	maxIndexBytes    = 4 << 20
	maxManifestBytes = 4 << 20
	maxConfigBytes   = 8 << 20
	maxOuterEntries  = 1 << 16 // entries of a docker-save/OCI archive
	maxIndexDepth    = 4       // nested image indexes
	maxZstdWindow    = 64 << 20
)

const (
	whiteoutPrefix = ".wh."
	whiteoutMeta   = ".wh..wh."
	whiteoutOpaque = ".wh..wh..opq"
	refNameAnno    = "org.opencontainers.image.ref.name"
	containerdAnno = "io.containerd.image.name"
)

// ociImage is a resolved image: its config and how to read its layers.
type ociImage struct {
	config *v1.ConfigFile
	layers []ociLayer
}

// ociLayer is one layer blob of an image.
type ociLayer struct {
	digest    v1.Hash         // the blob digest; zero when the source does not say (legacy docker save)
	size      int64           // bytes of the blob as stored
	mediaType types.MediaType // "" when the source has none (docker save): the content is sniffed
	file      string          // the blob's path in a docker-save archive (names it when digest is zero)
	open      func(ctx context.Context) (io.ReadCloser, error)
}

// ImportOCI imports an OCI or Docker image: its layers applied in order onto
// one tree (whiteouts and opaque directories hide lower layers' entries;
// hard links, symlinks, modes, owners and user.* xattrs are kept; every
// entry goes through the stager's hostile-input policy, see stager), and
// its config's Env, WorkingDir and User as the template's defaults (o.Config
// fields that are set win; env merges key by key).
//
// The image's Cmd and Entrypoint are deliberately not mapped to
// Config.Start: an image's main process (a web server, a shell) is what a
// container runs as PID 1, while a template's start command is an extra
// background service a sandbox is only ready after — turning every image's
// CMD into one would make sandbox creation wait on, or fail because of,
// programs that were never meant for it. Callers set o.Config.Start
// explicitly when they want one.
//
// Every blob is verified against its digest (and every layer's uncompressed
// content against the config's diff_ids); o.MaxBytes bounds the whole
// uncompressed import and, checked before a layer is read or downloaded,
// the compressed size of each layer. Failures are ErrInvalidArgument (bad
// or hostile image), ErrTooLarge, ErrNotFound (no such image or platform)
// or ErrUnavailable (registry unreachable), and leave nothing behind.
func (s *Store) ImportOCI(ctx context.Context, src OCISource, o ImportOptions) (api.Template, error) {
	return s.importOCI(ctx, src, o, src.ArchivePath)
}

// importOCI is ImportOCI; archiveLabel names src.ArchivePath in errors and
// the source (a spooled upload's path is nobody's business).
func (s *Store) importOCI(ctx context.Context, src OCISource, o ImportOptions, archiveLabel string) (api.Template, error) {
	plat, err := parsePlatform(src.Platform)
	if err != nil {
		return api.Template{}, err
	}
	var (
		img    *ociImage
		source string
	)
	switch {
	case boolCount(src.LayoutDir != "", src.ArchivePath != "", src.Image != "") != 1:
		return api.Template{}, invalid("an OCI import needs exactly one of a layout directory, an archive and an image reference")
	case src.LayoutDir != "":
		fsys, err := openDirBlobs(src.LayoutDir)
		if err != nil {
			return api.Template{}, err
		}
		defer fsys.close()
		source = "oci:" + fsys.root.Name()
		img, err = resolveLayout(fsys, src.Ref, plat)
		if err != nil {
			return api.Template{}, fmt.Errorf("OCI layout %s: %w", src.LayoutDir, err)
		}
	case src.ArchivePath != "":
		fsys, err := openTarBlobs(src.ArchivePath)
		if err != nil {
			return api.Template{}, fmt.Errorf("image archive %s: %w", archiveLabel, err)
		}
		defer fsys.close()
		source = "oci:" + archiveLabel
		if fsys.has("oci-layout") && fsys.has("index.json") {
			img, err = resolveLayout(fsys, src.Ref, plat)
		} else if fsys.has("manifest.json") {
			img, err = resolveDockerSave(fsys, src.Ref, plat)
		} else {
			err = invalid("neither a docker-save archive (no manifest.json) nor an OCI image layout (no oci-layout and index.json)")
		}
		if err != nil {
			return api.Template{}, fmt.Errorf("image archive %s: %w", archiveLabel, err)
		}
	default:
		var ref name.Reference
		img, ref, err = resolveRemote(ctx, src, plat)
		if err != nil {
			return api.Template{}, fmt.Errorf("image %s: %w", src.Image, err)
		}
		source = "oci:" + ref.String()
	}
	if src.Ref != "" && src.Image == "" {
		source += "#" + src.Ref
	}
	if o.Source == "" {
		o.Source = source
	}
	for i, l := range img.layers {
		if o.MaxBytes > 0 && l.size > o.MaxBytes {
			return api.Template{}, fmt.Errorf("layer %d/%d (%s) is %d bytes compressed, over the limit of %d bytes: %w",
				i+1, len(img.layers), layerName(l), l.size, o.MaxBytes, errdefs.ErrTooLarge)
		}
	}
	o.Config = s.mergeImageConfig(img.config, o.Config)
	// Before any layer is read: a config the sandbox could not use fails
	// the import now, not after downloading everything.
	if err := ValidateConfig(o.Config); err != nil {
		return api.Template{}, fmt.Errorf("image config: %w", err)
	}
	o.Layers = layerRecords(img)

	return s.importWith(ctx, o, func(st *stager) error {
		st.replaceDirs = true
		defer func() { st.layer = nil }()
		// A backstop on decompressed bytes for content the stager never
		// sees (tar padding, PAX headers, skipped entries): a small layer
		// may not make us inflate gigabytes of nothing.
		budget := int64(-1)
		if o.MaxBytes > 0 {
			budget = 2*o.MaxBytes + 1<<20
		}
		for i, l := range img.layers {
			what := fmt.Sprintf("layer %d/%d (%s)", i+1, len(img.layers), layerName(l))
			progress(o.Progress, Progress{Phase: PhaseImport, Done: i, Total: len(img.layers), Message: "applying " + what})
			d, err := applyLayer(ctx, st, l, img.config.RootFS.DiffIDs[i], &budget)
			if err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			o.Layers[i].Digest = d.String()
		}
		progress(o.Progress, Progress{Phase: PhaseImport, Done: len(img.layers), Total: len(img.layers), Message: "layers applied"})
		return nil
	})
}

// ImportOCIStream imports a `docker save` or OCI-layout tar read from r
// (plain or gzip-compressed), e.g. an HTTP upload. Archives are read in
// place, so r is first spooled to a file under the store's tmp directory
// (same filesystem; removed afterwards, and by Open after a crash). With
// o.MaxBytes set, the spooled archive may be at most 2*MaxBytes+1 MiB
// (ErrTooLarge). src.LayoutDir, ArchivePath and Image must be empty; Ref
// and Platform apply.
func (s *Store) ImportOCIStream(ctx context.Context, r io.Reader, src OCISource, o ImportOptions) (api.Template, error) {
	if src.LayoutDir != "" || src.ArchivePath != "" || src.Image != "" {
		return api.Template{}, invalid("a streamed OCI import takes its archive from the stream only")
	}
	f, err := os.CreateTemp(filepath.Join(s.dir, "tmp"), "oci-archive-")
	if err != nil {
		return api.Template{}, fmt.Errorf("spool image archive: %w", err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	br := bufio.NewReaderSize(r, 64<<10)
	var in io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err := gzip.NewReader(br)
		if err != nil {
			return api.Template{}, invalid("corrupt gzip header of the image archive: %v", err)
		}
		defer gz.Close()
		in = gz
	}
	limit := int64(-1)
	if o.MaxBytes > 0 {
		limit = 2*o.MaxBytes + 1<<20
		in = io.LimitReader(in, limit+1)
	}
	n, err := io.Copy(f, contextReader{ctx, in})
	if err != nil {
		if ctx.Err() != nil {
			return api.Template{}, ctx.Err()
		}
		if mapped := archiveErr(err, "image archive", n, in != io.Reader(br)); errors.Is(mapped, errdefs.ErrInvalidArgument) {
			return api.Template{}, mapped
		}
		return api.Template{}, fmt.Errorf("spool image archive: %w", err)
	}
	if limit >= 0 && n > limit {
		return api.Template{}, fmt.Errorf("image archive is over %d bytes: %w", limit, errdefs.ErrTooLarge)
	}
	src.ArchivePath = f.Name()
	return s.importOCI(ctx, src, o, "upload")
}

// contextReader stops a copy when ctx ends.
type contextReader struct {
	ctx context.Context
	r   io.Reader
}

func (c contextReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

func boolCount(bs ...bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

func layerName(l ociLayer) string {
	if l.digest.Hex == "" {
		return l.file
	}
	return l.digest.String()
}

func parsePlatform(s string) (v1.Platform, error) {
	if s == "" {
		return v1.Platform{OS: "linux", Architecture: "amd64"}, nil
	}
	p, err := v1.ParsePlatform(s)
	if err != nil || p.OS == "" || p.Architecture == "" {
		return v1.Platform{}, invalid("platform %q is not os/arch[/variant]", s)
	}
	return *p, nil
}

// mergeImageConfig turns an image config into template defaults under
// over (the caller's, which win). Env entries whose names a sandbox could
// not use are dropped with a warning rather than failing the import.
func (s *Store) mergeImageConfig(cfg *v1.ConfigFile, over api.TemplateConfig) api.TemplateConfig {
	out := api.TemplateConfig{Workdir: cfg.Config.WorkingDir, User: cfg.Config.User, Start: over.Start}
	for _, kv := range cfg.Config.Env {
		k, v, _ := strings.Cut(kv, "=")
		if !envKeyRE.MatchString(k) {
			s.log.Warn("OCI import: dropping image env entry with an invalid name", "entry", kv)
			continue
		}
		if out.Env == nil {
			out.Env = map[string]string{}
		}
		out.Env[k] = v
	}
	for k, v := range over.Env {
		if out.Env == nil {
			out.Env = map[string]string{}
		}
		out.Env[k] = v
	}
	if over.Workdir != "" {
		out.Workdir = over.Workdir
	}
	if over.User != "" {
		out.User = over.User
	}
	return out
}

// layerRecords is the provenance of img's layers; created_by comes from the
// config history when its non-empty entries line up with the layers.
func layerRecords(img *ociImage) []api.TemplateLayer {
	out := make([]api.TemplateLayer, len(img.layers))
	var hist []v1.History
	for _, h := range img.config.History {
		if !h.EmptyLayer {
			hist = append(hist, h)
		}
	}
	for i, l := range img.layers {
		out[i] = api.TemplateLayer{Digest: l.digest.String(), SizeBytes: l.size}
		if len(hist) == len(img.layers) {
			out[i].CreatedBy = hist[i].CreatedBy
		}
	}
	return out
}

// --- image metadata --------------------------------------------------------

var (
	manifestTypes = map[types.MediaType]bool{types.OCIManifestSchema1: true, types.DockerManifestSchema2: true}
	indexTypes    = map[types.MediaType]bool{types.OCIImageIndex: true, types.DockerManifestList: true}
	configTypes   = map[types.MediaType]bool{types.OCIConfigJSON: true, types.DockerConfigJSON: true}
	layerTypes    = map[types.MediaType]string{
		types.OCILayer:                "gzip",
		types.DockerLayer:             "gzip",
		types.OCILayerZStd:            "zstd",
		types.OCIUncompressedLayer:    "tar",
		types.DockerUncompressedLayer: "tar",
	}
)

// checkManifest validates a parsed image manifest: what it references must
// be an image config and plain (gzip, zstd or uncompressed) tar layers
// stored in the same place, with sha256 digests and sane sizes.
func checkManifest(m *v1.Manifest) error {
	if m.SchemaVersion != 2 {
		return invalid("manifest schema version %d is not supported (only 2)", m.SchemaVersion)
	}
	if !configTypes[m.Config.MediaType] {
		return invalid("config media type %q is not an image config (this is not a container image)", m.Config.MediaType)
	}
	if err := checkDescriptor(m.Config, "config", maxConfigBytes); err != nil {
		return err
	}
	for i, l := range m.Layers {
		what := fmt.Sprintf("layer %d/%d (%s)", i+1, len(m.Layers), l.Digest)
		if _, ok := layerTypes[l.MediaType]; !ok {
			return invalid("%s: unsupported media type %q", what, l.MediaType)
		}
		if len(l.URLs) > 0 {
			return invalid("%s: foreign layers with external URLs are not supported", what)
		}
		if err := checkDescriptor(l, what, 0); err != nil {
			return err
		}
	}
	return nil
}

func checkDescriptor(d v1.Descriptor, what string, limit int64) error {
	if d.Digest.Algorithm != "sha256" || len(d.Digest.Hex) != 64 {
		return invalid("%s: digest %q is not a sha256 digest", what, d.Digest)
	}
	if d.Size < 0 || (limit > 0 && d.Size > limit) {
		return invalid("%s: size %d is out of range (limit %d)", what, d.Size, limit)
	}
	return nil
}

// parseConfig parses and checks an image config against the platform and
// its layer count.
func parseConfig(raw []byte, nlayers int, plat v1.Platform) (*v1.ConfigFile, error) {
	var cfg v1.ConfigFile
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return nil, invalid("image config is not valid JSON: %v", err)
	}
	if cfg.OS != "" && cfg.Architecture != "" && (cfg.OS != plat.OS || cfg.Architecture != plat.Architecture) {
		return nil, invalid("the image is for %s/%s, not %s", cfg.OS, cfg.Architecture, plat)
	}
	if len(cfg.RootFS.DiffIDs) != nlayers {
		return nil, invalid("the image config lists %d layer diff_ids for %d layers", len(cfg.RootFS.DiffIDs), nlayers)
	}
	for i, d := range cfg.RootFS.DiffIDs {
		if d.Algorithm != "sha256" || len(d.Hex) != 64 {
			return nil, invalid("config diff_id %d %q is not a sha256 digest", i+1, d)
		}
	}
	return &cfg, nil
}

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
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old archives
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

// --- registries -------------------------------------------------------------

// resolveRemote finds the image in a registry (anonymously).
func resolveRemote(ctx context.Context, src OCISource, plat v1.Platform) (*ociImage, name.Reference, error) {
	ref, err := name.ParseReference(src.Image)
	if err != nil {
		return nil, nil, invalid("bad image reference: %v", err)
	}
	loopback := isLoopbackHost(ref.Context().RegistryStr())
	if src.Insecure || loopback {
		if ref, err = name.ParseReference(src.Image, name.Insecure); err != nil {
			return nil, nil, invalid("bad image reference: %v", err)
		}
	}
	base := remote.DefaultTransport.(*http.Transport).Clone()
	if !src.AllowPrivate {
		d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: refusePrivate}
		base.DialContext = d.DialContext
	}
	rt := &registryTransport{base: base, insecure: src.Insecure, loopbackRegistry: loopback}
	img, err := remote.Image(ref, remote.WithContext(ctx), remote.WithTransport(rt),
		remote.WithPlatform(plat), remote.WithUserAgent("space"))
	if err != nil {
		return nil, nil, registryErr(err, "manifest")
	}
	mt, err := img.MediaType()
	if err != nil {
		return nil, nil, registryErr(err, "manifest")
	}
	if !manifestTypes[mt] {
		return nil, nil, invalid("unsupported manifest media type %q", mt)
	}
	raw, err := img.RawManifest()
	if err != nil {
		return nil, nil, registryErr(err, "manifest")
	}
	if len(raw) > maxManifestBytes {
		return nil, nil, invalid("manifest is %d bytes (limit %d)", len(raw), maxManifestBytes)
	}
	var m v1.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, nil, invalid("manifest is not valid JSON: %v", err)
	}
	if err := checkManifest(&m); err != nil {
		return nil, nil, err
	}
	cb, err := img.RawConfigFile() // size checked by checkManifest, digest by go-containerregistry
	if err != nil {
		return nil, nil, registryErr(err, "image config")
	}
	cfg, err := parseConfig(cb, len(m.Layers), plat)
	if err != nil {
		return nil, nil, err
	}
	out := &ociImage{config: cfg}
	for _, l := range m.Layers {
		l := l
		out.layers = append(out.layers, ociLayer{digest: l.Digest, size: l.Size, mediaType: l.MediaType,
			open: func(context.Context) (io.ReadCloser, error) {
				cl, err := img.LayerByDigest(l.Digest)
				if err != nil {
					return nil, registryErr(err, "layer")
				}
				rc, err := cl.Compressed()
				if err != nil {
					return nil, registryErr(err, "layer blob")
				}
				return rc, nil
			}})
	}
	return out, ref, nil
}

// registryErr maps registry failures to sentinels: a missing manifest or
// platform is ErrNotFound, a missing blob or a verification failure (the
// registry served something else than the digest names) ErrInvalidArgument,
// a refusal of anonymous access ErrInvalidArgument, anything else (network)
// ErrUnavailable.
func registryErr(err error, what string) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	// Registry errors quote response bodies: keep what reaches an API
	// client short (and a hostile registry's text bounded).
	err = shortErr{err}
	var te *transport.Error
	if errors.As(err, &te) {
		switch {
		case te.StatusCode == http.StatusNotFound && what == "manifest":
			return fmt.Errorf("%s: %v: %w", what, err, errdefs.ErrNotFound)
		case te.StatusCode == http.StatusNotFound:
			return invalid("%s missing in the registry: %v", what, err)
		case te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden:
			return invalid("the registry refused anonymous access to the %s: %v", what, err)
		}
		return fmt.Errorf("%s: %v: %w", what, err, errdefs.ErrUnavailable)
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "no child with platform"):
		return fmt.Errorf("%s: %v: %w", what, err, errdefs.ErrNotFound)
	case strings.Contains(msg, "error verifying"), strings.Contains(msg, "does not match"):
		return invalid("%s: digest or size mismatch: %v", what, err)
	case strings.Contains(msg, "refusing"):
		return invalid("%v", err)
	}
	return fmt.Errorf("%s: %v: %w", what, err, errdefs.ErrUnavailable)
}

// shortErr bounds an error's text, keeping it for errors.As/Is.
type shortErr struct{ err error }

func (e shortErr) Error() string {
	const max = 400
	if m := e.err.Error(); len(m) > max {
		return m[:max] + "…"
	}
	return e.err.Error()
}
func (e shortErr) Unwrap() error { return e.err }

// refusePrivate is a net.Dialer Control: it sees the resolved address.
func refusePrivate(network, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil || ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
		ip.IsUnspecified() || ip.IsMulticast() {
		return fmt.Errorf("refusing to connect to %s: registries on loopback, private or link-local addresses are not allowed by this server: %w",
			host, errdefs.ErrInvalidArgument)
	}
	return nil
}

func isLoopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// registryTransport enforces the plain-HTTP policy on every request
// (go-containerregistry falls back to HTTP for private addresses on its
// own) and keeps a remote registry from redirecting us to this host.
type registryTransport struct {
	base             http.RoundTripper
	insecure         bool
	loopbackRegistry bool
}

func (t *registryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if err := t.allow(req.URL.Scheme, req.URL.Host); err != nil {
		return nil, err
	}
	return t.base.RoundTrip(req)
}

func (t *registryTransport) allow(scheme, host string) error {
	loop := isLoopbackHost(host)
	if loop && !t.loopbackRegistry {
		return fmt.Errorf("refusing a request to loopback address %s for a registry that is not on this host", host)
	}
	if scheme == "http" && !loop && !t.insecure {
		return fmt.Errorf("refusing plain HTTP to registry %s (not a loopback address; allow it with insecure)", host)
	}
	return nil
}

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
	case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old archives still use '\x00'
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
		case hdr.Typeflag != tar.TypeDir && hdr.Typeflag != tar.TypeReg && hdr.Typeflag != tar.TypeRegA: //nolint:staticcheck
			log.Debug("template import: dropping extended attribute of a special file", "path", rel, "xattr", n)
		default:
			out = append(out, xattr{name: n, value: []byte(v)})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}
