package agent_test

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
	"golang.org/x/sys/unix"
)

func readAll(t *testing.T, c *agentclient.Client, p string) (string, error) {
	t.Helper()
	r, err := c.ReadFile(ctxT(t), p)
	if err != nil {
		return "", err
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	return string(b), err
}

func TestFilesBasics(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	c := e.c

	for _, size := range []int{0, 1, 32<<10 + 1, 3<<20 + 7} {
		data := bytes.Repeat([]byte{'x'}, size)
		fi, err := c.WriteFile(ctx, "/f.bin", 0, bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size != int64(size) || fi.Type != "file" || fi.Mode != 0o644 || fi.Path != "/f.bin" || fi.Name != "f.bin" {
			t.Fatalf("size %d: info %+v", size, fi)
		}
		got, err := readAll(t, c, "f.bin")
		if err != nil || got != string(data) {
			t.Fatalf("size %d: read %d bytes, %v", size, len(got), err)
		}
	}
	// mode: explicit, then kept on replace.
	if fi, err := c.WriteFile(ctx, "/x.sh", 0o750, strings.NewReader("#!/bin/sh\n")); err != nil || fi.Mode != 0o750 {
		t.Fatalf("mode: %+v %v", fi, err)
	}
	if fi, err := c.WriteFile(ctx, "/x.sh", 0, strings.NewReader("#!/bin/sh\necho\n")); err != nil || fi.Mode != 0o750 {
		t.Fatalf("mode kept: %+v %v", fi, err)
	}
	// No leftover temp files.
	ents, _ := os.ReadDir(e.root)
	for _, ent := range ents {
		if strings.HasPrefix(ent.Name(), ".space-tmp") {
			t.Fatalf("temp file left: %s", ent.Name())
		}
	}

	_, err := c.WriteFile(ctx, "/no/such/dir/f", 0, strings.NewReader("x"))
	wantErr(t, err, errdefs.ErrNotFound)
	fi, err := c.Mkdir(ctx, "/a/b/c", 0o700)
	if err != nil || fi.Type != "dir" || fi.Mode != 0o700 || fi.Path != "/a/b/c" {
		t.Fatalf("mkdir: %+v %v", fi, err)
	}
	if _, err := c.Mkdir(ctx, "/a/b/c", 0); err != nil {
		t.Fatalf("mkdir -p of an existing dir: %v", err)
	}
	_, err = c.Mkdir(ctx, "/f.bin/sub", 0)
	wantErr(t, err, errdefs.ErrConflict)
	_, err = c.WriteFile(ctx, "/a/b", 0, strings.NewReader("x"))
	wantErr(t, err, errdefs.ErrConflict)
	_, err = c.ReadFile(ctx, "/a")
	wantErr(t, err, errdefs.ErrConflict)
	_, err = c.ReadFile(ctx, "/missing")
	wantErr(t, err, errdefs.ErrNotFound)

	if _, err := c.WriteFile(ctx, "/a/b/c/file", 0, strings.NewReader("deep")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/passwd", filepath.Join(e.root, "a", "link")); err != nil {
		t.Fatal(err)
	}
	list, err := c.List(ctx, "/a")
	if err != nil {
		t.Fatal(err)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Name < list[j].Name })
	if len(list) != 2 || list[0].Name != "b" || list[0].Type != "dir" || list[1].Type != "symlink" || list[1].Target != "/etc/passwd" || list[1].Path != "/a/link" {
		t.Fatalf("list = %+v", list)
	}
	st, err := c.Stat(ctx, "/a/link")
	if err != nil || st.Type != "symlink" || st.Target != "/etc/passwd" {
		t.Fatalf("stat symlink (lstat semantics) = %+v %v", st, err)
	}
	if st, err := c.Stat(ctx, "/"); err != nil || st.Type != "dir" {
		t.Fatalf("stat / = %+v %v", st, err)
	}

	wantErr(t, c.Remove(ctx, "/a", false), errdefs.ErrConflict)
	if err := c.Rename(ctx, "/a/b/c/file", "/moved"); err != nil {
		t.Fatal(err)
	}
	if got, _ := readAll(t, c, "/moved"); got != "deep" {
		t.Fatalf("after rename: %q", got)
	}
	wantErr(t, c.Rename(ctx, "/nope", "/x"), errdefs.ErrNotFound)
	wantErr(t, c.Rename(ctx, "/", "/x"), errdefs.ErrInvalidArgument)
	if err := c.Remove(ctx, "/a", true); err != nil {
		t.Fatal(err)
	}
	wantErr(t, c.Remove(ctx, "/a", true), errdefs.ErrNotFound)
	wantErr(t, c.Remove(ctx, "/", true), errdefs.ErrInvalidArgument)
	if err := c.Remove(ctx, "/moved", false); err != nil {
		t.Fatal(err)
	}

	// Path validation.
	for _, bad := range []string{"", "a\x00b", "/" + strings.Repeat("a", 4096)} {
		_, err := c.Stat(ctx, bad)
		wantErr(t, err, errdefs.ErrInvalidArgument)
	}
	_, err = c.Stat(ctx, "/"+strings.Repeat("a", 300)) // legal length, over NAME_MAX
	wantErr(t, err, errdefs.ErrInvalidArgument)
}

// TestFilesConfinement attacks the root with symlinks and dot-dots; every
// access must resolve inside it.
func TestFilesConfinement(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	c := e.c
	outside := t.TempDir() // a host directory outside the root
	writeRootFile(t, e.root, "etc/passwd", "inside\n")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink("/etc/passwd", filepath.Join(e.root, "abs")))
	must(os.Symlink("../../../../../../etc/passwd", filepath.Join(e.root, "rel")))
	must(os.Symlink("../../../../../..", filepath.Join(e.root, "up")))
	must(os.Symlink(outside, filepath.Join(e.root, "out")))
	must(os.Symlink("/proc/self/root", filepath.Join(e.root, "magic")))

	for _, p := range []string{"/etc/passwd", "abs", "rel", "up/etc/passwd", "../../../etc/passwd", "/../etc/./passwd", "up/up/etc/passwd"} {
		got, err := readAll(t, c, p)
		if err != nil || got != "inside\n" {
			t.Fatalf("read %q = %q, %v; want the root's own file", p, got, err)
		}
	}
	_, err := readAll(t, c, "magic/etc/passwd")
	if err == nil {
		t.Fatal("a /proc magic link was followed")
	}

	// Writes through symlinks that point outside land inside or fail.
	_, err = c.WriteFile(ctx, "out/pwned", 0, strings.NewReader("x"))
	wantErr(t, err, errdefs.ErrNotFound) // <root>/<outside> does not exist
	must(os.MkdirAll(filepath.Join(e.root, outside), 0o755))
	if _, err := c.WriteFile(ctx, "out/pwned", 0, strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.root, outside, "pwned")); err != nil {
		t.Fatalf("write through an absolute symlink did not land inside the root: %v", err)
	}
	if _, err := c.Mkdir(ctx, "up/newdir", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.root, "newdir")); err != nil {
		t.Fatalf("mkdir through ../ symlink not confined: %v", err)
	}
	// Replacing a symlink replaces the link, never writes its target.
	if _, err := c.WriteFile(ctx, "abs", 0, strings.NewReader("new")); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(filepath.Join(e.root, "abs")); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("abs: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(filepath.Join(e.root, "etc/passwd")); string(b) != "inside\n" {
		t.Fatalf("target of a replaced symlink changed: %q", b)
	}
	// Removing through a symlinked parent stays inside too.
	must(os.WriteFile(filepath.Join(outside, "keep"), []byte("k"), 0o644))
	err = c.Remove(ctx, "out/keep", false)
	wantErr(t, err, errdefs.ErrNotFound)
	if err := c.Remove(ctx, "out", true); err != nil { // removes the link, not the target
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(outside, "keep")); err != nil {
		t.Fatalf("outside file removed: %v", err)
	}
	assertEmptyExcept(t, outside, "keep")
}

