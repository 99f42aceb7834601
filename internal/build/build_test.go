package build

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// env is a real template store on a temp SQLite database, holding a small
// "base:latest" template, and a build context directory.
type env struct {
	store   *template.Store
	base    api.Template
	context string
	runner  *fakeRunner
	events  []api.BuildEvent
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testenv.RequireRoot(t) // ownership is part of every digest
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })

	root := filepath.Join(dir, "base")
	mkdirs(t, root, "usr/bin", "etc", "opt/keep", "var/cache/old", "tmp")
	writeFile(t, filepath.Join(root, "etc/hostname"), "base\n", 0o644)
	writeFile(t, filepath.Join(root, "opt/keep/a"), "a\n", 0o644)
	writeFile(t, filepath.Join(root, "opt/gone"), "x\n", 0o644)
	writeFile(t, filepath.Join(root, "var/cache/old/f"), "old\n", 0o644)
	must(t, os.Symlink("usr/bin", filepath.Join(root, "bin")))
	must(t, os.Chmod(filepath.Join(root, "tmp"), 0o1777|os.ModeSticky))
	must(t, unix.Chmod(filepath.Join(root, "tmp"), 0o1777))
	base, err := s.ImportDir(context.Background(), root, template.ImportOptions{
		Tags:   []string{"base"},
		Config: api.TemplateConfig{Env: map[string]string{"PATH": "/usr/bin:/bin", "BASEVAR": "from-base"}},
	})
	if err != nil {
		t.Fatal(err)
	}

	ctxDir := filepath.Join(dir, "context")
	mkdirs(t, ctxDir, "app/lib", "empty")
	writeFile(t, filepath.Join(ctxDir, "app/main.py"), "print('hi')\n", 0o644)
	writeFile(t, filepath.Join(ctxDir, "app/lib/util.py"), "X = 1\n", 0o600)
	writeFile(t, filepath.Join(ctxDir, "README"), "read me\n", 0o644)
	writeFile(t, filepath.Join(ctxDir, "a.txt"), "A\n", 0o644)
	writeFile(t, filepath.Join(ctxDir, "b.txt"), "B\n", 0o644)
	writeFile(t, filepath.Join(dir, "outside"), "secret\n", 0o644)
	must(t, os.Symlink("app/main.py", filepath.Join(ctxDir, "link-inside")))
	must(t, os.Symlink("../outside", filepath.Join(ctxDir, "link-up")))
	must(t, os.Symlink(filepath.Join(ctxDir, "README"), filepath.Join(ctxDir, "link-absolute")))
	must(t, os.Symlink("/", filepath.Join(ctxDir, "link-root")))
	return &env{store: s, base: base, context: ctxDir, runner: &fakeRunner{t: t, scripts: map[string]script{}}}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func mkdirs(t *testing.T, root string, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		must(t, os.MkdirAll(filepath.Join(root, d), 0o755))
	}
}

func writeFile(t *testing.T, p, body string, mode os.FileMode) {
	t.Helper()
	must(t, os.WriteFile(p, []byte(body), mode))
	must(t, os.Chmod(p, mode))
}

// script fakes a RUN command: it writes the command's changes as an
// overlayfs upper directory would hold them, prints, and exits.
type script func(t *testing.T, upper string, out io.Writer) int

// fakeRunner runs RUN steps by script instead of in a sandbox, handing the
// upper directory to Step.Apply exactly as the sandbox runner does.
type fakeRunner struct {
	t       *testing.T
	mu      sync.Mutex
	scripts map[string]script
	calls   []Step
}

func (r *fakeRunner) RunStep(ctx context.Context, s Step) (int, error) {
	r.mu.Lock()
	r.calls = append(r.calls, s)
	r.mu.Unlock()
	cmd := strings.Join(s.Cmd, " ")
	if len(s.Cmd) == 3 && s.Cmd[0] == "/bin/sh" && s.Cmd[1] == "-c" {
		cmd = s.Cmd[2]
	}
	sc, ok := r.scripts[cmd]
	if !ok {
		return 0, fmt.Errorf("fake runner: no script for %q", cmd)
	}
	upper := r.t.TempDir()
	code := sc(r.t, upper, s.Output)
	if code != 0 {
		return code, nil
	}
	return 0, s.Apply(ctx, template.Upper{Dir: upper, OpaqueXattr: "user.overlay.opaque"})
}

