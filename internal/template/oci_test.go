package template

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// ociLayerOf is a gzip OCI layer of the given tar entries.
func ociLayerOf(t *testing.T, entries ...entry) v1.Layer {
	t.Helper()
	data := mktar(t, entries...)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// addHistory pairs a layer with its created_by.
type addHistory struct {
	layer     v1.Layer
	createdBy string
}

// ociImageOf builds an OCI image of layers with config set by cfg.
func ociImageOf(t *testing.T, cfg func(*v1.ConfigFile), layers ...addHistory) v1.Image {
	t.Helper()
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	var err error
	for _, l := range layers {
		img, err = mutate.Append(img, mutate.Addendum{Layer: l.layer, MediaType: mustMT(t, l.layer),
			History: v1.History{CreatedBy: l.createdBy}})
		if err != nil {
			t.Fatal(err)
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	if cfg != nil {
		cfg(cf)
	}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

func mustMT(t *testing.T, l v1.Layer) types.MediaType {
	mt, err := l.MediaType()
	if err != nil {
		t.Fatal(err)
	}
	return mt
}

// writeLayout writes img as an OCI layout named ref (if set).
func writeLayout(t *testing.T, dir string, img v1.Image, ref string) layout.Path {
	t.Helper()
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	var opts []layout.Option
	if ref != "" {
		opts = append(opts, layout.WithAnnotations(map[string]string{refNameAnno: ref}))
	}
	if err := p.AppendImage(img, opts...); err != nil {
		t.Fatal(err)
	}
	return p
}

// tarDir writes the tree at dir as an uncompressed tar at out.
func tarDir(t *testing.T, dir, out string) {
	t.Helper()
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		h, err := tar.FileInfoHeader(fi, "")
		if err != nil {
			return err
		}
		h.Name = filepath.ToSlash(rel)
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			_, err = tw.Write(b)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
}

// startRegistry serves an in-process registry on 127.0.0.1, with wrap
// (optional) in front of it.
func startRegistry(t *testing.T, wrap func(http.Handler) http.Handler) string {
	t.Helper()
	var h http.Handler = registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func push(t *testing.T, ref string, img v1.Image) {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
}

func withXattrs(e entry, kv ...string) entry {
	e.Format = tar.FormatPAX
	e.PAXRecords = map[string]string{}
	for i := 0; i < len(kv); i += 2 {
		e.PAXRecords["SCHILY.xattr."+kv[i]] = kv[i+1]
	}
	return e
}

func owned(e entry, uid, gid int) entry {
	e.Uid, e.Gid = uid, gid
	return e
}

// testImage is three layers exercising every layer semantic.
func testImage(t *testing.T) v1.Image {
	l1 := ociLayerOf(t,
		dir("./", 0o755),
		dir("etc/", 0o755),
		file("etc/passwd", "root:x:0:0::/root:/bin/sh\n", 0o644),
		file("etc/shadow", "old\n", 0o640),
		dir("usr/", 0o755), dir("usr/bin/", 0o755), dir("usr/lib/", 0o755),
		file("usr/bin/tool", "#!/bin/sh\necho tool\n", 0o4755),
		hardlink("usr/bin/tool2", "usr/bin/tool"),
		withXattrs(file("usr/bin/ping", "ping\n", 0o755),
			"user.mime", "application/x-ping",
			"security.capability", "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
			"trusted.overlay.opaque", "y"),
		symlink("lib", "usr/lib"),
		dir("usr/share/", 0o755), dir("usr/share/doc/", 0o755),
		file("usr/share/doc/a", "a", 0o644), file("usr/share/doc/b", "b", 0o644),
		dir("opt/", 0o755), dir("opt/old/", 0o755), file("opt/old/x", "x", 0o644),
		dir("opt/old/sub/", 0o755), file("opt/old/sub/y", "y", 0o644),
		owned(dir("home/", 0o755), 0, 0), owned(dir("home/user/", 0o750), 1000, 1000),
		owned(file("home/user/.profile", "PS1=$\n", 0o640), 1000, 1000),
		owned(file("var-owned", "v", 0o640), 1234, 5678),
		dir("d2f/", 0o755), file("d2f/child", "c", 0o644),
		dir("tmp/", 0o1777),
		entry{Header: tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}},
	)
	l2 := ociLayerOf(t,
		file("usr/share/doc/.wh.a", "", 0o644),
		dir("opt/old/", 0o755),
		file("opt/old/new1", "1", 0o644), // same layer, before the marker: kept
		file("opt/old/.wh..wh..opq", "", 0o644),
		file("opt/old/new2", "2", 0o644), // after it: kept
		file(".wh.home", "", 0o644),
	)
	l3 := ociLayerOf(t,
		dir("home/", 0o755), dir("home/other/", 0o755), file("home/other/f", "o", 0o644),
		file("d2f", "now a file\n", 0o644), // a lower directory becomes a file
		file("etc/.wh.shadow", "", 0o644),
		file("etc/shadow", "new\n", 0o600),
		file("etc/motd", "hi\n", 0o644),
		file("etc/.wh.motd", "", 0o644), // same layer: does not hide motd
		hardlink("etc/passwd-link", "etc/passwd"),
		withXattrs(dir("srv/", 0o755), "user.dir", "1"),
	)
	return ociImageOf(t, func(c *v1.ConfigFile) {
		c.Config.Env = []string{"PATH=/usr/bin:/bin", "A=b=c", "bad-name=x"}
		c.Config.WorkingDir = "/srv"
		c.Config.User = "1000:1000"
		c.Config.Cmd = []string{"/usr/bin/tool"}
		// An empty-layer history entry between the layers' own.
		c.History = append(c.History[:1], append([]v1.History{{CreatedBy: "ENV A=b=c", EmptyLayer: true}}, c.History[1:]...)...)
	}, addHistory{l1, "ADD rootfs /"}, addHistory{l2, "RUN cleanup"}, addHistory{l3, "COPY app /srv"})
}

func TestImportOCIAppliesLayers(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img := testImage(t)
	lay := filepath.Join(t.TempDir(), "layout")
	writeLayout(t, lay, img, "app:1")

	tmpl, err := e.store.ImportOCI(ctx, OCISource{LayoutDir: lay, Ref: "app:1"}, ImportOptions{Tags: []string{"app"}})
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.Source != "oci:"+lay+"#app:1" {
		t.Errorf("source %q", tmpl.Source)
	}
	wantCfg := api.TemplateConfig{Env: map[string]string{"PATH": "/usr/bin:/bin", "A": "b=c"}, Workdir: "/srv", User: "1000:1000"}
	if fmt.Sprint(tmpl.Config) != fmt.Sprint(wantCfg) || tmpl.Config.Start != nil {
		t.Errorf("config %+v, want %+v (and no start command from Cmd)", tmpl.Config, wantCfg)
	}
	layers, _ := img.Layers()
	if len(tmpl.Layers) != 3 {
		t.Fatalf("layers %+v", tmpl.Layers)
	}
	for i, want := range []string{"ADD rootfs /", "RUN cleanup", "COPY app /srv"} {
		d, _ := layers[i].Digest()
		sz, _ := layers[i].Size()
		if got := tmpl.Layers[i]; got.Digest != d.String() || got.SizeBytes != sz || got.CreatedBy != want {
			t.Errorf("layer %d: %+v, want %s %d %q", i, got, d, sz, want)
		}
	}

	_, root, err := e.store.Resolve(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	read := func(p string) string {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			t.Errorf("%s: %v", p, err)
		}
		return string(b)
	}
	missing := func(p string) {
		if _, err := os.Lstat(filepath.Join(root, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s should not exist: %v", p, err)
		}
	}
	names := func(p string) string {
		ents, err := os.ReadDir(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		var ns []string
		for _, e := range ents {
			ns = append(ns, e.Name())
		}
		sort.Strings(ns)
		return strings.Join(ns, ",")
	}
	// Whiteouts and opaque directories.
	missing("usr/share/doc/a")
	read("usr/share/doc/b")
	if got := names("opt/old"); got != "new1,new2" {
		t.Errorf("opaque opt/old holds %s, want new1,new2", got)
	}
	if got := names("home"); got != "other" {
		t.Errorf("home holds %s after a whiteout and re-creation", got)
	}
	if got := read("etc/shadow"); got != "new\n" {
		t.Errorf("etc/shadow %q", got)
	}
	read("etc/motd")
	if st := stat(t, filepath.Join(root, "d2f")); st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o7777 != 0o644 {
		t.Errorf("d2f is not a 0644 file (the replaced directory's metadata must not apply): %o", st.Mode)
	}
	// No whiteout file is ever stored.
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), ".wh.") {
			t.Errorf("whiteout stored: %s", p)
		}
		return nil
	})
	// Hard links (also across layers), symlinks, modes, owners, devices.
	tool, tool2 := stat(t, filepath.Join(root, "usr/bin/tool")), stat(t, filepath.Join(root, "usr/bin/tool2"))
	if tool.Ino != tool2.Ino || tool.Mode&0o7777 != 0o755 {
		t.Errorf("tool: ino %d/%d mode %o (setuid must be stripped)", tool.Ino, tool2.Ino, tool.Mode&0o7777)
	}
	if a, b := stat(t, filepath.Join(root, "etc/passwd")), stat(t, filepath.Join(root, "etc/passwd-link")); a.Ino != b.Ino {
		t.Error("cross-layer hard link not preserved")
	}
	if target, err := os.Readlink(filepath.Join(root, "lib")); err != nil || target != "usr/lib" {
		t.Errorf("lib symlink: %q %v", target, err)
	}
	if st := stat(t, filepath.Join(root, "var-owned")); st.Uid != 1234 || st.Gid != 5678 || st.Mode&0o7777 != 0o640 {
		t.Errorf("var-owned: %d:%d %o", st.Uid, st.Gid, st.Mode&0o7777)
	}
	if st := stat(t, filepath.Join(root, "tmp")); st.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp mode %o", st.Mode&0o7777)
	}
	missing("dev/null")
	// xattrs: user.* kept, file capabilities and trusted.* dropped.
	if v, err := lgetxattr(filepath.Join(root, "usr/bin/ping"), "user.mime"); err != nil || string(v) != "application/x-ping" {
		t.Errorf("user.mime: %q %v", v, err)
	}
	for _, x := range []string{"security.capability", "trusted.overlay.opaque"} {
		if _, err := lgetxattr(filepath.Join(root, "usr/bin/ping"), x); !errors.Is(err, unix.ENODATA) {
			t.Errorf("%s not dropped: %v", x, err)
		}
	}
	if v, err := lgetxattr(filepath.Join(root, "srv"), "user.dir"); err != nil || string(v) != "1" {
		t.Errorf("directory xattr: %q %v", v, err)
	}
	// xattrs are part of the tree digest.
	if d, _, _, err := treeDigest(root, nil); err != nil || d != tmpl.TreeDigest {
		t.Fatalf("tree digest %s %v, want %s", d, err, tmpl.TreeDigest)
	}
	p := filepath.Join(root, "usr/bin/ping")
	if err := unix.Lsetxattr(p, "user.mime", []byte("text/plain"), 0); err != nil {
		t.Fatal(err)
	}
	d2, _, _, _ := treeDigest(root, nil)
	unix.Lsetxattr(p, "user.mime", []byte("application/x-ping"), 0)
	if d2 == tmpl.TreeDigest {
		t.Error("changing a user.* xattr does not change the tree digest")
	}
}

// The same image from a layout, an OCI-layout tar, a docker-save tar and a
// registry is the same template.
func TestImportOCISourcesAgree(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img := testImage(t)
	tmp := t.TempDir()
	lay := filepath.Join(tmp, "layout")
	writeLayout(t, lay, img, "")
	ociTar := filepath.Join(tmp, "oci.tar")
	tarDir(t, lay, ociTar)
	dockerTar := filepath.Join(tmp, "docker.tar")
	if err := tarball.WriteToFile(dockerTar, name.MustParseReference("app:1"), img); err != nil {
		t.Fatal(err)
	}
	host := startRegistry(t, nil)
	push(t, host+"/app:1", img)

	var digests, trees []string
	for _, src := range []OCISource{{LayoutDir: lay}, {ArchivePath: ociTar}, {ArchivePath: dockerTar, Ref: "app:1"}, {Image: host + "/app:1", AllowPrivate: true}} {
		tmpl, err := e.store.ImportOCI(ctx, src, ImportOptions{})
		if err != nil {
			t.Fatalf("%+v: %v", src, err)
		}
		digests = append(digests, tmpl.Digest)
		trees = append(trees, tmpl.TreeDigest)
	}
	// A gzip-compressed docker save, streamed (an upload).
	raw, err := os.ReadFile(dockerTar)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := e.store.ImportOCIStream(ctx, bytes.NewReader(gz(t, raw)), OCISource{Ref: "app:1"}, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	digests, trees = append(digests, tmpl.Digest), append(trees, tmpl.TreeDigest)
	if _, err := e.store.ImportOCIStream(ctx, bytes.NewReader(raw), OCISource{}, ImportOptions{MaxBytes: 1000}); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Errorf("streamed archive over the limit: %v", err)
	}
	if _, err := e.store.ImportOCIStream(ctx, bytes.NewReader(gz(t, raw)[:300]), OCISource{}, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("truncated streamed archive: %v", err)
	}
	// Damage past the spooling stage is reported without the spool path.
	swapped := filepath.Join(tmp, "swapped.tar")
	swapLayer(t, dockerTar, swapped)
	raw, _ = os.ReadFile(swapped)
	if _, err := e.store.ImportOCIStream(ctx, bytes.NewReader(raw), OCISource{}, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) ||
		strings.Contains(err.Error(), "oci-archive-") || !strings.Contains(err.Error(), "layer 1/3") {
		t.Errorf("damaged streamed archive: %v", err)
	}
	for i := 1; i < len(digests); i++ {
		if digests[i] != digests[0] || trees[i] != trees[0] {
			t.Errorf("source %d: %s (tree %s), want %s (tree %s)", i, digests[i], trees[i], digests[0], trees[0])
		}
	}
	e.assertClean(t, 1)
}

func TestImportOCIPlatformsRefsAndCompression(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	amd := ociImageOf(t, nil, addHistory{ociLayerOf(t, file("arch", "amd64", 0o644)), ""})
	// zstd layer on the arm64 image.
	data := mktar(t, file("arch", "arm64", 0o644))
	zl, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		tarball.WithCompression(compression.ZStd), tarball.WithMediaType(types.OCILayerZStd))
	if err != nil {
		t.Fatal(err)
	}
	arm := ociImageOf(t, func(c *v1.ConfigFile) { c.Architecture = "arm64" }, addHistory{zl, ""})
	idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex),
		mutate.IndexAddendum{Add: amd, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}})
	host := startRegistry(t, nil)
	ref, err := name.ParseReference(host + "/multi:1")
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, idx); err != nil {
		t.Fatal(err)
	}
	archOf := func(tmpl api.Template) string {
		_, root, err := e.store.Resolve(ctx, tmpl.Digest)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(filepath.Join(root, "arch"))
		return string(b)
	}
	tmpl, err := e.store.ImportOCI(ctx, OCISource{Image: ref.String(), AllowPrivate: true}, ImportOptions{})
	if err != nil || archOf(tmpl) != "amd64" {
		t.Fatalf("default platform: %v", err)
	}
	tmpl, err = e.store.ImportOCI(ctx, OCISource{Image: ref.String(), Platform: "linux/arm64", AllowPrivate: true}, ImportOptions{})
	if err != nil || archOf(tmpl) != "arm64" {
		t.Fatalf("linux/arm64 (zstd layer): %v", err)
	}
	if _, err := e.store.ImportOCI(ctx, OCISource{Image: ref.String(), Platform: "linux/s390x", AllowPrivate: true}, ImportOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing platform: %v", err)
	}
	if _, err := e.store.ImportOCI(ctx, OCISource{Image: host + "/nope:1", AllowPrivate: true}, ImportOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing image: %v", err)
	}
	// The same index in a layout; two named images in another.
	lay := filepath.Join(t.TempDir(), "multi")
	p, err := layout.Write(lay, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendIndex(idx); err != nil {
		t.Fatal(err)
	}
	tmpl, err = e.store.ImportOCI(ctx, OCISource{LayoutDir: lay, Platform: "linux/arm64"}, ImportOptions{})
	if err != nil || archOf(tmpl) != "arm64" {
		t.Fatalf("layout index: %v", err)
	}
	two := filepath.Join(t.TempDir(), "two")
	p = writeLayout(t, two, amd, "amd:1")
	if err := p.AppendImage(arm, layout.WithAnnotations(map[string]string{refNameAnno: "arm:1"})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.ImportOCI(ctx, OCISource{LayoutDir: two}, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "amd:1, arm:1") {
		t.Errorf("two images, no ref: %v", err)
	}
	if _, err := e.store.ImportOCI(ctx, OCISource{LayoutDir: two, Ref: "arm:1"}, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "for linux/arm64, not linux/amd64") {
		t.Errorf("arm image on amd64: %v", err)
	}
	tmpl, err = e.store.ImportOCI(ctx, OCISource{LayoutDir: two, Ref: "arm:1", Platform: "linux/arm64"}, ImportOptions{})
	if err != nil || archOf(tmpl) != "arm64" {
		t.Fatalf("pick by ref: %v", err)
	}
	// An uncompressed layer (its diff_id is its digest).
	plain := static.NewLayer(mktar(t, file("arch", "plain", 0o644)), types.OCIUncompressedLayer)
	ulay := filepath.Join(t.TempDir(), "plain")
	writeLayout(t, ulay, ociImageOf(t, nil, addHistory{plain, ""}), "")
	if tmpl, err = e.store.ImportOCI(ctx, OCISource{LayoutDir: ulay}, ImportOptions{}); err != nil || archOf(tmpl) != "plain" {
		t.Fatalf("uncompressed layer: %v", err)
	}
}

// hostileCase is an image that must be refused.
type hostileCase struct {
	name   string
	layers [][]entry
	// mangle, when set, changes the written layout (blob paths are
	// passed by layer index) before the import.
	mangle   func(t *testing.T, dir string, img v1.Image)
	img      func(t *testing.T) v1.Image
	maxBytes int64
	want     error
	msg      string
}

func blobFile(t *testing.T, dir string, h v1.Hash) string {
	return filepath.Join(dir, "blobs", h.Algorithm, h.Hex)
}

func layerDigest(t *testing.T, img v1.Image, i int) v1.Hash {
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, err := ls[i].Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func gzLayer(t *testing.T, b []byte, mt types.MediaType) v1.Layer { return static.NewLayer(b, mt) }

func TestImportOCIHostile(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	zeros := strings.Repeat("\x00", 1<<20)
	goodGz := gz(t, mktar(t, file("f", strings.Repeat("data ", 2000), 0o644)))
	cases := []hostileCase{
		{name: "dotdot", layers: [][]entry{{file("../escape", "x", 0o644)}}, want: errdefs.ErrInvalidArgument, msg: "escapes"},
		{name: "absolute", layers: [][]entry{{file("/etc/x", "x", 0o644)}}, want: errdefs.ErrInvalidArgument, msg: "absolute"},
		{name: "symlink then write across layers", layers: [][]entry{{symlink("evil", "/etc")}, {file("evil/pwned", "x", 0o644)}},
			want: errdefs.ErrInvalidArgument, msg: "may not be traversed"},
		{name: "symlink to parent then write", layers: [][]entry{{symlink("up", ".."), file("up/x", "x", 0o644)}},
			want: errdefs.ErrInvalidArgument, msg: "may not be traversed"},
		{name: "hard link out", layers: [][]entry{{hardlink("h", "../../etc/passwd")}}, want: errdefs.ErrInvalidArgument, msg: "escapes"},
		{name: "hard link through symlink", layers: [][]entry{{symlink("s", "/etc")}, {hardlink("h", "s/passwd")}},
			want: errdefs.ErrInvalidArgument, msg: "may not be traversed"},
		{name: "whiteout of ..", layers: [][]entry{{dir("a/", 0o755), file("a/.wh...", "", 0o644)}}, want: errdefs.ErrInvalidArgument, msg: "names no entry"},
		{name: "empty whiteout", layers: [][]entry{{file(".wh.", "", 0o644)}}, want: errdefs.ErrInvalidArgument, msg: "names no entry"},
		{name: "whiteout of the root", layers: [][]entry{{file("./.wh..", "", 0o644)}}, want: errdefs.ErrInvalidArgument, msg: "names no entry"},
		{name: "whiteout through symlink", layers: [][]entry{{symlink("s", "/etc")}, {file("s/.wh.passwd", "", 0o644)}},
			want: errdefs.ErrInvalidArgument, msg: "is a symlink"},
		{name: "opaque through symlink", layers: [][]entry{{symlink("s", "/tmp")}, {file("s/.wh..wh..opq", "", 0o644)}},
			want: errdefs.ErrInvalidArgument, msg: "may not be traversed"},
		{name: "whiteout as directory", layers: [][]entry{{file(".wh.x/y", "", 0o644)}}, want: errdefs.ErrInvalidArgument, msg: "whiteout name may not be a directory"},
		{name: "digest mismatch", layers: [][]entry{{file("f", "content", 0o644)}},
			mangle: func(t *testing.T, dir string, img v1.Image) {
				p := blobFile(t, dir, layerDigest(t, img, 0))
				b, _ := os.ReadFile(p)
				b[len(b)/2] ^= 0xff
				os.WriteFile(p, b, 0o644)
			}, want: errdefs.ErrInvalidArgument, msg: "blob digest mismatch"},
		{name: "missing blob", layers: [][]entry{{file("f", "a", 0o644)}, {file("g", "b", 0o644)}},
			mangle: func(t *testing.T, dir string, img v1.Image) { os.Remove(blobFile(t, dir, layerDigest(t, img, 1))) },
			want:   errdefs.ErrInvalidArgument, msg: "layer 2/2"},
		{name: "truncated gzip", img: func(t *testing.T) v1.Image {
			return ociImageOf(t, nil, addHistory{gzLayer(t, goodGz[:len(goodGz)/2], types.OCILayer), ""})
		}, want: errdefs.ErrInvalidArgument, msg: "truncated"},
		{name: "corrupt gzip", img: func(t *testing.T) v1.Image {
			b := bytes.Clone(goodGz)
			for i := 20; i < 60; i++ {
				b[i] ^= 0x5a
			}
			return ociImageOf(t, nil, addHistory{gzLayer(t, b, types.OCILayer), ""})
		}, want: errdefs.ErrInvalidArgument, msg: "gzip"},
		{name: "diff_id mismatch", img: func(t *testing.T) v1.Image {
			// A static gzip layer's diff_id is (wrongly) its blob digest.
			return ociImageOf(t, nil, addHistory{gzLayer(t, goodGz, types.OCILayer), ""})
		}, want: errdefs.ErrInvalidArgument, msg: "diff_id"},
		{name: "unsupported layer media type", img: func(t *testing.T) v1.Image {
			return ociImageOf(t, nil, addHistory{gzLayer(t, goodGz, "application/vnd.example.weird"), ""})
		}, want: errdefs.ErrInvalidArgument, msg: "unsupported media type"},
		{name: "not an image config", img: func(t *testing.T) v1.Image {
			return mutate.ConfigMediaType(ociImageOf(t, nil), "application/vnd.cncf.helm.config.v1+json")
		}, want: errdefs.ErrInvalidArgument, msg: "not an image config"},
		{name: "foreign layer", img: func(t *testing.T) v1.Image {
			img, err := mutate.Append(ociImageOf(t, nil), mutate.Addendum{Layer: gzLayer(t, goodGz, types.OCILayer),
				URLs: []string{"http://127.0.0.1:1/x"}})
			if err != nil {
				t.Fatal(err)
			}
			return img
		}, want: errdefs.ErrInvalidArgument, msg: "foreign"},
		{name: "compressed layer over the limit, refused unread", layers: [][]entry{{file("big", zeros, 0o644)}},
			mangle: func(t *testing.T, dir string, img v1.Image) {
				// Were it read, this would be "missing blob".
				os.Remove(blobFile(t, dir, layerDigest(t, img, 0)))
			}, maxBytes: 512, want: errdefs.ErrTooLarge, msg: "compressed"},
		{name: "uncompressed over the limit", layers: [][]entry{{file("small", "s", 0o644)}, {file("big", zeros, 0o644)}},
			maxBytes: 64 << 10, want: errdefs.ErrTooLarge, msg: `"big"`},
		{name: "manifest not JSON", mangle: func(t *testing.T, dir string, img v1.Image) {
			writeRawLayout(t, dir, []byte("this is not JSON"), types.OCIManifestSchema1)
		}, want: errdefs.ErrInvalidArgument, msg: "is not valid JSON"},
		{name: "config not JSON", mangle: func(t *testing.T, dir string, img v1.Image) {
			cfg := putBlob(t, dir, []byte("<config/>"), types.OCIConfigJSON)
			m := v1.Manifest{SchemaVersion: 2, MediaType: types.OCIManifestSchema1, Config: cfg, Layers: []v1.Descriptor{}}
			b, _ := jsonMarshal(m)
			writeRawLayout(t, dir, b, types.OCIManifestSchema1)
		}, want: errdefs.ErrInvalidArgument, msg: "image config is not valid JSON"},
		{name: "index not JSON", mangle: func(t *testing.T, dir string, img v1.Image) {
			os.WriteFile(filepath.Join(dir, "index.json"), []byte("{"), 0o644)
		}, want: errdefs.ErrInvalidArgument, msg: "index.json is not valid JSON"},
		{name: "unusable user, refused before reading layers", img: func(t *testing.T) v1.Image {
			return ociImageOf(t, func(c *v1.ConfigFile) { c.Config.User = "Bad User" }, addHistory{ociLayerOf(t, file("f", "x", 0o644)), ""})
		}, mangle: func(t *testing.T, dir string, img v1.Image) { os.Remove(blobFile(t, dir, layerDigest(t, img, 0))) },
			want: errdefs.ErrInvalidArgument, msg: "user"},
		{name: "layer count differs from diff_ids", img: func(t *testing.T) v1.Image {
			img := ociImageOf(t, nil, addHistory{ociLayerOf(t, file("f", "x", 0o644)), ""})
			cf, _ := img.ConfigFile()
			cf = cf.DeepCopy()
			cf.RootFS.DiffIDs = nil
			img, _ = mutate.ConfigFile(img, cf)
			return img
		}, want: errdefs.ErrInvalidArgument, msg: "diff_ids"},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			var img v1.Image
			if c.img != nil {
				img = c.img(t)
			} else {
				var ls []addHistory
				for _, es := range c.layers {
					ls = append(ls, addHistory{ociLayerOf(t, es...), ""})
				}
				img = ociImageOf(t, nil, ls...)
			}
			dir := filepath.Join(t.TempDir(), "layout")
			writeLayout(t, dir, img, "")
			if c.mangle != nil {
				c.mangle(t, dir, img)
			}
			_, err := e.store.ImportOCI(ctx, OCISource{LayoutDir: dir}, ImportOptions{MaxBytes: c.maxBytes, Tags: []string{"bad"}})
			if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("got %v, want %v containing %q", err, c.want, c.msg)
			}
			t.Log(err)
			e.assertClean(t, 0)
		})
	}
	if _, err := os.Lstat("/etc/pwned"); err == nil {
		t.Fatal("a hostile layer wrote /etc/pwned")
	}
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }

