package sdk

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func TestTemplateRoutes(t *testing.T) {
	ctx := context.Background()
	c, got := recorder(t, 200, map[string]any{})
	for i, cl := range []struct {
		do   func() error
		want seen
	}{
		{func() error { return c.RemoveTemplate(ctx, "sha256:abcdef012345", true) },
			seen{Method: "DELETE", Path: "/v1/templates/sha256:abcdef012345", Query: "force=true"}},
		{func() error { _, err := c.TagTemplate(ctx, "app:1", "app:stable"); return err },
			seen{Method: "POST", Path: "/v1/templates/app:1/tags", Body: `{"tag":"app:stable"}`, ContentType: "application/json"}},
		{func() error { _, err := c.GCTemplates(ctx); return err },
			seen{Method: "POST", Path: "/v1/templates/gc"}},
		{func() error { return c.ExportTemplate(ctx, "app:1", io.Discard) },
			seen{Method: "GET", Path: "/v1/templates/app:1/export"}},
		{func() error {
			_, err := c.ImportTemplateArchive(ctx, strings.NewReader("A"), "a:1", "b:2")
			return err
		}, seen{Method: "POST", Path: "/v1/templates", Query: "format=archive&tag=a%3A1&tag=b%3A2", Body: "A", ContentType: "application/x-tar"}},
		{func() error { _, err := c.ImportOCI(ctx, strings.NewReader("O")); return err },
			seen{Method: "POST", Path: "/v1/templates", Query: "format=oci", Body: "O", ContentType: "application/x-tar"}},
		{func() error {
			_, err := c.PullTemplate(ctx, api.PullRequest{Image: "127.0.0.1:5000/app:1", Tags: []string{"app:1"}, Insecure: true})
			return err
		}, seen{Method: "POST", Path: "/v1/templates/pull", Body: `{"image":"127.0.0.1:5000/app:1","tags":["app:1"],"insecure":true}`, ContentType: "application/json"}},
	} {
		if err := cl.do(); err != nil {
			t.Fatalf("call %d (%s %s): %v", i, cl.want.Method, cl.want.Path, err)
		}
		g := (*got)[len(*got)-1]
		g.Body = strings.TrimSpace(g.Body)
		g.Auth = ""
		if g != cl.want {
			t.Errorf("call %d:\n got %+v\nwant %+v", i, g, cl.want)
		}
	}
	// Bad arguments never reach the server.
	n := len(*got)
	for name, err := range map[string]error{
		"empty tag":     func() error { _, err := c.TagTemplate(ctx, "a:1", ""); return err }(),
		"empty image":   func() error { _, err := c.PullTemplate(ctx, api.PullRequest{Image: " "}); return err }(),
		"bad format":    func() error { _, err := c.ImportTemplateFormat(ctx, "zip", strings.NewReader("")); return err }(),
		"no body":       func() error { _, err := c.ImportOCI(ctx, nil); return err }(),
		"empty ref":     c.RemoveTemplate(ctx, "", false),
		"empty context": func() error { _, err := c.BuildTemplate(ctx, "", BuildOptions{}, nil); return err }(),
	} {
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if len(*got) != n {
		t.Fatalf("invalid calls reached the server: %+v", (*got)[n:])
	}
}

// buildServer answers POST /v1/templates/build with body after recording
// the request and its context tar.
func buildServer(t *testing.T, body string) (*Client, *http.Request, *[]byte) {
	t.Helper()
	var (
		req  http.Request
		tarb []byte
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tarb, _ = io.ReadAll(r.Body)
		req = *r
		w.Header().Set("Content-Type", "application/x-ndjson")
		io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	c, _ := New(srv.URL, testKey)
	return c, &req, &tarb
}

func TestBuildTemplateStream(t *testing.T) {
	exit := 3
	for _, tc := range []struct {
		name    string
		body    string
		wantErr error
		events  int
	}{
		{"ok", `{"step":1,"steps":2,"status":"running"}` + "\n" + `{"step":1,"steps":2,"status":"cached","digest":"sha256:aa"}` + "\n\n" +
			`{"step":2,"output":"hello\n"}` + "\n" + `{"template":{"digest":"sha256:bb","tags":["app:1"]}}` + "\n", nil, 4},
		{"failed step", `{"step":1,"status":"failed","exit_code":3}` + "\n" + `{"error":{"code":"unprocessable","message":"step 1/1 (line 2) RUN false: exit code 3"}}` + "\n", errdefs.ErrUnprocessable, 2},
		{"cut", `{"step":1,"status":"running"}` + "\n", errdefs.ErrUnavailable, 1},
		{"garbage", "not json\n", nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, req, _ := buildServer(t, tc.body)
			var evs []api.BuildEvent
			tpl, err := c.BuildTemplateTar(context.Background(), strings.NewReader("TAR"), BuildOptions{File: "sub/Dockerfile", Tags: []string{"app:1", "app:2"}, NoCache: true},
				func(ev api.BuildEvent) { evs = append(evs, ev) })
			if got := req.URL.RawQuery; got != "file=sub%2FDockerfile&no_cache=true&tag=app%3A1&tag=app%3A2" {
				t.Errorf("query %q", got)
			}
			if len(evs) != tc.events {
				t.Errorf("%d events, want %d: %+v", len(evs), tc.events, evs)
			}
			switch {
			case tc.name == "garbage":
				if err == nil || !strings.Contains(err.Error(), "bad event line") {
					t.Errorf("garbage: %v", err)
				}
			case tc.wantErr != nil:
				if !errors.Is(err, tc.wantErr) || tpl != nil {
					t.Errorf("err %v tpl %v, want %v", err, tpl, tc.wantErr)
				}
			default:
				if err != nil || tpl.Digest != "sha256:bb" || evs[2].Output != "hello\n" {
					t.Errorf("tpl %+v err %v events %+v", tpl, err, evs)
				}
			}
			if tc.name == "failed step" {
				var ae *APIError
				if !errors.As(err, &ae) || !strings.Contains(ae.Message, "exit code 3") || *evs[0].ExitCode != exit {
					t.Errorf("failure not reported: %v", err)
				}
			}
		})
	}
}

type entry struct {
	typ  byte
	mode int64
	link string
	body string
	uid  int
}

func readTar(t *testing.T, b []byte) map[string]entry {
	t.Helper()
	out := map[string]entry{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("context tar: %v", err)
		}
		body, _ := io.ReadAll(tr)
		out[h.Name] = entry{typ: h.Typeflag, mode: h.Mode, link: h.Linkname, body: string(body), uid: h.Uid}
	}
}