func (r *fakeRunner) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// makeScript is "RUN make": it adds a file, deletes /opt/gone with a
// whiteout and replaces /var/cache's contents through an opaque directory.
func makeScript(t *testing.T, upper string, out io.Writer) int {
	mkdirs(t, upper, "app/build", "opt", "var/cache")
	writeFile(t, filepath.Join(upper, "app/build/out.bin"), "compiled\n", 0o755)
	must(t, unix.Mknod(filepath.Join(upper, "opt/gone"), unix.S_IFCHR, 0))
	must(t, unix.Setxattr(filepath.Join(upper, "var/cache"), "user.overlay.opaque", []byte("y"), 0))
	writeFile(t, filepath.Join(upper, "var/cache/new"), "new\n", 0o644)
	fmt.Fprintln(out, "building…")
	return 0
}

func (e *env) build(t *testing.T, file string, mod ...func(*Options)) (api.Template, error) {
	t.Helper()
	f, err := Parse(strings.NewReader(file))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	e.events = nil
	o := Options{
		File: f, ContextDir: e.context, Templates: e.store, Runner: e.runner,
		Events: func(ev api.BuildEvent) { e.events = append(e.events, ev) },
	}
	for _, m := range mod {
		m(&o)
	}
	return Build(context.Background(), o)
}

// statuses returns the final status of every step, in order.
func (e *env) statuses() []string {
	var out []string
	for _, ev := range e.events {
		if ev.Status != "" && ev.Status != "running" {
			out = append(out, ev.Status)
		}
	}
	return out
}

