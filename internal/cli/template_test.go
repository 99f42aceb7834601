package cli

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// tplFake serves the template endpoints the CLI uses and records what it
// was sent.
type tplFake struct {
	mu       sync.Mutex
	reqs     []string          // "METHOD path?query"
	bodies   map[string][]byte // "METHOD path" -> last body
	failRm   map[string]bool   // refs whose DELETE answers 409
	buildOut string            // NDJSON answered to a build
}

func newTplFake(t *testing.T) (*tplFake, string) {
	f := &tplFake{bodies: map[string][]byte{}, failRm: map[string]bool{}}
	now := time.Now().Add(-2 * time.Hour)
	tpl := api.Template{Digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", TreeDigest: "sha256:00",
		Tags: []string{"app:1", "app:stable"}, SizeBytes: 5 << 20, Source: "build", CreatedAt: now}
	reply := func(w http.ResponseWriter, status int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(v)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+key {
			reply(w, 401, api.Error{Error: api.ErrorBody{Code: "unauthorized", Message: "no key"}})
			return
		}
		body, _ := io.ReadAll(r.Body)
		path := r.URL.EscapedPath()
		f.mu.Lock()
		f.reqs = append(f.reqs, r.Method+" "+path+"?"+r.URL.RawQuery)
		f.bodies[r.Method+" "+path] = body
		failRm := f.failRm[r.PathValue("ref")]
		f.mu.Unlock()
		switch {
		case r.Method == "GET" && path == "/v1/templates":
			untagged := tpl
			untagged.Digest, untagged.Tags, untagged.Source = "sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210", nil, "oci:x"
			reply(w, 200, api.TemplateList{Templates: []api.Template{tpl, untagged}})
		case r.Method == "POST" && path == "/v1/templates/gc":
			reply(w, 200, api.GCResult{Removed: []string{"sha256:a", "sha256:b"}, Trees: 1, BytesFreed: 3 << 20})
		case r.Method == "POST" && path == "/v1/templates/build":
			w.Header().Set("Content-Type", "application/x-ndjson")
			io.WriteString(w, f.buildOut)
		case r.Method == "DELETE":
			if strings.Contains(path, "busy") || failRm {
				reply(w, 409, api.Error{Error: api.ErrorBody{Code: "conflict", Message: "template is used by a sandbox"}})
				return
			}
			w.WriteHeader(204)
		case r.Method == "GET" && strings.HasSuffix(path, "/export"):
			w.Header().Set("Content-Type", "application/x-tar")
			io.WriteString(w, "ARCHIVE-BYTES")
		case r.Method == "GET":
			t := tpl
			t.UsedBy = []string{"sb-1"}
			reply(w, 200, t)
		default: // imports, pull, tag
			code := 201
			if strings.HasSuffix(path, "/tags") {
				code = 200
			}
			reply(w, code, tpl)
		}
	}))
	t.Cleanup(srv.Close)
	return f, srv.URL
}

func (f *tplFake) last() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reqs[len(f.reqs)-1]
}

func TestTemplateLsInspectTagRmGC(t *testing.T) {
	f, url := newTplFake(t)
	code, out, _ := runCLI(t, url, "", "template", "ls")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 4 || !strings.HasPrefix(lines[0], "REF") ||
		!strings.HasPrefix(lines[1], "app:1 ") || !strings.Contains(lines[1], "sha256:0123456789ab ") || !strings.Contains(lines[1], "5.0 MiB") ||
		!strings.HasPrefix(lines[2], "app:stable ") || !strings.HasPrefix(lines[3], "- ") || !strings.Contains(lines[3], "oci:x") || !strings.Contains(lines[1], "2h ago") {
		t.Fatalf("template ls:\n%s", out)
	}
	code, out, _ = runCLI(t, url, "", "template", "inspect", "app:1")
	var got api.Template
	if code != 0 || json.Unmarshal([]byte(out), &got) != nil || got.UsedBy[0] != "sb-1" {
		t.Fatalf("inspect: %d %s", code, out)
	}
	code, out, _ = runCLI(t, url, "", "template", "tag", "app:1", "app:prod")
	if code != 0 || out != "" || f.last() != "POST /v1/templates/app:1/tags?" || string(f.bodies["POST /v1/templates/app:1/tags"]) != `{"tag":"app:prod"}` {
		t.Fatalf("tag: %d %q %s %q", code, out, f.last(), f.bodies["POST /v1/templates/app:1/tags"])
	}
	if code, _, errOut := runCLI(t, url, "", "template", "tag", "app:1", "Bad Tag"); code != ExitUsage || !strings.Contains(errOut, "name[:tag]") {
		t.Fatalf("bad tag: %d %s", code, errOut)
	}
	// rm goes on after a failure and exits non-zero.
	code, out, errOut := runCLI(t, url, "", "template", "rm", "--force", "sha256:0123456789ab", "busy:1", "app:1")
	if code != ExitError || out != "sha256:0123456789ab\napp:1\n" || !strings.Contains(errOut, "busy:1: template is used by a sandbox") {
		t.Fatalf("rm: %d %q %q", code, out, errOut)
	}
	f.mu.Lock()
	first := f.reqs[len(f.reqs)-3]
	f.mu.Unlock()
	if first != "DELETE /v1/templates/sha256:0123456789ab?force=true" {
		t.Errorf("rm request %q", first)
	}
	code, out, _ = runCLI(t, url, "", "template", "gc")
	if code != 0 || out != "removed 2 templates, 1 tree, freed 3.0 MiB\n" {
		t.Fatalf("gc: %d %q", code, out)
	}
	code, out, _ = runCLI(t, url, "", "--json", "template", "gc")
	var gc api.GCResult
	if code != 0 || json.Unmarshal([]byte(out), &gc) != nil || gc.BytesFreed != 3<<20 {
		t.Fatalf("gc --json: %d %q", code, out)
	}
}