func assertEmptyExcept(t *testing.T, dir string, keep ...string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents {
		found := false
		for _, k := range keep {
			found = found || ent.Name() == k
		}
		if !found {
			t.Fatalf("%s appeared outside the root in %s", ent.Name(), dir)
		}
	}
}

// TestFilesSwapRace swaps a directory for a symlink to a host directory
// while writes go through it: nothing may ever land outside the root.
func TestFilesSwapRace(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	outside := t.TempDir()
	d := filepath.Join(e.root, "d")
	// The symlink's target exists inside the root too, so writes through it
	// succeed (confined) instead of failing.
	if err := os.MkdirAll(filepath.Join(e.root, outside), 0o755); err != nil {
		t.Fatal(err)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			os.RemoveAll(d)
			if i%2 == 0 {
				os.Mkdir(d, 0o755)
			} else {
				os.Symlink(outside, d)
			}
		}
	}()
	ok, n := 0, 0
	deadline := time.Now().Add(2 * time.Second)
	for ; time.Now().Before(deadline); n++ {
		if _, err := e.c.WriteFile(ctx, "d/f", 0, strings.NewReader("x")); err == nil {
			ok++
		}
		e.c.Mkdir(ctx, "d/sub", 0)
		e.c.Remove(ctx, "d/sub", true)
	}
	stop.Store(true)
	wg.Wait()
	assertEmptyExcept(t, outside)
	if ok == 0 {
		t.Fatal("no write succeeded; the race was not exercised")
	}
	t.Logf("%d of %d writes succeeded during the swap race", ok, n)
}

