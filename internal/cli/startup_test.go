package cli

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// serverOnly are packages the space client must neither link nor
// initialise: the server's own packages and the third-party ones only they
// use (metrics, SQLite, CEL and protobuf, gVisor's netstack, registries,
// the MCP protocol and its JSON schemas).
var serverOnly = []string{
	"github.com/spacehq/space/internal/server", "github.com/spacehq/space/internal/sandbox",
	"github.com/spacehq/space/internal/runtime", "github.com/spacehq/space/internal/template",
	"github.com/spacehq/space/internal/templatesvc", "github.com/spacehq/space/internal/store",
	"github.com/spacehq/space/internal/policy", "github.com/spacehq/space/internal/gateway",
	"github.com/spacehq/space/internal/mcpserver", "github.com/spacehq/space/internal/tenancy",
	"github.com/spacehq/space/internal/secrets", "github.com/spacehq/space/internal/build",
	"github.com/spacehq/space/internal/agent", "github.com/spacehq/space/internal/e2b",
	"github.com/spacehq/space/internal/cli/hostcli",
	"github.com/prometheus/", "modernc.org/", "cel.dev/", "google.golang.org/protobuf", "gvisor.dev/",
	"github.com/google/go-containerregistry", "github.com/modelcontextprotocol/", "github.com/google/jsonschema-go",
	"html/template", "encoding/gob",
}

// clientAllowed are the only packages of this module the client links.
var clientAllowed = map[string]bool{
	"github.com/spacehq/space/cmd/space": true, "github.com/spacehq/space/internal/cli": true,
	"github.com/spacehq/space/sdk": true, "github.com/spacehq/space/api": true,
	"github.com/spacehq/space/internal/errdefs": true, "github.com/spacehq/space/internal/audit/chain": true,
}

var (
	builtOnce sync.Once
	builtDir  string
	builtErr  error
)

// builtBinaries builds space and space-server into one directory, as make
// build installs them.
func builtBinaries(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go toolchain")
	}
	builtOnce.Do(func() {
		builtDir, builtErr = os.MkdirTemp("", "space-cli-bin-")
		if builtErr != nil {
			return
		}
		for _, b := range []string{"space", "space-server"} {
			out, err := exec.Command("go", "build", "-o", filepath.Join(builtDir, b), "github.com/spacehq/space/cmd/"+b).CombinedOutput()
			if err != nil {
				builtErr = &buildFailed{b, err, string(out)}
				return
			}
		}
	})
	if builtErr != nil {
		t.Fatal(builtErr)
	}
	return builtDir
}

type buildFailed struct {
	bin string
	err error
	out string
}

func (b *buildFailed) Error() string {
	return "building " + b.bin + ": " + b.err.Error() + "\n" + b.out
}

func TestMain(m *testing.M) {
	code := m.Run()
	if builtDir != "" {
		os.RemoveAll(builtDir)
	}
	os.Exit(code)
}

// TestClientLinksNoServerPackage checks the client's whole import graph:
// only the CLI, the SDK, api and the leaf packages they need, and none of
// the server's packages, so a later import that drags the server in fails
// here rather than slowing every command down.
func TestClientLinksNoServerPackage(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go toolchain")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/spacehq/space/cmd/space").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 50 {
		t.Fatalf("go list -deps gave only %d packages", len(deps))
	}
	for _, p := range deps {
		if strings.HasPrefix(p, "github.com/spacehq/space/") && !clientAllowed[p] {
			t.Errorf("the space client links %s (only %v may be linked)", p, clientAllowed)
		}
		for _, s := range serverOnly {
			if strings.HasPrefix(p, s) {
				t.Errorf("the space client links server-only package %s", p)
			}
		}
	}
}

// TestClientInitTrace runs the built client with GODEBUG=inittrace=1 the
// way a user does and reads which packages initialise before main: none
// of them may be server-side. The server binary, run the same way, must
// show them (so the trace is really read).
func TestClientInitTrace(t *testing.T) {
	dir := builtBinaries(t)
	trace := func(bin string, args ...string) []string {
		cmd := exec.Command(filepath.Join(dir, bin), args...)
		cmd.Env = append(os.Environ(), "GODEBUG=inittrace=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s %v: %v\n%s", bin, args, err, stderr.String())
		}
		var pkgs []string
		for _, l := range strings.Split(stderr.String(), "\n") {
			if f := strings.Fields(l); len(f) > 2 && f[0] == "init" {
				pkgs = append(pkgs, f[1])
			}
		}
		return pkgs
	}
	serverSide := func(pkgs []string) []string {
		var bad []string
		for _, p := range pkgs {
			for _, s := range serverOnly {
				if strings.HasPrefix(p, s) {
					bad = append(bad, p)
				}
			}
		}
		return bad
	}
	for _, args := range [][]string{{"--help"}, {"exec", "--help"}, {"run", "--help"}} {
		pkgs := trace("space", args...)
		if len(pkgs) < 10 {
			t.Fatalf("space %v: only %d init lines: is GODEBUG=inittrace=1 still read?", args, len(pkgs))
		}
		if bad := serverSide(pkgs); len(bad) > 0 {
			t.Errorf("space %v initialises server-side packages: %v", args, bad)
		}
	}
	if bad := serverSide(trace("space-server", "--help")); len(bad) == 0 {
		t.Error("space-server --help initialises no server-side package: the check above would pass vacuously")
	}
}