func (e *env) rootfs(t *testing.T, ref string) string {
	t.Helper()
	_, dir, err := e.store.Resolve(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func (e *env) templates(t *testing.T) int {
	t.Helper()
	list, err := e.store.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return len(list)
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func lstat(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

func missing(t *testing.T, p string) {
	t.Helper()
	if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s exists (%v), want it gone", p, err)
	}
}

const appFile = `# syntax=docker/dockerfile:1
FROM base
ENV APP=/app GREETING="hello world"
WORKDIR $APP
COPY app/ ./
COPY README /tmp/
COPY --chown=1000:1001 link-inside main-copy.py
RUN make
USER 1000
START ["python3", "main.py"]
READY --timeout=5s curl -fs localhost:8000
`

func TestBuildTreeConfigAndCache(t *testing.T) {
	e := newEnv(t)
	e.runner.scripts["make"] = makeScript
	got, err := e.build(t, appFile, func(o *Options) { o.Tags = []string{"app:v1"} })
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"done", "done", "done", "done", "done", "done", "done", "done", "done", "done"}; !reflect.DeepEqual(e.statuses(), want) {
		t.Errorf("statuses %v, want %v", e.statuses(), want)
	}
	first := e.events[0]
	if first.Step != 1 || first.Steps != 10 || first.Line != 2 || first.Status != "running" || first.Instr != "FROM base" {
		t.Errorf("first event %+v", first)
	}

	// The tree.
	root := e.rootfs(t, got.Digest)
	if s := readFile(t, filepath.Join(root, "app/main.py")); s != "print('hi')\n" {
		t.Errorf("main.py = %q", s)
	}
	if st := lstat(t, filepath.Join(root, "app/lib/util.py")); st.Mode&0o7777 != 0o600 || st.Uid != 0 {
		t.Errorf("util.py mode %o uid %d, want 0600 root", st.Mode&0o7777, st.Uid)
	}
	if st := lstat(t, filepath.Join(root, "app")); st.Mode&0o7777 != 0o755 || st.Uid != 0 {
		t.Errorf("/app (WORKDIR) mode %o uid %d, want 0755 root", st.Mode&0o7777, st.Uid)
	}
	if s := readFile(t, filepath.Join(root, "tmp/README")); s != "read me\n" {
		t.Errorf("/tmp/README = %q", s)
	}
	if st := lstat(t, filepath.Join(root, "tmp")); st.Mode&0o7777 != 0o1777 {
		t.Errorf("/tmp mode %o after COPY into it, want 1777 kept", st.Mode&0o7777)
	}
	cp := lstat(t, filepath.Join(root, "app/main-copy.py"))
	if cp.Mode&unix.S_IFMT != unix.S_IFREG || cp.Uid != 1000 || cp.Gid != 1001 {
		t.Errorf("main-copy.py: mode %o owner %d:%d, want a regular file (symlink source followed) owned 1000:1001", cp.Mode, cp.Uid, cp.Gid)
	}
	if s := readFile(t, filepath.Join(root, "app/build/out.bin")); s != "compiled\n" {
		t.Errorf("RUN output file = %q", s)
	}
	missing(t, filepath.Join(root, "opt/gone"))
	missing(t, filepath.Join(root, "var/cache/old"))
	readFile(t, filepath.Join(root, "opt/keep/a"))
	readFile(t, filepath.Join(root, "var/cache/new"))

	// The defaults.
	wantCfg := api.TemplateConfig{
		Env:     map[string]string{"PATH": "/usr/bin:/bin", "BASEVAR": "from-base", "APP": "/app", "GREETING": "hello world"},
		Workdir: "/app",
		User:    "1000",
		Start: &api.StartCommand{
			Cmd:                 []string{"python3", "main.py"},
			Ready:               []string{"/bin/sh", "-c", "curl -fs localhost:8000"},
			ReadyTimeoutSeconds: 5,
		},
	}
	if !reflect.DeepEqual(got.Config, wantCfg) {
		t.Errorf("config %+v %+v, want %+v %+v", got.Config, got.Config.Start, wantCfg, wantCfg.Start)
	}
	if !reflect.DeepEqual(got.Tags, []string{"app:v1"}) {
		t.Errorf("tags %v, want [app:v1]", got.Tags)
	}
	if got.Parent == "" || got.Parent == e.base.Digest {
		t.Errorf("parent %q, want the previous step's template", got.Parent)
	}
	if n := len(got.Layers); n != len(e.base.Layers)+9 {
		t.Fatalf("%d layers, want %d", n, len(e.base.Layers)+9)
	}
	steps := got.Layers[len(e.base.Layers):]
	if steps[5].CreatedBy != "RUN make" || steps[8].CreatedBy != "READY --timeout=5s curl -fs localhost:8000" || steps[8].Digest != got.Digest {
		t.Errorf("layers %+v", steps)
	}

	// The RUN step ran in the template before it, with the defaults so far.
	if e.runner.count() != 1 {
		t.Fatalf("runner called %d times", e.runner.count())
	}
	run := e.runner.calls[0]
	if run.Workdir != "/app" || run.User != "" || run.Network || run.Env["APP"] != "/app" || run.Env["BASEVAR"] != "from-base" {
		t.Errorf("RUN step %+v", run)
	}
	if run.Template != steps[4].Digest {
		t.Errorf("RUN ran in %s, want the COPY step's %s", run.Template, steps[4].Digest)
	}
	var output string
	for _, ev := range e.events {
		output += ev.Output
	}
	if output != "building…\n" {
		t.Errorf("output %q", output)
	}

	// An identical build is entirely cached and runs nothing.
	again, err := e.build(t, appFile)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"done", "cached", "cached", "cached", "cached", "cached", "cached", "cached", "cached", "cached"}; !reflect.DeepEqual(e.statuses(), want) {
		t.Errorf("rebuild statuses %v, want %v", e.statuses(), want)
	}
	if again.Digest != got.Digest || e.runner.count() != 1 {
		t.Errorf("rebuild: digest %s (want %s), runner called %d times (want 1)", again.Digest, got.Digest, e.runner.count())
	}
	for _, l := range again.Layers[len(e.base.Layers):] {
		if !l.Cached {
			t.Errorf("rebuild layer %q not marked cached", l.CreatedBy)
		}
	}

	// New mtimes change nothing.
	future := unix.NsecToTimespec(4102444800e9)
	must(t, unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(e.context, "README"), []unix.Timespec{future, future}, 0))
	if _, err := e.build(t, appFile); err != nil {
		t.Fatal(err)
	}
	if e.runner.count() != 1 || e.statuses()[4] != "cached" {
		t.Errorf("touching a source invalidated the cache: %v", e.statuses())
	}

	// Changing one copied file rebuilds its step and the later ones only.
	writeFile(t, filepath.Join(e.context, "README"), "read me, changed\n", 0o644)
	changed, err := e.build(t, appFile)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"done", "cached", "cached", "cached", "done", "done", "done", "done", "done", "done"}; !reflect.DeepEqual(e.statuses(), want) {
		t.Errorf("after a change: statuses %v, want %v", e.statuses(), want)
	}
	if changed.Digest == got.Digest || e.runner.count() != 2 {
		t.Errorf("after a change: digest unchanged or runner called %d times (want 2)", e.runner.count())
	}
	if s := readFile(t, filepath.Join(e.rootfs(t, changed.Digest), "tmp/README")); s != "read me, changed\n" {
		t.Errorf("changed README = %q", s)
	}

	// A changed mode is a change too.
	must(t, os.Chmod(filepath.Join(e.context, "app/lib/util.py"), 0o640))
	if _, err := e.build(t, appFile); err != nil {
		t.Fatal(err)
	}
	if st := e.statuses(); st[3] != "done" || st[2] != "cached" {
		t.Errorf("after chmod: statuses %v, want step 4 rebuilt", st)
	}

	// NoCache builds everything again, to the same digest.
	nocache, err := e.build(t, appFile, func(o *Options) { o.NoCache = true })
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range e.statuses() {
		if s != "done" {
			t.Errorf("NoCache: statuses %v", e.statuses())
			break
		}
	}
	if nocache.TreeDigest == "" || e.runner.count() != 4 {
		t.Errorf("NoCache: runner called %d times, want 4", e.runner.count())
	}
}