type tarEntry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func makeTar(t *testing.T, entries []tarEntry) *bytes.Buffer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, en := range entries {
		mode := en.mode
		if mode == 0 {
			mode = 0o644
		}
		h := &tar.Header{Name: en.name, Typeflag: en.typ, Mode: mode, Linkname: en.link, Size: int64(len(en.body)), ModTime: time.Unix(1700000000, 0)}
		if en.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if en.typ == tar.TypeReg {
			tw.Write([]byte(en.body))
		}
	}
	tw.Close()
	return &buf
}

func TestTarRoundTrip(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	src := makeTar(t, []tarEntry{
		{name: "dir/", typ: tar.TypeDir, mode: 0o755},
		{name: "dir/a.txt", typ: tar.TypeReg, body: "alpha"},
		{name: "dir/sub/b.txt", typ: tar.TypeReg, body: strings.Repeat("b", 100_000), mode: 0o600},
		{name: "dir/link", typ: tar.TypeSymlink, link: "/etc/passwd"},
		{name: "dir/hard", typ: tar.TypeLink, link: "dir/a.txt"},
		{name: "suid", typ: tar.TypeReg, body: "s", mode: 0o6755},
	})
	if err := e.c.TarPut(ctx, "/up", src); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(e.root, "up/suid"))
	if err != nil || st.Mode().Perm() != 0o755 || st.Mode()&(os.ModeSetuid|os.ModeSetgid) != 0 {
		t.Fatalf("suid entry: %v %v", st.Mode(), err)
	}
	if st.ModTime().Unix() != 1700000000 {
		t.Fatalf("mtime %v", st.ModTime())
	}
	if l, err := os.Readlink(filepath.Join(e.root, "up/dir/link")); err != nil || l != "/etc/passwd" {
		t.Fatalf("symlink: %q %v", l, err)
	}
	a, _ := os.Stat(filepath.Join(e.root, "up/dir/a.txt"))
	h, _ := os.Stat(filepath.Join(e.root, "up/dir/hard"))
	if !os.SameFile(a, h) {
		t.Fatal("hard link not linked")
	}

	r, err := e.c.TarGet(ctx, "/up/dir")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		switch hdr.Typeflag {
		case tar.TypeSymlink:
			got[hdr.Name] = "->" + hdr.Linkname
		case tar.TypeDir:
			got[hdr.Name] = "dir"
		default:
			got[hdr.Name] = string(b)
		}
	}
	r.Close()
	want := map[string]string{"a.txt": "alpha", "hard": "alpha", "sub/": "dir", "sub/b.txt": strings.Repeat("b", 100_000), "link": "->/etc/passwd"}
	if len(got) != len(want) {
		t.Fatalf("tar entries %v", keys(got))
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("entry %q = %.40q, want %.40q", k, got[k], v)
		}
	}
	// A single file.
	r, err = e.c.TarGet(ctx, "/up/dir/a.txt")
	if err != nil {
		t.Fatal(err)
	}
	tr = tar.NewReader(r)
	hdr, err := tr.Next()
	if err != nil || hdr.Name != "a.txt" || hdr.Size != 5 {
		t.Fatalf("single file tar: %+v %v", hdr, err)
	}
	r.Close()
	_, err = e.c.TarGet(ctx, "/nope")
	wantErr(t, err, errdefs.ErrNotFound)
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func TestTarPutAttacks(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	writeRootFile(t, e.root, "etc/passwd", "root's\n")
	for name, entries := range map[string][]tarEntry{
		"dotdot":        {{name: "../escape", typ: tar.TypeReg, body: "x"}},
		"nested dotdot": {{name: "a/../../escape", typ: tar.TypeReg, body: "x"}},
		"absolute":      {{name: "/escape", typ: tar.TypeReg, body: "x"}},
		"device":        {{name: "dev", typ: tar.TypeChar}},
		"fifo":          {{name: "fifo", typ: tar.TypeFifo}},
		"hardlink out":  {{name: "h", typ: tar.TypeLink, link: "../../etc/passwd"}},
		"hardlink abs":  {{name: "h", typ: tar.TypeLink, link: "/etc/passwd"}},
	} {
		err := e.c.TarPut(ctx, "/t", makeTar(t, entries))
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: err = %v, want invalid argument", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(e.root, "escape")); err == nil {
		t.Fatal("an entry escaped the target directory")
	}
	// A symlink entry, then files written "through" it: they must stay in
	// the target directory (symlinks resolve with the target as root).
	err := e.c.TarPut(ctx, "/t2", makeTar(t, []tarEntry{
		{name: "link", typ: tar.TypeSymlink, link: "/"},
		{name: "link/etc/passwd", typ: tar.TypeReg, body: "pwned"},
		{name: "rel", typ: tar.TypeSymlink, link: "../../.."},
		{name: "rel/etc/shadow", typ: tar.TypeReg, body: "pwned"},
		{name: "link", typ: tar.TypeReg, body: "replaced"}, // replaces the symlink itself
	}))
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(e.root, "etc/passwd")); string(b) != "root's\n" {
		t.Fatalf("root's /etc/passwd overwritten: %q", b)
	}
	if _, err := os.Stat(filepath.Join(e.root, "etc/shadow")); err == nil {
		t.Fatal("entry written through a relative symlink escaped the target")
	}
	if b, _ := os.ReadFile(filepath.Join(e.root, "t2/etc/passwd")); string(b) != "pwned" {
		t.Fatalf("entry through symlink did not land in the target: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(e.root, "t2/link")); string(b) != "replaced" {
		t.Fatalf("symlink not replaced by the later file: %q", b)
	}
	// Garbage is a clean 400.
	err = e.c.TarPut(ctx, "/t3", strings.NewReader(strings.Repeat("garbage!", 200)))
	wantErr(t, err, errdefs.ErrInvalidArgument)
}