// putBlob stores b in the layout at dir and describes it.
func putBlob(t *testing.T, dir string, b []byte, mt types.MediaType) v1.Descriptor {
	t.Helper()
	sum := sha256.Sum256(b)
	h := v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])}
	if err := os.MkdirAll(filepath.Join(dir, "blobs", "sha256"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(blobFile(t, dir, h), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return v1.Descriptor{MediaType: mt, Size: int64(len(b)), Digest: h}
}

// writeRawLayout makes dir's index.json point at the raw manifest.
func writeRawLayout(t *testing.T, dir string, manifest []byte, mt types.MediaType) {
	t.Helper()
	d := putBlob(t, dir, manifest, mt)
	idx, _ := jsonMarshal(v1.IndexManifest{SchemaVersion: 2, MediaType: types.OCIImageIndex, Manifests: []v1.Descriptor{d}})
	if err := os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestImportOCIArchiveAndRegistryFailures(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img := ociImageOf(t, nil, addHistory{ociLayerOf(t, file("f", strings.Repeat("abc", 10000), 0o644)), ""})
	tmp := t.TempDir()

	// A gzip-compressed docker save, and a tar that is neither format.
	dockerTar := filepath.Join(tmp, "docker.tar")
	if err := tarball.WriteToFile(dockerTar, name.MustParseReference("app:1"), img); err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(dockerTar)
	os.WriteFile(filepath.Join(tmp, "docker.tar.gz"), gz(t, raw), 0o644)
	os.WriteFile(filepath.Join(tmp, "other.tar"), mktar(t, file("hello", "x", 0o644)), 0o644)
	// A docker save whose layer was swapped for another of the same size.
	swapped := filepath.Join(tmp, "swapped.tar")
	swapLayer(t, dockerTar, swapped)
	for _, c := range []struct {
		src  OCISource
		want error
		msg  string
	}{
		{OCISource{ArchivePath: filepath.Join(tmp, "docker.tar.gz")}, errdefs.ErrInvalidArgument, "gzip-compressed"},
		{OCISource{ArchivePath: filepath.Join(tmp, "other.tar")}, errdefs.ErrInvalidArgument, "neither"},
		{OCISource{ArchivePath: filepath.Join(tmp, "missing.tar")}, errdefs.ErrNotFound, "missing.tar"},
		{OCISource{ArchivePath: dockerTar, Ref: "other:2"}, errdefs.ErrNotFound, "app:1"},
		// The legacy format names no blob digest: the damage shows as such.
		{OCISource{ArchivePath: swapped}, errdefs.ErrInvalidArgument, ".tar.gz): corrupt"},
		{OCISource{LayoutDir: tmp, ArchivePath: dockerTar}, errdefs.ErrInvalidArgument, "exactly one"},
		{OCISource{LayoutDir: filepath.Join(tmp, "nope")}, errdefs.ErrNotFound, "nope"},
		{OCISource{Image: "127.0.0.1:1/x:1", Platform: "amd64", AllowPrivate: true}, errdefs.ErrInvalidArgument, "platform"},
	} {
		_, err := e.store.ImportOCI(ctx, c.src, ImportOptions{})
		if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%+v: got %v, want %v containing %q", c.src, err, c.want, c.msg)
		}
	}

	// A registry that serves a corrupted layer, and counts layer fetches.
	ld := layerDigest(t, img, 0)
	var layerGets atomic.Int32
	corrupt := atomic.Bool{}
	host := startRegistry(t, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/blobs/"+ld.String()) {
				layerGets.Add(1)
				if corrupt.Load() {
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, r)
					b := rec.Body.Bytes()
					b[len(b)/2] ^= 0xff
					for k, v := range rec.Header() {
						w.Header()[k] = v
					}
					w.WriteHeader(rec.Code)
					w.Write(b)
					return
				}
			}
			h.ServeHTTP(w, r)
		})
	})
	push(t, host+"/app:1", img)
	layerGets.Store(0)
	size, _ := img.Layers()
	lsz, _ := size[0].Size()
	_, err := e.store.ImportOCI(ctx, OCISource{Image: host + "/app:1", AllowPrivate: true}, ImportOptions{MaxBytes: lsz - 1})
	if !errors.Is(err, errdefs.ErrTooLarge) || layerGets.Load() != 0 {
		t.Errorf("over-limit layer: %v after %d layer downloads (want ErrTooLarge before any)", err, layerGets.Load())
	}
	corrupt.Store(true)
	_, err = e.store.ImportOCI(ctx, OCISource{Image: host + "/app:1", AllowPrivate: true}, ImportOptions{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "mismatch") {
		t.Errorf("corrupt registry blob: %v", err)
	}
	t.Log(err)
	e.assertClean(t, 0)

	tmpl, err := e.store.ImportOCIStream(ctx, bytes.NewReader(raw), OCISource{Ref: "app:1"}, ImportOptions{})
	if err != nil || tmpl.Source != "oci:upload#app:1" {
		t.Errorf("streamed import: source %q, %v", tmpl.Source, err)
	}
	e.assertClean(t, 1)
}