func TestBuildCopyOutsideContext(t *testing.T) {
	e := newEnv(t)
	before := e.templates(t)
	cases := []struct {
		copy string
		want string
		is   error
	}{
		{"COPY ../outside /x", `source "../outside" is outside the build context`, errdefs.ErrInvalidArgument},
		{"COPY app/../../outside /x", `source "app/../../outside" is outside the build context`, errdefs.ErrInvalidArgument},
		{"COPY /etc/passwd /x", `source "/etc/passwd" is an absolute path`, errdefs.ErrInvalidArgument},
		{"COPY link-up /x", `source "link-up" resolves outside the build context`, errdefs.ErrInvalidArgument},
		{"COPY link-absolute /x", `source "link-absolute" resolves outside the build context`, errdefs.ErrInvalidArgument},
		{"COPY link-root/etc/passwd /x", `source "link-root/etc/passwd" resolves outside the build context`, errdefs.ErrInvalidArgument},
		{"COPY link-* /x/", `source "link-*" resolves outside the build context`, errdefs.ErrInvalidArgument},
		{"COPY nothere /x", `source "nothere": "nothere" not found in the build context`, errdefs.ErrNotFound},
		{"COPY *.nomatch /x", `no file in the build context matches "*.nomatch"`, errdefs.ErrNotFound},
		{"COPY a.txt b.txt /x", `COPY of 2 sources needs a destination directory ending in /, not "/x"`, errdefs.ErrInvalidArgument},
		{"COPY *.txt /x", `COPY of 2 sources needs a destination directory ending in /`, errdefs.ErrInvalidArgument},
		{"COPY $NOPE /x", `COPY needs at least one source and a destination`, errdefs.ErrInvalidArgument},
	}
	for _, c := range cases {
		t.Run(c.copy, func(t *testing.T) {
			_, err := e.build(t, "FROM base\nENV A=1\n"+c.copy+"\n")
			if err == nil {
				t.Fatal("no error")
			}
			if want := "step 3/3 (line 3) " + c.copy + ": "; !strings.HasPrefix(err.Error(), want) {
				t.Errorf("error %q, want prefix %q", err, want)
			}
			if !strings.Contains(err.Error(), c.want) || !errors.Is(err, c.is) {
				t.Errorf("error %q, want %q wrapping %v", err, c.want, c.is)
			}
			last := e.events[len(e.events)-1]
			if last.Status != "failed" || last.Step != 3 || last.ExitCode != nil {
				t.Errorf("last event %+v, want step 3 failed", last)
			}
		})
	}
	// Only the ENV step's template was made.
	if n := e.templates(t); n != before+1 {
		t.Errorf("%d templates, want %d", n, before+1)
	}
}

