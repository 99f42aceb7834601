package server

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
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
	s := &Server{cfg: Config{Logger: slog.Default(), MaxTemplateBytes: 1 << 20}, db: db, tmpl: tmpl,
		metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890"}
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
