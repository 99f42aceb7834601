package template

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"

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