func TestBuildCopyForms(t *testing.T) {
	e := newEnv(t)
	got, err := e.build(t, `FROM base
COPY *.txt /multi/
COPY ["a.txt", "/opt/keep/"]
COPY a.txt /file-at-path
COPY app /bin/
COPY empty /made/by/empty/
COPY link-inside /etc/
COPY . /ctx
WORKDIR /w
COPY a.txt .
ADD b.txt rel/
`)
	if err != nil {
		t.Fatal(err)
	}
	root := e.rootfs(t, got.Digest)
	for p, want := range map[string]string{
		"multi/a.txt":     "A\n",
		"multi/b.txt":     "B\n",
		"opt/keep/a.txt":  "A\n",
		"opt/keep/a":      "a\n",
		"file-at-path":    "A\n",
		"usr/bin/main.py": "print('hi')\n", // /bin is a symlink to usr/bin
		"etc/link-inside": "print('hi')\n",
		"ctx/README":      "read me\n",
		"w/a.txt":         "A\n",
		"w/rel/b.txt":     "B\n",
	} {
		if s := readFile(t, filepath.Join(root, p)); s != want {
			t.Errorf("%s = %q, want %q", p, s, want)
		}
	}
	if st := lstat(t, filepath.Join(root, "bin")); st.Mode&unix.S_IFMT != unix.S_IFLNK {
		t.Errorf("/bin is no longer a symlink")
	}
	if st := lstat(t, filepath.Join(root, "made/by/empty")); st.Mode&unix.S_IFMT != unix.S_IFDIR {
		t.Errorf("COPY of an empty directory did not make the destination")
	}
	// Symlinks inside a copied directory are copied as symlinks (they are
	// only ever resolved inside the sandbox).
	if target, err := os.Readlink(filepath.Join(root, "ctx/link-up")); err != nil || target != "../outside" {
		t.Errorf("ctx/link-up = %q, %v", target, err)
	}
	if got.Config.Workdir != "/w" {
		t.Errorf("workdir %q", got.Config.Workdir)
	}
}

