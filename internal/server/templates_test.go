package server

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/templatesvc"
)

// templateServer is a Server with a real template store and no runtimes:
// enough for everything that happens before a build or import needs one.
func templateServer(t *testing.T) (*Server, string) {
	t.Helper()
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tmpl.Close() })
	s := &Server{cfg: Config{Logger: slog.Default(), MaxTemplateBytes: 1 << 20, AllowPrivateRegistries: true}, db: db, tmpl: tmpl,
		metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890"}
	withKeys(t, s)
	s.tmplsvc = templatesvc.New(templatesvc.Config{Templates: tmpl, Logger: s.cfg.Logger, MaxBytes: s.cfg.MaxTemplateBytes,
		AllowPrivateRegistries: s.cfg.AllowPrivateRegistries})
	return s, filepath.Join(dir, "templates", "tmp")
}

type tarEntry struct {
	name, body, link string
	typ              byte
}

func mkTar(t *testing.T, entries ...tarEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: 0o644, Size: int64(len(e.body)), Linkname: e.link}
		if e.typ == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		io.WriteString(tw, e.body)
	}
	tw.Close()
	return b.Bytes()
}

// TestBuildRejectsBeforeStreaming checks that every problem found before a
// build starts is an ordinary JSON error naming it, and that the uploaded
// context is removed whatever happens.
func TestBuildRejectsBeforeStreaming(t *testing.T) {
	s, tmp := templateServer(t)
	h := s.routes()
	secret := filepath.Join(t.TempDir(), "secret")
	os.WriteFile(secret, []byte("TOPSECRET host file\n"), 0o600)
	good := tarEntry{name: "Dockerfile", body: "FROM base\n"}
	for _, c := range []struct {
		name   string
		query  string
		body   []byte
		status int
		msg    string
	}{
		{"absolute file", "file=/etc/passwd", mkTar(t, good), 400, "relative path inside the build context"},
		{"escaping file", "file=../x", mkTar(t, good), 400, "relative path inside the build context"},
		{"bad no_cache", "no_cache=maybe", mkTar(t, good), 400, "no_cache"},
		{"bad tag", "tag=Bad%20Tag", mkTar(t, good), 400, "template name"},
		{"missing build file", "", mkTar(t, tarEntry{name: "other", body: "x"}), 400, `build file "Dockerfile" is not in the build context`},
		{"parse error", "", mkTar(t, tarEntry{name: "Dockerfile", body: "FROM base\nFROBNICATE x\n"}), 400, "line 2"},
		{"symlink to a host file", "", mkTar(t, tarEntry{name: "Dockerfile", typ: tar.TypeSymlink, link: secret}), 400, "Dockerfile"},
		{"directory", "file=d", mkTar(t, tarEntry{name: "d/", typ: tar.TypeDir}), 400, "not a regular file"},
		{"hostile context", "", mkTar(t, good, tarEntry{name: "../escape", body: "x"}), 400, "escapes the archive root"},
		{"truncated context", "", mkTar(t, good)[:700], 400, "truncated"},
		{"too large", "", mkTar(t, good, tarEntry{name: "big", body: strings.Repeat("x", 2<<20)}), 413, "limit"},
	} {
		t.Run(c.name, func(t *testing.T) {
			req := httptest.NewRequest("POST", "/v1/templates/build?"+c.query, bytes.NewReader(c.body))
			req.Header.Set("Authorization", "Bearer "+s.apiKey)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			var e api.Error
			if rec.Code != c.status || json.Unmarshal(rec.Body.Bytes(), &e) != nil || !strings.Contains(e.Error.Message, c.msg) {
				t.Fatalf("%d %s, want %d with %q", rec.Code, rec.Body, c.status, c.msg)
			}
			if strings.Contains(rec.Body.String(), "TOPSECRET") {
				t.Fatalf("a host file's content leaked through the build file: %s", rec.Body)
			}
			if left, _ := os.ReadDir(tmp); len(left) != 0 {
				t.Fatalf("left behind in tmp/: %v", left)
			}
		})
	}
}