// TestFilesProcMagicLinks: with a real procfs inside the root, its magic
// links (/proc/self/root, /proc/<pid>/cwd, fd links) must not be followed
// out of the root.
func TestFilesProcMagicLinks(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	proc := filepath.Join(e.root, "proc")
	if err := os.Mkdir(proc, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc", proc, "", unix.MS_BIND, ""); err != nil {
		testenv.Require(t, "bind-mount", false, err.Error())
	}
	t.Cleanup(func() { unix.Unmount(proc, unix.MNT_DETACH) })
	host, err := os.ReadFile("/etc/hostname")
	if err != nil {
		t.Skip("no /etc/hostname on this host")
	}
	for _, p := range []string{"/proc/self/root/etc/hostname", "/proc/1/root/etc/hostname", "/proc/self/cwd/etc/hostname", "/proc/thread-self/root/etc/hostname"} {
		got, err := readAll(t, e.c, p)
		if err == nil || got == string(host) {
			t.Fatalf("read %s through a magic link: %q, %v", p, got, err)
		}
	}
	_, err = e.c.WriteFile(ctx, "/proc/self/root/tmp/space-magic-escape", 0, strings.NewReader("x"))
	if err == nil {
		t.Fatal("write through /proc/self/root succeeded")
	}
	if _, err := os.Stat("/tmp/space-magic-escape"); err == nil {
		os.Remove("/tmp/space-magic-escape")
		t.Fatal("write escaped through a magic link")
	}
	// Ordinary procfs files are still readable (they are not links).
	if got, err := readAll(t, e.c, "/proc/self/status"); err == nil && got == "" {
		t.Fatal("empty /proc/self/status")
	}
}