// swapLayer copies a docker-save tar, replacing the layer content with
// other bytes of the same length.
func swapLayer(t *testing.T, in, out string) {
	t.Helper()
	f, err := os.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		if strings.HasSuffix(h.Name, ".tar.gz") {
			b = bytes.Clone(b)
			b[len(b)/2] ^= 0xff
		}
		tw.WriteHeader(h)
		tw.Write(b)
	}
	tw.Close()
	os.WriteFile(out, buf.Bytes(), 0o644)
}

func TestRegistryTransportPolicy(t *testing.T) {
	for _, c := range []struct {
		rt       registryTransport
		scheme   string
		host     string
		allowed  bool
		describe string
	}{
		{registryTransport{loopbackRegistry: true}, "http", "127.0.0.1:5000", true, "loopback registry over http"},
		{registryTransport{loopbackRegistry: true}, "http", "localhost:5000", true, "localhost over http"},
		{registryTransport{}, "http", "10.0.0.5:5000", false, "private address over http without insecure"},
		{registryTransport{}, "https", "10.0.0.5:5000", true, "private address over https"},
		{registryTransport{insecure: true}, "http", "10.0.0.5:5000", true, "insecure"},
		{registryTransport{}, "https", "127.0.0.1:8080", false, "remote registry redirecting to this host"},
		{registryTransport{}, "http", "[::1]:80", false, "remote registry redirecting to ::1"},
	} {
		if err := c.rt.allow(c.scheme, c.host); (err == nil) != c.allowed {
			t.Errorf("%s: %v", c.describe, err)
		}
	}
}

