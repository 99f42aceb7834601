package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/sdk"
)

// TestCustomTemplateFromDirectory imports a directory as a template through
// the CLI, creates a sandbox from its tag, and runs the program it carries:
// the sandbox reports the digest it was created from.
func TestCustomTemplateFromDirectory(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	root := t.TempDir()
	for _, d := range []string{"bin", "etc", "tmp", "root"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/hello\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc", "group"), []byte("root:x:0:\n"), 0o644)
	// A static program is the whole userland of this template.
	src := filepath.Join(t.TempDir(), "main.go")
	os.WriteFile(src, []byte("package main\nimport (\"fmt\"; \"os\")\nfunc main() { h, _ := os.Hostname(); fmt.Println(\"hello from a custom template\", len(os.Args), h != \"\") }\n"), 0o644)
	build := exec.Command("go", "build", "-o", filepath.Join(root, "bin", "hello"), src)
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the template's program: %v %s", err, out)
	}

	out, errOut, code := e.spaceCLI(t, "", "template", "import", "--tag", "hello:v1", "--json", root)
	if code != 0 {
		t.Fatalf("template import: %d %s", code, errOut)
	}
	var tmpl api.Template
	if err := json.Unmarshal([]byte(out), &tmpl); err != nil {
		t.Fatalf("import output %q: %v", out, err)
	}
	sb := newSandbox(t, e, api.CreateSandboxRequest{Template: "hello:v1"})
	if sb.TemplateDigest != tmpl.Digest || sb.Template != "hello:v1" {
		t.Fatalf("sandbox template %s %s, imported %s", sb.Template, sb.TemplateDigest, tmpl.Digest)
	}
	res, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"/bin/hello", "x"}})
	if err != nil || res.ExitCode != 0 || res.Stdout != "hello from a custom template 2 true\n" {
		t.Fatalf("exec in custom template: %v %+v", err, res)
	}
	// The same tree imported again dedups to the same digest.
	out, _, code = e.spaceCLI(t, "", "template", "import", "--tag", "hello:v2", "--json", root)
	var again api.Template
	if code != 0 || json.Unmarshal([]byte(out), &again) != nil || again.Digest != tmpl.Digest {
		t.Fatalf("re-import: %d %q", code, out)
	}
}