// TestHostCommandsHandedToServerBinary: the client runs `space server` and
// the other host-side commands by becoming space-server (same command
// line), and says what is missing when space-server is not beside it.
func TestHostCommandsHandedToServerBinary(t *testing.T) {
	dir := builtBinaries(t)
	run := func(bin string, env []string, args ...string) (string, string, int) {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), env...)
		var o, e bytes.Buffer
		cmd.Stdout, cmd.Stderr = &o, &e
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return o.String(), e.String(), code
	}
	space := filepath.Join(dir, "space")
	// --help of the server command is space-server's: its own flags.
	if out, errOut, code := run(space, nil, "server", "--help"); code != 0 || !strings.Contains(out, "--egress-allow-private") || !strings.Contains(out, "--listen") {
		t.Fatalf("space server --help: %d\n%s\n%s", code, out, errOut)
	}
	// Flags are the server's to judge, exit status included.
	if _, errOut, code := run(space, nil, "server", "--listen", ""); code != ExitUsage || !strings.Contains(errOut, "--listen must not be empty") {
		t.Fatalf("space server --listen '': %d %q", code, errOut)
	}
	// Offline policy evaluation: the client has no policy engine, the
	// answer comes from space-server.
	pdir := t.TempDir()
	os.WriteFile(filepath.Join(pdir, "rules.yaml"), []byte("rules:\n- name: no-curl\n  match: action.kind == \"exec\" && action.argv[0] == \"curl\"\n  verdict: deny\n"), 0o600)
	os.WriteFile(filepath.Join(pdir, "h.jsonl"), []byte(`{"kind":"exec","argv":["curl","x"]}`+"\n"+`{"kind":"exec","argv":["ls"]}`+"\n"), 0o600)
	out, errOut, code := run(space, nil, "--json", "policy", "test", filepath.Join(pdir, "rules.yaml"), "--history", filepath.Join(pdir, "h.jsonl"))
	if code != 0 || !strings.Contains(out, `"verdict": "deny"`) || !strings.Contains(out, `"rule": "no-curl"`) {
		t.Fatalf("space policy test: %d\n%s\n%s", code, out, errOut)
	}
	// Without space-server beside it (a copy elsewhere), the client names
	// what it needs and fails the command, nothing else.
	lone := filepath.Join(t.TempDir(), "space")
	b, _ := os.ReadFile(space)
	os.WriteFile(lone, b, 0o755)
	if _, errOut, code := run(lone, nil, "server", "--help"); code != ExitError || !strings.Contains(errOut, ServerBinaryName) {
		t.Fatalf("lone space server: %d %q", code, errOut)
	}
	if out, _, code := run(lone, nil, "--help"); code != 0 || !strings.Contains(out, "server") {
		t.Fatalf("lone space --help: %d %q", code, out)
	}
	// $SPACE_SERVER_BIN points it elsewhere.
	if out, _, code := run(lone, []string{"SPACE_SERVER_BIN=" + filepath.Join(dir, ServerBinaryName)}, "server", "--help"); code != 0 || !strings.Contains(out, "--egress-allow-private") {
		t.Fatalf("SPACE_SERVER_BIN: %d %q", code, out)
	}
	// In-process (Execute as a library) never replaces the caller.
	var o, e bytes.Buffer
	if code := Execute(t.Context(), []string{"server", "--help"}, strings.NewReader(""), &o, &e); code != ExitError || !strings.Contains(e.String(), ServerBinaryName) {
		t.Fatalf("in-process server: %d %q", code, e.String())
	}
}

// TestTopLevelTable keeps the lazily built command table in step with the
// commands: every name and alias of every top-level command builds that
// command, and the table names nothing else.
func TestTopLevelTable(t *testing.T) {
	a := &app{ctx: t.Context(), out: &bytes.Buffer{}, errOut: &bytes.Buffer{}}
	extra := map[string]bool{}
	for _, add := range extraCommands {
		extra[add(a).Name()] = true
	}
	seen := map[string]bool{}
	for _, c := range newRootCmd(a).Commands() {
		if extra[c.Name()] {
			continue
		}
		for _, n := range append([]string{c.Name()}, c.Aliases...) {
			seen[n] = true
			b := topLevel[n]
			if b == nil {
				t.Errorf("command %q (name %q) is missing from topLevel", c.Name(), n)
				continue
			}
			if got := b(a).Name(); got != c.Name() {
				t.Errorf("topLevel[%q] builds %q, want %q", n, got, c.Name())
			}
		}
	}
	for n := range topLevel {
		if !seen[n] {
			t.Errorf("topLevel names %q, which no command answers to", n)
		}
	}
	if len(seen) < 30 {
		t.Fatalf("only %d command names", len(seen))
	}
}

func TestCommandName(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"exec", "sb-1", "--", "true"}, "exec"},
		{[]string{"--url", "http://x", "--api-key", "k", "--json", "ls"}, "ls"},
		{[]string{"--url=http://x", "run", "--", "true"}, "run"},
		{[]string{"--help"}, ""},
		{[]string{"--", "exec"}, ""},
		{nil, ""},
	} {
		if got := commandName(c.args); got != c.want {
			t.Errorf("commandName(%q) = %q, want %q", c.args, got, c.want)
		}
	}
}