func TestBuildWorkdir(t *testing.T) {
	e := newEnv(t)
	got, err := e.build(t, "FROM base\nWORKDIR /tmp\nWORKDIR sub/dir\nENV D=x\nWORKDIR ${D}y\n")
	if err != nil {
		t.Fatal(err)
	}
	if got.Config.Workdir != "/tmp/sub/dir/xy" {
		t.Errorf("workdir %q", got.Config.Workdir)
	}
	root := e.rootfs(t, got.Digest)
	if st := lstat(t, filepath.Join(root, "tmp")); st.Mode&0o7777 != 0o1777 {
		t.Errorf("/tmp mode %o after WORKDIR /tmp, want 1777", st.Mode&0o7777)
	}
	if st := lstat(t, filepath.Join(root, "tmp/sub/dir/xy")); st.Mode&0o7777 != 0o755 {
		t.Errorf("created workdir mode %o", st.Mode&0o7777)
	}
	// WORKDIR of an existing directory changes no file.
	first := e.events[3]
	if first.Step != 2 || first.Status != "done" {
		t.Fatalf("event %+v", first)
	}
	tmpOnly, err := e.store.Get(context.Background(), first.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if tmpOnly.TreeDigest != e.base.TreeDigest {
		t.Errorf("WORKDIR /tmp changed the tree")
	}

	_, err = e.build(t, "FROM base\nWORKDIR /etc/hostname\n")
	if err == nil || !strings.Contains(err.Error(), `step 2/2 (line 2) WORKDIR /etc/hostname: "/etc/hostname" is not a directory in the template`) {
		t.Errorf("WORKDIR of a file: %v", err)
	}
}

func TestBuildRunFails(t *testing.T) {
	e := newEnv(t)
	big := strings.Repeat("0123456789abcdef", 4096) // 64 KiB in one write
	e.runner.scripts["make"] = func(t *testing.T, upper string, out io.Writer) int {
		writeFile(t, filepath.Join(upper, "junk"), "x", 0o644)
		io.WriteString(out, big)
		io.WriteString(out, "\nerror: ünïcödé boom\n")
		return 2
	}
	before := e.templates(t)
	_, err := e.build(t, "FROM base\nENV A=1\n\nRUN make\n")
	var se *StepError
	if !errors.As(err, &se) {
		t.Fatalf("error %v, want a StepError", err)
	}
	if !errors.Is(err, errdefs.ErrUnprocessable) {
		t.Errorf("error does not wrap ErrUnprocessable")
	}
	if se.ExitCode != 2 || se.Step != 3 || se.Steps != 3 || se.Line != 4 {
		t.Errorf("step error %+v", se)
	}
	if !strings.HasPrefix(err.Error(), "step 3/3 (line 4) RUN make: exit code 2: ") || !strings.HasSuffix(err.Error(), "error: ünïcödé boom") {
		t.Errorf("error %q", err)
	}
	if len(se.Tail) > tailBytes || len(se.Tail) < tailBytes-100 {
		t.Errorf("tail is %d bytes, want about %d", len(se.Tail), tailBytes)
	}
	var output string
	for _, ev := range e.events {
		if len(ev.Output) > OutputChunk {
			t.Errorf("output chunk of %d bytes", len(ev.Output))
		}
		output += ev.Output
	}
	if output != big+"\nerror: ünïcödé boom\n" {
		t.Errorf("streamed output differs (%d bytes)", len(output))
	}
	last := e.events[len(e.events)-1]
	if last.Status != "failed" || last.ExitCode == nil || *last.ExitCode != 2 || last.Line != 4 {
		t.Errorf("last event %+v", last)
	}
	if n := e.templates(t); n != before+1 {
		t.Errorf("%d templates after a failed RUN, want %d (only the ENV step)", n, before+1)
	}

	// A runner failure (not an exit code) is the step's error.
	_, err = e.build(t, "FROM base\nRUN unknown-script\n")
	if err == nil || !strings.Contains(err.Error(), `step 2/2 (line 2) RUN unknown-script: fake runner: no script for "unknown-script"`) {
		t.Errorf("runner error: %v", err)
	}
}

func TestBuildRunNetwork(t *testing.T) {
	e := newEnv(t)
	n := 0
	e.runner.scripts["true"] = func(t *testing.T, upper string, _ io.Writer) int {
		n++ // every run changes the tree, so no two steps share a template
		writeFile(t, filepath.Join(upper, "run"), fmt.Sprint(n), 0o644)
		return 0
	}
	_, err := e.build(t, "FROM base\nENV A=1\nRUN --network=host true\n")
	if err == nil || !strings.Contains(err.Error(), "line 3: RUN --network=host asks for network access") {
		t.Errorf("network=host without permission: %v", err)
	}
	if len(e.events) != 0 {
		t.Errorf("steps ran before a refused network request: %v", e.events)
	}
	if _, err := e.build(t, "FROM base\nRUN --network=host true\nRUN --network=none true\nRUN true\n", func(o *Options) { o.Network = true }); err != nil {
		t.Fatal(err)
	}
	if got := []bool{e.runner.calls[0].Network, e.runner.calls[1].Network, e.runner.calls[2].Network}; !reflect.DeepEqual(got, []bool{true, false, true}) {
		t.Errorf("network per step %v, want [true false true]", got)
	}
	// Whether a step had network is part of its cache key.
	if _, err := e.build(t, "FROM base\nRUN --network=host true\nRUN --network=none true\nRUN true\n"+"", func(o *Options) { o.Network = false }); err == nil {
		t.Errorf("network=host allowed without Network")
	}
	if _, err := e.build(t, "FROM base\nRUN true\n"); err != nil {
		t.Fatal(err)
	}
	if e.statuses()[1] != "done" {
		t.Errorf("RUN without network reused the cache of RUN with network")
	}
	if _, err := e.build(t, "FROM base\nRUN true\n", func(o *Options) { o.Runner = nil }); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("RUN without a runner: %v", err)
	}
}