func TestImportFormats(t *testing.T) {
	s, tmp := templateServer(t)
	h := s.routes()
	post := func(query string, body []byte) (int, api.Error) {
		req := httptest.NewRequest("POST", "/v1/templates?"+query, bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+s.apiKey)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var e api.Error
		json.Unmarshal(rec.Body.Bytes(), &e)
		return rec.Code, e
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(mkTar(t, tarEntry{name: "manifest.json", body: "[]"}))
	zw.Close()
	bad := append([]byte(nil), gz.Bytes()...)
	bad[len(bad)-6] ^= 0xff // break the CRC
	for _, c := range []struct {
		query  string
		body   []byte
		status int
		msg    string
	}{
		{"format=zip", mkTar(t, tarEntry{name: "a", body: "x"}), 400, `format "zip"`},
		{"format=archive", mkTar(t, tarEntry{name: "a", body: "x"}), 400, "not a template archive"},
		{"format=oci", []byte("not a tar at all, just some bytes that go on for a while"), 400, "image archive upload: not a tar"},
		{"format=oci", gz.Bytes(), 400, ""},      // a decompressed, but empty, docker-save manifest
		{"format=oci", bad, 400, "corrupt gzip"}, // checksum caught while spooling
		{"format=oci", gz.Bytes()[:20], 400, "gzip"},
	} {
		code, e := post(c.query, c.body)
		if code != c.status || !strings.Contains(e.Error.Message, c.msg) {
			t.Errorf("%s: %d %+v, want %d %q", c.query, code, e, c.status, c.msg)
		}
		if strings.Contains(e.Error.Message, tmp) {
			t.Errorf("%s: the error names a server path: %s", c.query, e.Error.Message)
		}
		if left, _ := os.ReadDir(tmp); len(left) != 0 {
			t.Fatalf("%s: left behind in tmp/: %v", c.query, left)
		}
	}
}

// ndjson decodes a build stream.
func ndjson(t *testing.T, body []byte) []api.BuildEvent {
	t.Helper()
	var out []api.BuildEvent
	for _, l := range strings.Split(strings.TrimSpace(string(body)), "\n") {
		var ev api.BuildEvent
		if err := json.Unmarshal([]byte(l), &ev); err != nil {
			t.Fatalf("stream line %q: %v", l, err)
		}
		out = append(out, ev)
	}
	return out
}

// TestBuildStream runs builds without RUN steps (no sandbox runtime here):
// events stream as NDJSON, the last one carries the template or the error,
// and a build file sent from outside the context is not part of it.
func TestBuildStream(t *testing.T) {
	s, tmp := templateServer(t)
	h := s.routes()
	base, err := s.tmpl.ImportTar(context.Background(), bytes.NewReader(mkTar(t,
		tarEntry{name: "etc/", typ: tar.TypeDir}, tarEntry{name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n"})),
		template.ImportOptions{Tags: []string{"mini:1"}})
	if err != nil {
		t.Fatal(err)
	}
	post := func(query string, body []byte) *httptest.ResponseRecorder {
		req := httptest.NewRequest("POST", "/v1/templates/build?"+query, bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+s.apiKey)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	rec := post("file=.space-build/app.Dockerfile&tag=app:1", mkTar(t,
		tarEntry{name: "hello.txt", body: "hi\n"},
		tarEntry{name: ".space-build/app.Dockerfile", body: "FROM mini:1\nCOPY . /ctx/\nENV A=b\n"}))
	if rec.Code != 200 || rec.Header().Get("Content-Type") != "application/x-ndjson" {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	evs := ndjson(t, rec.Body.Bytes())
	var statuses []string
	for _, ev := range evs[:len(evs)-1] {
		statuses = append(statuses, fmt.Sprintf("%d/%d %s", ev.Step, ev.Steps, ev.Status))
	}
	if got := strings.Join(statuses, ","); got != "1/3 running,1/3 done,2/3 running,2/3 done,3/3 running,3/3 done" {
		t.Fatalf("events %s", got)
	}
	final := evs[len(evs)-1]
	if final.Template == nil || final.Error != nil || final.Template.Config.Env["A"] != "b" || len(final.Template.Tags) != 1 || final.Template.Tags[0] != "app:1" {
		t.Fatalf("final event %+v", final)
	}
	_, rootfs, err := s.tmpl.Resolve(context.Background(), "app:1")
	if err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(filepath.Join(rootfs, "ctx"))
	if len(ents) != 1 || ents[0].Name() != "hello.txt" {
		t.Fatalf("COPY . saw %v, want only hello.txt (the outside build file must not be in the context)", ents)
	}
	if t2, _ := s.tmpl.Get(context.Background(), final.Template.Parent); t2.Parent != base.Digest {
		t.Errorf("parent chain: %+v", t2)
	}

	// A step that fails: a "failed" event, then the error as the last line.
	rec = post("", mkTar(t, tarEntry{name: "Dockerfile", body: "FROM mini:1\nCOPY missing.txt /\n"}))
	evs = ndjson(t, rec.Body.Bytes())
	final = evs[len(evs)-1]
	if rec.Code != 200 || evs[len(evs)-2].Status != "failed" || final.Error == nil || final.Error.Code != "not_found" ||
		!strings.Contains(final.Error.Message, "step 2/2 (line 2) COPY missing.txt") {
		t.Fatalf("failing build: %d %s", rec.Code, rec.Body)
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Fatalf("left behind in tmp/: %v", left)
	}
}

// TestPullAndOCIUpload pulls an image from an in-process registry and
// uploads the same image as a gzip-compressed docker-save archive: both
// give the same template.
func TestPullAndOCIUpload(t *testing.T) {
	s, tmp := templateServer(t)
	h := s.routes()
	data := mkTar(t, tarEntry{name: "app/", typ: tar.TypeDir}, tarEntry{name: "app/hello.txt", body: "hello\n"})
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := img.ConfigFile()
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", "amd64"
	cfg.Config.Env = []string{"GREETING=hi"}
	cfg.Config.WorkingDir = "/app"
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		t.Fatal(err)
	}
	reg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer reg.Close()
	ref, err := name.ParseReference(strings.TrimPrefix(reg.URL, "http://") + "/app:1")
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}

	do := func(path, ctype string, body []byte) (int, api.Template, api.Error) {
		req := httptest.NewRequest("POST", path, bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+s.apiKey)
		req.Header.Set("Content-Type", ctype)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var tpl api.Template
		var e api.Error
		json.Unmarshal(rec.Body.Bytes(), &tpl)
		json.Unmarshal(rec.Body.Bytes(), &e)
		return rec.Code, tpl, e
	}
	code, pulled, e := do("/v1/templates/pull", "application/json", []byte(`{"image":"`+ref.String()+`","tags":["pulled:1"]}`))
	if code != 201 || pulled.Config.Env["GREETING"] != "hi" || pulled.Config.Workdir != "/app" || pulled.Tags[0] != "pulled:1" || len(pulled.Layers) != 1 {
		t.Fatalf("pull: %d %+v %+v", code, pulled, e)
	}
	if code, _, e := do("/v1/templates/pull", "application/json", []byte(`{"image":" "}`)); code != 400 || !strings.Contains(e.Error.Message, "image is empty") {
		t.Errorf("empty image: %d %+v", code, e)
	}
	if code, _, e := do("/v1/templates/pull", "application/json", []byte(`{"image":"`+ref.Context().String()+`:nope"}`)); code != 404 {
		t.Errorf("missing tag: %d %+v", code, e)
	}

	var saved, gz bytes.Buffer
	if err := tarball.Write(ref, img, &saved); err != nil {
		t.Fatal(err)
	}
	zw := gzip.NewWriter(&gz)
	zw.Write(saved.Bytes())
	zw.Close()
	code, uploaded, e := do("/v1/templates?format=oci&tag=up:1", "application/gzip", gz.Bytes())
	// The same image dedups to the pulled template, now with both tags.
	if code != 201 || uploaded.Digest != pulled.Digest || strings.Join(uploaded.Tags, ",") != "pulled:1,up:1" {
		t.Fatalf("upload: %d %+v %+v (pulled %s)", code, uploaded, e, pulled.Digest)
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Fatalf("left behind in tmp/: %v", left)
	}
}