// writeTarFile writes a tar of entries to p.
func writeTarFile(t *testing.T, p string, entries ...entry) {
	t.Helper()
	if err := os.WriteFile(p, mktar(t, entries...), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The legacy `docker save` format: uncompressed layer.tar files named by
// layer id, a duplicate layer stored as a symlink, no blob digests.
func TestImportOCILegacyDockerSave(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	l1 := mktar(t, dir("etc/", 0o755), file("etc/hostname", "legacy\n", 0o644))
	sum := sha256.Sum256(l1)
	diffID := "sha256:" + hex.EncodeToString(sum[:])
	cfg := fmt.Sprintf(`{"architecture":"amd64","os":"linux","config":{"Env":["X=1"],"WorkingDir":"/etc"},`+
		`"rootfs":{"type":"layers","diff_ids":[%q,%q]}}`, diffID, diffID)
	csum := sha256.Sum256([]byte(cfg))
	cfgName := hex.EncodeToString(csum[:]) + ".json"
	manifest := fmt.Sprintf(`[{"Config":%q,"RepoTags":["legacy:1"],"Layers":["aaa/layer.tar","bbb/layer.tar"]}]`, cfgName)
	tmp := t.TempDir()
	good := filepath.Join(tmp, "legacy.tar")
	writeTarFile(t, good,
		file("manifest.json", manifest, 0o644),
		file(cfgName, cfg, 0o644),
		dir("aaa/", 0o755), file("aaa/layer.tar", string(l1), 0o644),
		dir("bbb/", 0o755), symlink("bbb/layer.tar", "../aaa/layer.tar"))
	tmpl, err := e.store.ImportOCI(ctx, OCISource{ArchivePath: good, Ref: "docker.io/library/legacy:1"}, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.Config.Env["X"] != "1" || tmpl.Config.Workdir != "/etc" || len(tmpl.Layers) != 2 || tmpl.Layers[0].Digest != diffID {
		t.Errorf("template %+v", tmpl)
	}
	_, root, _ := e.store.Resolve(ctx, tmpl.Digest)
	if b, err := os.ReadFile(filepath.Join(root, "etc/hostname")); err != nil || string(b) != "legacy\n" {
		t.Errorf("etc/hostname %q %v", b, err)
	}

	for _, c := range []struct {
		name    string
		entries []entry
		msg     string
	}{
		{"layer link out of the archive", []entry{file("manifest.json", manifest, 0o644), file(cfgName, cfg, 0o644),
			file("aaa/layer.tar", string(l1), 0o644), symlink("bbb/layer.tar", "../../../etc/passwd")}, "missing layer blob bbb/layer.tar"},
		{"config digest mismatch", []entry{file("manifest.json", manifest, 0o644), file(cfgName, cfg+" ", 0o644),
			file("aaa/layer.tar", string(l1), 0o644), file("bbb/layer.tar", string(l1), 0o644)}, "digest mismatch"},
		{"layer differs from its diff_id", []entry{file("manifest.json", manifest, 0o644), file(cfgName, cfg, 0o644),
			file("aaa/layer.tar", string(l1), 0o644), file("bbb/layer.tar", string(mktar(t, file("other", "x", 0o644))), 0o644)}, "diff_id"},
		{"manifest not JSON", []entry{file("manifest.json", "[{", 0o644)}, "manifest.json is not valid JSON"},
		{"truncated archive", nil, "truncated inside entry \"aaa/layer.tar\""},
	} {
		p := filepath.Join(tmp, strings.ReplaceAll(c.name, " ", "-")+".tar")
		if c.entries != nil {
			writeTarFile(t, p, c.entries...)
		} else {
			b, _ := os.ReadFile(good)
			os.WriteFile(p, b[:len(b)/2], 0o644)
		}
		_, err := e.store.ImportOCI(ctx, OCISource{ArchivePath: p}, ImportOptions{})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: %v, want %q", c.name, err, c.msg)
		}
	}
	e.assertClean(t, 1)
}

// Cancelling an import mid-download leaves nothing behind.
func TestImportOCICancel(t *testing.T) {
	e := newEnv(t)
	img := ociImageOf(t, nil, addHistory{ociLayerOf(t, file("a", "a", 0o644)), ""}, addHistory{ociLayerOf(t, file("b", "b", 0o644)), ""})
	second := layerDigest(t, img, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	host := startRegistry(t, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/blobs/"+second.String()) {
				cancel()
			}
			h.ServeHTTP(w, r)
		})
	})
	push(t, host+"/app:1", img)
	_, err := e.store.ImportOCI(ctx, OCISource{Image: host + "/app:1", AllowPrivate: true}, ImportOptions{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled import: %v", err)
	}
	e.assertClean(t, 0)
}