func TestBuildFromErrors(t *testing.T) {
	e := newEnv(t)
	_, err := e.build(t, "# comment\nFROM nope:1\nRUN true\n")
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), `step 1/2 (line 2) FROM nope:1: base template "nope:1"`) {
		t.Errorf("missing base: %v", err)
	}
	if e.runner.count() != 0 {
		t.Errorf("runner called")
	}
	_, err = e.build(t, "FROM base\n", func(o *Options) { o.Tags = []string{"Bad Tag"} })
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad tag: %v", err)
	}
	// A FROM-only build names the base.
	got, err := e.build(t, "FROM base\n", func(o *Options) { o.Tags = []string{"alias"} })
	if err != nil || got.Digest != e.base.Digest || !reflect.DeepEqual(got.Tags, []string{"alias:latest", "base:latest"}) {
		t.Errorf("FROM only: %+v, %v", got, err)
	}
}

func TestBuildReadyNeedsStart(t *testing.T) {
	e := newEnv(t)
	_, err := e.build(t, "FROM base\nREADY true\n")
	if err == nil || !strings.Contains(err.Error(), "step 2/2 (line 2) READY true: READY checks the start command, and there is none yet") {
		t.Errorf("READY without START: %v", err)
	}
	_, err = e.build(t, "FROM base\nREADY true\nSTART serve\n")
	if err == nil || !strings.Contains(err.Error(), "step 2/3 (line 2) READY true: READY checks the start command") {
		t.Errorf("READY before START: %v", err)
	}
	got, err := e.build(t, "FROM base\nCMD serve\nREADY --interval=50ms true\n")
	if err != nil {
		t.Fatal(err)
	}
	want := &api.StartCommand{Cmd: []string{"/bin/sh", "-c", "serve"}, Ready: []string{"/bin/sh", "-c", "true"}, ReadyIntervalMS: 50}
	if !reflect.DeepEqual(got.Config.Start, want) {
		t.Errorf("start %+v, want %+v", got.Config.Start, want)
	}
	// A later build from it replaces the command and keeps the check.
	got, err = e.build(t, "FROM "+got.Digest+"\nSTART [\"other\"]\n")
	if err != nil {
		t.Fatal(err)
	}
	if got.Config.Start == nil || got.Config.Start.Cmd[0] != "other" || got.Config.Start.Ready[2] != "true" {
		t.Errorf("start %+v", got.Config.Start)
	}
}

func TestBuildAdd(t *testing.T) {
	e := newEnv(t)
	var tarBuf bytes.Buffer
	tw := tar.NewWriter(&tarBuf)
	tw.WriteHeader(&tar.Header{Name: "f", Mode: 0o644, Size: 1, Typeflag: tar.TypeReg})
	tw.Write([]byte("x"))
	tw.Close()
	gzipped := func(b []byte) []byte {
		var out bytes.Buffer
		zw := gzip.NewWriter(&out)
		zw.Write(b)
		zw.Close()
		return out.Bytes()
	}
	writeFile(t, filepath.Join(e.context, "bundle.tar"), tarBuf.String(), 0o644)
	writeFile(t, filepath.Join(e.context, "bundle.tgz"), string(gzipped(tarBuf.Bytes())), 0o644)
	writeFile(t, filepath.Join(e.context, "notes.gz"), string(gzipped([]byte("plain text, not a tar\n"))), 0o644)
	for _, name := range []string{"bundle.tar", "bundle.tgz"} {
		_, err := e.build(t, "FROM base\nADD "+name+" /opt/\n")
		if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "extracting archives is not supported") {
			t.Errorf("ADD %s: %v", name, err)
		}
	}
	// A compressed file that is no tar is copied as is, as Docker does.
	got, err := e.build(t, "FROM base\nADD notes.gz /opt/\nADD --chown=7 app /srv\n")
	if err != nil {
		t.Fatal(err)
	}
	root := e.rootfs(t, got.Digest)
	if s := readFile(t, filepath.Join(root, "opt/notes.gz")); !strings.HasPrefix(s, "\x1f\x8b") {
		t.Errorf("notes.gz not copied as is")
	}
	if st := lstat(t, filepath.Join(root, "srv/lib/util.py")); st.Uid != 7 || st.Gid != 7 {
		t.Errorf("ADD --chown=7: owner %d:%d", st.Uid, st.Gid)
	}
	if _, err := e.build(t, "FROM base\nENV U=http://example.com/x\nADD $U /x\n"); err == nil || !strings.Contains(err.Error(), "download it in a RUN step") {
		t.Errorf("ADD of an expanded URL: %v", err)
	}
}

