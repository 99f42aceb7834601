package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/api"
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