func TestTemplateExportImportPull(t *testing.T) {
	f, url := newTplFake(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "app.tar")
	if code, _, errOut := runCLI(t, url, "", "template", "export", "app:1", "-o", out); code != 0 {
		t.Fatalf("export: %d %s", code, errOut)
	}
	if b, _ := os.ReadFile(out); string(b) != "ARCHIVE-BYTES" {
		t.Fatalf("exported %q", b)
	}
	if code, stdout, _ := runCLI(t, url, "", "template", "export", "app:1"); code != 0 || stdout != "ARCHIVE-BYTES" {
		t.Fatalf("export to stdout: %d %q", code, stdout)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".app.tar.tmp-*")); len(left) != 0 {
		t.Errorf("temp files left: %v", left)
	}

	// An export archive is recognised without --format.
	var arch bytes.Buffer
	tw := tar.NewWriter(&arch)
	tw.WriteHeader(&tar.Header{Name: "space-template.json", Typeflag: tar.TypeReg, Mode: 0o644, Size: 2})
	tw.Write([]byte("{}"))
	tw.Close()
	os.WriteFile(out, arch.Bytes(), 0o644)
	if code, _, errOut := runCLI(t, url, "", "template", "import", "-t", "app:2", out); code != 0 || f.last() != "POST /v1/templates?format=archive&tag=app%3A2" {
		t.Fatalf("import archive: %d %s %s", code, errOut, f.last())
	}
	if !bytes.Equal(f.bodies["POST /v1/templates"], arch.Bytes()) {
		t.Errorf("archive body not sent as is")
	}
	// Any other file is a root filesystem tar unless told otherwise.
	os.WriteFile(out, []byte("not an archive"), 0o644)
	if code, _, _ := runCLI(t, url, "", "template", "import", out); code != 0 || f.last() != "POST /v1/templates?" {
		t.Fatalf("import tar: %d %s", code, f.last())
	}
	if code, _, _ := runCLI(t, url, "", "template", "import", "--format", "oci", "-t", "py", out); code != 0 || f.last() != "POST /v1/templates?format=oci&tag=py" {
		t.Fatalf("import oci: %d %s", code, f.last())
	}
	// A directory: a root filesystem by default, an OCI layout with --format oci.
	layout := t.TempDir()
	os.WriteFile(filepath.Join(layout, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
	if code, _, _ := runCLI(t, url, "", "template", "import", layout); code != 0 || f.last() != "POST /v1/templates?" {
		t.Fatalf("import dir: %d %s", code, f.last())
	}
	if code, _, _ := runCLI(t, url, "", "template", "import", "--format", "oci", layout); code != 0 || f.last() != "POST /v1/templates?format=oci" {
		t.Fatalf("import oci dir: %d %s", code, f.last())
	}
	tr := tar.NewReader(bytes.NewReader(f.bodies["POST /v1/templates"]))
	if h, err := tr.Next(); err != nil || h.Name != "oci-layout" {
		t.Fatalf("oci layout dir tar: %v %v", h, err)
	}
	for _, bad := range [][]string{
		{"template", "import", "--format", "zip", out},
		{"template", "import", "--format", "dir", out},
		{"template", "import", "--format", "archive", layout},
		{"template", "import", "-t", "Caps:1", out},
	} {
		if code, _, errOut := runCLI(t, url, "", bad...); code != ExitUsage {
			t.Errorf("%v: %d %s", bad, code, errOut)
		}
	}

	code, stdout, _ := runCLI(t, url, "", "--json", "template", "pull", "--insecure", "-t", "app:1", "127.0.0.1:5000/app:1")
	var tpl api.Template
	if code != 0 || json.Unmarshal([]byte(stdout), &tpl) != nil || f.last() != "POST /v1/templates/pull?" ||
		string(f.bodies["POST /v1/templates/pull"]) != `{"image":"127.0.0.1:5000/app:1","tags":["app:1"],"insecure":true}` {
		t.Fatalf("pull: %d %q %s %q", code, stdout, f.last(), f.bodies["POST /v1/templates/pull"])
	}
}

func TestTemplateBuildProgress(t *testing.T) {
	f, url := newTplFake(t)
	ctxDir := t.TempDir()
	os.WriteFile(filepath.Join(ctxDir, "hello.txt"), []byte("hi"), 0o644)
	outside := filepath.Join(t.TempDir(), "app.Dockerfile")
	os.WriteFile(outside, []byte("FROM base\n"), 0o644)
	exit := 2
	ev := func(e api.BuildEvent) string { b, _ := json.Marshal(e); return string(b) + "\n" }
	f.buildOut = ev(api.BuildEvent{Step: 1, Steps: 3, Line: 1, Instr: "FROM base", Status: "running"}) +
		ev(api.BuildEvent{Step: 1, Steps: 3, Line: 1, Instr: "FROM base", Status: "cached", Digest: "sha256:a"}) +
		ev(api.BuildEvent{Step: 2, Steps: 3, Line: 2, Instr: "RUN make", Status: "running"}) +
		ev(api.BuildEvent{Output: "cc -o x\nwarn"}) +
		ev(api.BuildEvent{Output: "ing \x1b[2Jdone\n"}) +
		ev(api.BuildEvent{Step: 2, Steps: 3, Line: 2, Instr: "RUN make", Status: "done", ElapsedMS: 1234}) +
		ev(api.BuildEvent{Step: 3, Steps: 3, Line: 3, Instr: "COPY hello.txt /", Status: "running"}) +
		ev(api.BuildEvent{Step: 3, Steps: 3, Line: 3, Instr: "COPY hello.txt /", Status: "done", ElapsedMS: 12}) +
		ev(api.BuildEvent{Template: &api.Template{Digest: "sha256:beef", Tags: []string{"app:1"}}})
	code, out, errOut := runCLI(t, url, "", "template", "build", "-f", outside, "-t", "app:1", "--no-cache", ctxDir)
	want := "Step 1/3 : FROM base  (cached)\n" +
		"Step 2/3 : RUN make\n" +
		"    cc -o x\n" +
		"    warning [2Jdone\n" +
		"Step 2/3 : RUN make  (done 1.2s)\n" +
		"Step 3/3 : COPY hello.txt /  (done 12ms)\n" +
		"built sha256:beef (app:1)\n"
	if code != 0 || out != want {
		t.Fatalf("build: %d stderr %q\n got:\n%s\nwant:\n%s", code, errOut, out, want)
	}
	if q := f.last(); q != "POST /v1/templates/build?file=.space-build%2Fapp.Dockerfile&no_cache=true&tag=app%3A1" {
		t.Errorf("build request %s", q)
	}
	tr := tar.NewReader(bytes.NewReader(f.bodies["POST /v1/templates/build"]))
	var names []string
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
	}
	if strings.Join(names, ",") != "hello.txt,.space-build/,.space-build/app.Dockerfile" {
		t.Errorf("context entries %v", names)
	}

	// A failing step: its line, then the error, and a non-zero exit.
	f.buildOut = ev(api.BuildEvent{Step: 1, Steps: 1, Line: 2, Instr: "RUN false", Status: "running"}) +
		ev(api.BuildEvent{Step: 1, Steps: 1, Line: 2, Instr: "RUN false", Status: "failed", ExitCode: &exit, ElapsedMS: 300}) +
		ev(api.BuildEvent{Error: &api.ErrorBody{Code: "unprocessable", Message: "step 1/1 (line 2) RUN false: exit code 2: boom"}})
	os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM base\nRUN false\n"), 0o644)
	code, out, errOut = runCLI(t, url, "", "template", "build", ctxDir)
	if code != ExitError || out != "Step 1/1 : RUN false  (failed, exit code 2 300ms)\n" || !strings.Contains(errOut, "exit code 2: boom") {
		t.Fatalf("failing build: %d %q %q", code, out, errOut)
	}
	if q := f.last(); q != "POST /v1/templates/build?file=Dockerfile" {
		t.Errorf("build request %s", q)
	}
	if code, _, errOut := runCLI(t, url, "", "template", "build", filepath.Join(ctxDir, "nope")); code != ExitUsage || !strings.Contains(errOut, "not a directory") {
		t.Errorf("missing context: %d %s", code, errOut)
	}
}