func TestBuildMaxBytes(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.context, "big"), strings.Repeat("x", 64<<10), 0o644)
	before := e.templates(t)
	_, err := e.build(t, "FROM base\nCOPY big /big\n", func(o *Options) { o.MaxBytes = 32 << 10 })
	if !errors.Is(err, errdefs.ErrTooLarge) || !strings.Contains(err.Error(), "step 2/2 (line 2) COPY big /big") {
		t.Errorf("oversized COPY: %v", err)
	}
	if n := e.templates(t); n != before {
		t.Errorf("%d templates after a failed step, want %d", n, before)
	}
}

func TestOutputWriterKeepsRunes(t *testing.T) {
	var evs []api.BuildEvent
	w := &outputWriter{emit: func(ev api.BuildEvent) { evs = append(evs, ev) }}
	s := strings.Repeat("é", OutputChunk) // 2 bytes each: 64 KiB
	b := []byte(s)
	w.Write(b[:5]) // ends inside a rune
	w.Write(b[5:])
	w.flush()
	var got strings.Builder
	for _, ev := range evs {
		if len(ev.Output) > OutputChunk || !utf8Valid(ev.Output) {
			t.Fatalf("chunk of %d bytes, valid=%v", len(ev.Output), utf8Valid(ev.Output))
		}
		got.WriteString(ev.Output)
	}
	if got.String() != s {
		t.Errorf("reassembled output differs")
	}
	if tail := w.tail(); len(tail) > tailBytes || !utf8Valid(tail) || !strings.HasSuffix(s, tail) {
		t.Errorf("tail of %d bytes", len(tail))
	}
}

func utf8Valid(s string) bool { return strings.ToValidUTF8(s, "\uFFFD") == s }

func TestNetworkInstruction(t *testing.T) {
	e := newEnv(t)
	tpl, err := e.build(t, "FROM base\nNETWORK --internet --deny=10.0.0.0/8,192.0.2.0/24 pypi.org *.pythonhosted.org\n")
	if err != nil {
		t.Fatal(err)
	}
	want := &api.NetworkPolicy{Internet: true, DenyOut: []string{"10.0.0.0/8", "192.0.2.0/24"}, AllowOut: []string{"pypi.org", "*.pythonhosted.org"}}
	if !reflect.DeepEqual(tpl.Config.Network, want) {
		t.Fatalf("template network %+v, want %+v", tpl.Config.Network, want)
	}
	tpl, err = e.build(t, "FROM base\nNETWORK --internet\nNETWORK none\n")
	if err != nil || tpl.Config.Network == nil || tpl.Config.Network.Internet || len(tpl.Config.Network.AllowOut) != 0 {
		t.Fatalf("NETWORK none: %+v %v", tpl.Config.Network, err)
	}
	for _, bad := range []string{"NETWORK *", "NETWORK --deny=example.com ok.test", "NETWORK --internet none", "NETWORK --internet=yes", "NETWORK"} {
		_, err := Parse(strings.NewReader("FROM base\n" + bad + "\n"))
		if err == nil || !strings.Contains(err.Error(), "line 2") {
			t.Errorf("%q: %v, want an error on line 2", bad, err)
		}
	}
}
