package containerdtest

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
)

// File is one entry of an image layer: a regular file (Data, Mode), a
// directory (Dir) or a symlink (Link).
type File struct {
	Data []byte
	Mode int64
	Dir  bool
	Link string
}

// Image describes a one-layer OCI image.
type Image struct {
	Name       string          // e.g. "localhost/space/busybox:1"
	Files      map[string]File // path inside the image (no leading /) → entry
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
}

// BuildImage writes img as an OCI image-layout tarball in dir, whose
// index names it (io.containerd.image.name) for ctr images import, and
// returns its path.
func BuildImage(t testing.TB, dir string, img Image) string {
	t.Helper()
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	names := make([]string, 0, len(img.Files))
	for n := range img.Files {
		names = append(names, n)
	}
	sort.Strings(names)
	mtime := time.Unix(1700000000, 0)
	for _, n := range names {
		f := img.Files[n]
		h := &tar.Header{Name: n, ModTime: mtime, Mode: f.Mode, Format: tar.FormatPAX}
		switch {
		case f.Dir:
			h.Typeflag, h.Name = tar.TypeDir, strings.TrimSuffix(n, "/")+"/"
			if h.Mode == 0 {
				h.Mode = 0o755
			}
		case f.Link != "":
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, f.Link, 0o777
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
			if h.Mode == 0 {
				h.Mode = 0o644
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write(f.Data)
		}
	}
	tw.Close()

	blobs := map[string][]byte{}
	put := func(b []byte) (string, int) {
		sum := sha256.Sum256(b)
		d := "sha256:" + hex.EncodeToString(sum[:])
		blobs[d] = b
		return d, len(b)
	}
	layerDigest, layerSize := put(layer.Bytes())
	env := img.Env
	if env == nil {
		env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	}
	cfg, _ := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH, "os": "linux", "created": mtime.UTC().Format(time.RFC3339),
		"config": map[string]any{"Entrypoint": img.Entrypoint, "Cmd": img.Cmd, "Env": env, "WorkingDir": img.WorkingDir},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
	})
	cfgDigest, cfgSize := put(cfg)
	manifest, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfgDigest, "size": cfgSize},
		"layers": []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layerDigest, "size": layerSize}},
	})
	mDigest, mSize := put(manifest)
	index, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
		"manifests": []any{map[string]any{
			"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mDigest, "size": mSize,
			"platform":    map[string]any{"architecture": runtime.GOARCH, "os": "linux"},
			"annotations": map[string]any{"io.containerd.image.name": img.Name, "org.opencontainers.image.ref.name": img.Name[strings.LastIndex(img.Name, ":")+1:]},
		}},
	})

	path := filepath.Join(dir, strings.NewReplacer("/", "_", ":", "_").Replace(img.Name)+".tar")
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	ow := tar.NewWriter(out)
	add := func(name string, b []byte) {
		ow.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: mtime, Typeflag: tar.TypeReg})
		ow.Write(b)
	}
	add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	add("index.json", index)
	ds := make([]string, 0, len(blobs))
	for d := range blobs {
		ds = append(ds, d)
	}
	sort.Strings(ds)
	for _, d := range ds {
		add("blobs/sha256/"+strings.TrimPrefix(d, "sha256:"), blobs[d])
	}
	if err := ow.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

// BusyboxImage builds a one-layer image of Debian's static busybox
// (/bin/busybox, a symlink per applet, /etc/passwd and /etc/group with
// root and nobody, /tmp, /root) named name, running cmd by default.
func BusyboxImage(t testing.TB, dir, name string, cmd []string) string {
	t.Helper()
	const bb = "/bin/busybox"
	data, err := os.ReadFile(bb)
	testenv.Require(t, "busybox-static", err == nil, "apt-get install busybox-static (scripts/setup-test.sh)")
	if out, err := exec.Command("file", "-L", bb).Output(); err == nil && strings.Contains(string(out), "dynamically linked") {
		t.Fatalf("%s is dynamically linked; install busybox-static", bb)
	}
	list, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	files := map[string]File{
		"bin": {Dir: true}, "etc": {Dir: true}, "tmp": {Dir: true, Mode: 0o1777}, "root": {Dir: true, Mode: 0o700},
		"bin/busybox": {Data: data, Mode: 0o755},
		"etc/passwd":  {Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")},
		"etc/group":   {Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
	}
	for _, a := range strings.Fields(string(list)) {
		if a != "busybox" {
			files["bin/"+a] = File{Link: "busybox"}
		}
	}
	return BuildImage(t, dir, Image{Name: name, Files: files, Cmd: cmd, WorkingDir: "/"})
}