func TestCopyUserXattrs(t *testing.T) {
	src, dst := t.TempDir(), t.TempDir()
	if err := unix.Lsetxattr(src, "user.a", []byte("1"), 0); err != nil {
		t.Skipf("no user xattrs here: %v", err)
	}
	unix.Lsetxattr(src, "trusted.b", []byte("2"), 0)
	if err := copyUserXattrs(src, dst); err != nil {
		t.Fatal(err)
	}
	if v, err := lgetxattr(dst, "user.a"); err != nil || string(v) != "1" {
		t.Errorf("user.a: %q %v", v, err)
	}
	if _, err := lgetxattr(dst, "trusted.b"); !errors.Is(err, unix.ENODATA) {
		t.Errorf("trusted.b copied: %v", err)
	}
	ds, _, _, _ := treeDigest(src, nil)
	dd, _, _, _ := treeDigest(dst, nil)
	if ds != dd {
		t.Error("copy has another tree digest")
	}
}

// A pull may not reach this host's or its network's private addresses
// unless the server allows it, whatever name the registry is given by.
func TestPullRefusesPrivateAddresses(t *testing.T) {
	e := newEnv(t)
	img := ociImageOf(t, nil, addHistory{ociLayerOf(t, file("a", "a", 0o644)), ""})
	host := startRegistry(t, nil)
	push(t, host+"/app:1", img)
	_, port, _ := net.SplitHostPort(host)
	for _, ref := range []string{host + "/app:1", "localhost:" + port + "/app:1"} {
		_, err := e.store.ImportOCI(context.Background(), OCISource{Image: ref}, ImportOptions{})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "not allowed by this server") {
			t.Errorf("%s: %v", ref, err)
		}
	}
	e.assertClean(t, 0)
}