func names(m map[string]entry) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func writeFiles(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, body := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestBuildTemplateContext(t *testing.T) {
	dir := t.TempDir()
	writeFiles(t, dir, map[string]string{
		"Dockerfile":                "FROM base\n",
		"app/main.py":               "print(1)\n",
		"app/main.pyc":              "junk",
		"app/deep/x/y.pyc":          "junk",
		"secrets/key":               "SECRET",
		"logs/a.log":                "a",
		"logs/keep.log":             "keep",
		"node_modules/m/index.js":   "m",
		".space-build/Dockerfile":   "the context's own, must not clash",
		".dockerignore":             "# comment\n\n/secrets\n**/*.pyc\nlogs/*.log\n!logs/keep.log\nnode_modules\n",
		"docs/Dockerfile.ignoredir": "x",
	})
	os.Chmod(filepath.Join(dir, "app", "main.py"), 0o755)
	os.Symlink("../secrets/key", filepath.Join(dir, "app", "link"))
	outside := filepath.Join(t.TempDir(), "Build.file")
	os.WriteFile(outside, []byte("FROM base\nRUN true\n"), 0o600)

	c, req, tarb := buildServer(t, `{"template":{"digest":"sha256:cc"}}`+"\n")

	// The build file inside the context.
	if _, err := c.BuildTemplate(context.Background(), dir, BuildOptions{}, nil); err != nil {
		t.Fatal(err)
	}
	if q := req.URL.Query().Get("file"); q != "Dockerfile" {
		t.Errorf("file=%q", q)
	}
	got := readTar(t, *tarb)
	want := []string{".dockerignore", ".space-build/", ".space-build/Dockerfile", "Dockerfile", "app/", "app/deep/", "app/deep/x/", "app/link", "app/main.py",
		"docs/", "docs/Dockerfile.ignoredir", "logs/", "logs/keep.log"}
	if !reflect.DeepEqual(names(got), want) {
		t.Fatalf("context entries\n got %v\nwant %v", names(got), want)
	}
	if e := got["app/main.py"]; e.mode != 0o755 || e.body != "print(1)\n" || e.uid != 0 || e.typ != tar.TypeReg {
		t.Errorf("app/main.py: %+v", e)
	}
	if e := got["app/link"]; e.typ != tar.TypeSymlink || e.link != "../secrets/key" {
		t.Errorf("symlink not kept as a symlink: %+v", e)
	}

	// A build file outside the context travels as .space-build/<name>;
	// the context's own .space-build is left out.
	if _, err := c.BuildTemplate(context.Background(), dir, BuildOptions{File: outside, Tags: []string{"x:1"}}, nil); err != nil {
		t.Fatal(err)
	}
	if q := req.URL.Query().Get("file"); q != ".space-build/Build.file" {
		t.Errorf("file=%q", q)
	}
	got = readTar(t, *tarb)
	if e := got[".space-build/Build.file"]; e.body != "FROM base\nRUN true\n" || e.mode != 0o600 {
		t.Errorf("extra build file entry: %+v (entries %v)", e, names(got))
	}
	if _, ok := got[".space-build/Dockerfile"]; ok {
		t.Errorf("the context's own .space-build was sent along with the outside build file")
	}

	// An ignored build file inside the context is still sent.
	if _, err := c.BuildTemplate(context.Background(), dir, BuildOptions{File: "logs/a.log"}, nil); err != nil {
		t.Fatal(err)
	}
	if got = readTar(t, *tarb); got["logs/a.log"].body != "a" {
		t.Errorf("ignored build file not sent: %v", names(got))
	}

	// A missing build file fails before any request.
	n := *req
	if _, err := c.BuildTemplate(context.Background(), dir, BuildOptions{File: "nope"}, nil); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing build file: %v", err)
	}
	if req.URL != n.URL {
		t.Errorf("request sent for a missing build file")
	}
}

func TestDockerignore(t *testing.T) {
	d, err := parseDockerignore(strings.NewReader("a/**/b\n*.tmp\n!keep.tmp\n/x/[ab]?\nbuild/\n"))
	if err != nil {
		t.Fatal(err)
	}
	for rel, want := range map[string]bool{
		"a/b": true, "a/1/2/b": true, "a/1/b/c": true, "a/c": false,
		"f.tmp": true, "keep.tmp": false, "sub/f.tmp": false,
		"x/a1": true, "x/c1": false, "x/a1/z": true,
		"build": true, "build/out": true, "builder": false,
	} {
		if got := d.excluded(rel); got != want {
			t.Errorf("excluded(%q) = %v, want %v", rel, got, want)
		}
	}
	for _, bad := range []string{"../up\n", "ok\n[\n"} {
		if _, err := parseDockerignore(strings.NewReader(bad)); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: %v, want ErrInvalidArgument", bad, err)
		}
	}
}