// TestTemplateBuildLifecycle builds a template from a Dockerfile through
// the SDK, runs a sandbox of it, rebuilds it from the cache, checks that a
// template a sandbox uses cannot be removed or collected, and moves it
// through export, rm, gc and import with its digest intact.
func TestTemplateBuildLifecycle(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	c := e.client
	e.ensureBase(t, ctx)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(
		"FROM base:latest\n"+
			"RUN echo built-by-run > /built.txt\n"+
			"COPY hello.txt /app/hello.txt\n"+
			"ENV GREETING=\"hello from env\"\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "hello.txt"), []byte("hello from the context\n"), 0o644)
	const tag = "e2e-built:v1"
	t.Cleanup(func() {
		c.RemoveTemplate(context.Background(), tag, false)
		c.RemoveTemplate(context.Background(), "e2e-built:v2", false)
	})

	build := func(noCache bool) (*api.Template, []api.BuildEvent) {
		t.Helper()
		var evs []api.BuildEvent
		start := time.Now()
		tpl, err := c.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{tag}, NoCache: noCache}, func(ev api.BuildEvent) { evs = append(evs, ev) })
		if err != nil {
			t.Fatalf("build: %v (events %+v)", err, evs)
		}
		t.Logf("build (no_cache=%v) took %v", noCache, time.Since(start))
		return tpl, evs
	}
	statuses := func(evs []api.BuildEvent) string {
		var s []string
		for _, ev := range evs {
			if ev.Status != "" && ev.Status != "running" {
				s = append(s, ev.Status)
			}
		}
		return strings.Join(s, ",")
	}
	// --no-cache the first time, so that the test really runs every step
	// even on a server that built this file before.
	tpl, evs := build(true)
	if got := statuses(evs); got != "done,done,done,done" {
		t.Fatalf("first build statuses %s, events %+v", got, evs)
	}
	if tpl.Config.Env["GREETING"] != "hello from env" || len(tpl.Tags) != 1 || tpl.Tags[0] != tag || tpl.Parent == "" || len(tpl.Layers) < 3 {
		t.Fatalf("built template: %+v", tpl)
	}

	// A rebuild takes every step from the cache and ends where it did.
	again, evs := build(false)
	if got := statuses(evs); again.Digest != tpl.Digest || got != "done,cached,cached,cached" {
		t.Fatalf("rebuild: digest %s (first %s), statuses %s", again.Digest, tpl.Digest, got)
	}

	step := time.Now()
	sb := newSandbox(t, e, api.CreateSandboxRequest{Template: tag})
	t.Logf("create took %v", time.Since(step))
	if sb.TemplateDigest != tpl.Digest {
		t.Fatalf("sandbox template digest %s, built %s", sb.TemplateDigest, tpl.Digest)
	}
	res, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", `cat /built.txt /app/hello.txt; echo "$GREETING"; ls /app`}})
	if err != nil || res.ExitCode != 0 || res.Stdout != "built-by-run\nhello from the context\nhello from env\nhello.txt\n" {
		t.Fatalf("sandbox of the built template: %v %+v", err, res)
	}
	insp, err := c.GetTemplate(ctx, tpl.Digest)
	if err != nil || len(insp.UsedBy) != 1 || insp.UsedBy[0] != sb.ID {
		t.Fatalf("inspect used_by: %v %+v", err, insp)
	}

	// The archive holds the whole tree (the base's ~250 MiB too): a file,
	// not memory.
	archive, err := os.Create(filepath.Join(t.TempDir(), "e2e-built.tar"))
	if err != nil {
		t.Fatal(err)
	}
	defer archive.Close()
	step = time.Now()
	if err := c.ExportTemplate(ctx, tag, archive); err != nil {
		t.Fatalf("export: %v", err)
	}
	t.Logf("export took %v", time.Since(step))

	// While the sandbox exists, neither rm of the digest nor gc touch it.
	if err := c.RemoveTemplate(ctx, tpl.Digest, true); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "used by a sandbox") {
		t.Fatalf("rm --force of a template in use: %v", err)
	}
	if err := c.RemoveTemplate(ctx, tag, false); err != nil {
		t.Fatalf("untag: %v", err)
	}
	step = time.Now()
	gc, err := c.GCTemplates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gc took %v", time.Since(step))
	for _, d := range gc.Removed {
		if d == tpl.Digest {
			t.Fatalf("gc removed a template a sandbox uses: %+v", gc)
		}
	}
	if _, err := c.GetTemplate(ctx, tpl.Digest); err != nil {
		t.Fatalf("template gone after gc while in use: %v", err)
	}
	res, err = c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/built.txt"}})
	if err != nil || res.Stdout != "built-by-run\n" {
		t.Fatalf("sandbox after gc: %v %+v", err, res)
	}

	// Without the sandbox: rm forgets it, gc frees its steps and trees.
	op, err := c.DeleteSandbox(ctx, sb.ID, true)
	if err == nil {
		_, err = c.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatalf("delete sandbox: %v", err)
	}
	if err := c.RemoveTemplate(ctx, tpl.Digest, false); err != nil {
		t.Fatalf("rm of an unused, untagged template: %v", err)
	}
	gc, err = c.GCTemplates(ctx)
	if err != nil || gc.Trees == 0 || gc.BytesFreed <= 0 || len(gc.Removed) < 2 {
		t.Fatalf("gc after rm: %v %+v", err, gc)
	}
	if _, err := c.GetTemplate(ctx, tpl.Digest); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("template after rm+gc: %v", err)
	}

	// The archive brings it back with the same digest, and it works.
	if _, err := archive.Seek(0, 0); err != nil {
		t.Fatal(err)
	}
	step = time.Now()
	imported, err := c.ImportTemplateArchive(ctx, archive, "e2e-built:v2")
	t.Logf("import took %v", time.Since(step))
	if err != nil || imported.Digest != tpl.Digest || imported.Config.Env["GREETING"] != "hello from env" {
		t.Fatalf("import archive: %v %+v (built %s)", err, imported, tpl.Digest)
	}
	step = time.Now()
	sb2 := newSandbox(t, e, api.CreateSandboxRequest{Template: "e2e-built:v2"})
	t.Logf("create from the import took %v", time.Since(step))
	res, err = c.Exec(ctx, sb2.ID, api.ExecRequest{Cmd: []string{"sh", "-c", `cat /built.txt; echo "$GREETING"`}})
	if err != nil || res.Stdout != "built-by-run\nhello from env\n" {
		t.Fatalf("sandbox of the imported template: %v %+v", err, res)
	}
}

// TestTemplateBuildCLI builds through the CLI: a failing RUN step shows its
// output indented under its step line, then the error, and the exit code is
// non-zero; a build file from outside the context works.
func TestTemplateBuildCLI(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	e.ensureBase(t, ctx)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM base:latest\nRUN echo out-line; echo err-line >&2; exit 3\n"), 0o644)
	out, errOut, code := e.spaceCLI(t, "", "template", "build", "--no-cache", "-t", "e2e-fail:1", dir)
	if code != 1 || !strings.Contains(out, "Step 1/2 : FROM base:latest  (done") || !strings.Contains(out, "Step 2/2 : RUN echo out-line; echo err-line >&2; exit 3\n") ||
		!strings.Contains(out, "    out-line\n") || !strings.Contains(out, "    err-line\n") || !strings.Contains(out, "(failed, exit code 3") ||
		!strings.Contains(errOut, "exit code 3") || !strings.Contains(errOut, "err-line") {
		t.Fatalf("failing build: code %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if _, err := e.client.GetTemplate(ctx, "e2e-fail:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a failed build tagged something: %v", err)
	}

	outside := filepath.Join(t.TempDir(), "ok.Dockerfile")
	os.WriteFile(outside, []byte("FROM base:latest\nENV FROM_CLI=1\n"), 0o644)
	t.Cleanup(func() { e.client.RemoveTemplate(context.Background(), "e2e-cli:1", false) })
	out, errOut, code = e.spaceCLI(t, "", "template", "build", "-f", outside, "-t", "e2e-cli:1", dir)
	if code != 0 || !strings.Contains(out, "Step 2/2 : ENV FROM_CLI=1  (") || !strings.Contains(out, "built sha256:") {
		t.Fatalf("build -f outside: code %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	tpl, err := e.client.GetTemplate(ctx, "e2e-cli:1")
	if err != nil || tpl.Config.Env["FROM_CLI"] != "1" {
		t.Fatalf("built template: %v %+v", err, tpl)
	}
}