// TestResolveThenExact: Resolve names the path the kernel reaches (symlinks
// resolved inside the root, the leaf only when asked), and an Exact
// operation on a path refuses any symlink on the way, so one planted after
// the host resolved and decided fails instead of redirecting the write.
func TestResolveThenExact(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	for _, d := range []string{"etc", "tmp/work"} {
		os.MkdirAll(filepath.Join(e.root, d), 0o755)
	}
	os.Symlink("/etc", filepath.Join(e.root, "tmp/abs"))
	os.Symlink("../etc", filepath.Join(e.root, "tmp/rel"))
	os.Symlink("/../../tmp/abs", filepath.Join(e.root, "tmp/up"))
	os.Symlink("loop2", filepath.Join(e.root, "tmp/loop1"))
	os.Symlink("loop1", filepath.Join(e.root, "tmp/loop2"))
	for _, c := range []struct {
		path   string
		follow bool
		want   string
	}{
		{"/tmp/abs/x", false, "/etc/x"},
		{"/tmp/rel/x/y", false, "/etc/x/y"},
		{"/tmp/up/x", true, "/etc/x"},
		{"/tmp/abs", false, "/tmp/abs"},
		{"/tmp/abs", true, "/etc"},
		{"/tmp/../../etc/./x", false, "/etc/x"},
		{"/tmp/missing/../abs/x", false, "/etc/x"}, // made clean first: the host only sends clean paths
		{"/", true, "/"},
	} {
		got, err := e.c.Resolve(ctx, c.path, c.follow)
		if err != nil || got != c.want {
			t.Errorf("Resolve(%s, follow=%v) = %q, %v; want %q", c.path, c.follow, got, err, c.want)
		}
	}
	if _, err := e.c.Resolve(ctx, "/tmp/loop1/x", false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a symlink loop: %v", err)
	}

	// Resolved, decided, then swapped for a symlink: the Exact write fails.
	p, err := e.c.Resolve(ctx, "/tmp/work/f", false)
	if err != nil || p != "/tmp/work/f" {
		t.Fatal(p, err)
	}
	os.Remove(filepath.Join(e.root, "tmp/work"))
	os.Symlink("/etc", filepath.Join(e.root, "tmp/work"))
	if _, err := e.c.WriteFile(ctx, p, 0, strings.NewReader("x"), agentclient.Exact()); err == nil {
		t.Error("an Exact write followed a symlink planted after the resolve")
	}
	if err := e.c.TarPut(ctx, p, bytes.NewReader(nil), agentclient.Exact()); err == nil {
		t.Error("an Exact tar upload followed a symlink planted after the resolve")
	}
	if _, err := e.c.Mkdir(ctx, "/tmp/work/d", 0o755, agentclient.Exact()); err == nil {
		t.Error("an Exact mkdir followed a symlink")
	}
	if err := e.c.Rename(ctx, "/tmp/rel", "/tmp/work/r", agentclient.Exact()); err == nil {
		t.Error("an Exact rename's target followed a symlink")
	}
	assertEmptyExcept(t, filepath.Join(e.root, "etc"))
	// Without Exact the same write goes through the symlink (confined).
	if _, err := e.c.WriteFile(ctx, p, 0, strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.root, "etc/f")); err != nil {
		t.Error(err)
	}
}
