package template

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/testenv"
)

type env struct {
	db    *store.DB
	dir   string
	store *Store
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testenv.RequireRoot(t) // ownership is part of every digest
	base := t.TempDir()
	db, err := store.Open(filepath.Join(base, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	e := &env{db: db, dir: filepath.Join(base, "templates")}
	e.store = e.open(t)
	return e
}

func (e *env) open(t *testing.T) *Store {
	t.Helper()
	s, err := Open(e.db.SQL(), e.dir, filepath.Join(filepath.Dir(e.dir), "cache"), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// entry is one tar member for tests.
type entry struct {
	tar.Header
	body string
}

var mtime = time.Date(2025, 5, 20, 12, 0, 0, 0, time.UTC)

func file(name, body string, mode int64) entry {
	return entry{tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(body)), ModTime: mtime}, body}
}
func dir(name string, mode int64) entry {
	return entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode, ModTime: mtime}}
}
func symlink(name, target string) entry {
	return entry{Header: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777, ModTime: mtime}}
}
func hardlink(name, target string) entry {
	return entry{Header: tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target, ModTime: mtime}}
}

func mktar(t *testing.T, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.Header
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gz(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	w.Write(b)
	w.Close()
	return buf.Bytes()
}

func stat(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// assertClean checks that a failed import left nothing: no staging junk and
// no content directory or record.
func (e *env) assertClean(t *testing.T, wantTemplates int) {
	t.Helper()
	junk, _ := os.ReadDir(filepath.Join(e.dir, "tmp"))
	if len(junk) != 0 {
		t.Errorf("staging junk left: %v", junk)
	}
	list, err := e.store.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != wantTemplates {
		t.Errorf("%d templates, want %d", len(list), wantTemplates)
	}
	all, _ := os.ReadDir(e.dir)
	content := 0
	for _, d := range all {
		if hexDigest.MatchString(d.Name()) {
			content++
		}
	}
	if content != wantTemplates {
		t.Errorf("%d content dirs, want %d", content, wantTemplates)
	}
}

func TestImportTarPreservesTree(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	owned := file("etc/owned", "secret\n", 0o640)
	owned.Uid, owned.Gid = 1234, 5678
	suid := file("usr/bin/su", "#!/bin/sh\n", 0o6755)
	dev := entry{Header: tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}}
	fifo := entry{Header: tar.Header{Typeflag: tar.TypeFifo, Name: "run/fifo", Mode: 0o620}}
	data := mktar(t,
		dir("./", 0o755),
		dir("etc/", 0o755),
		owned,
		symlink("etc/link", "/etc/owned"),
		hardlink("etc/hard", "etc/owned"),
		dir("tmp/", 0o1777),
		dir("sgid/", 0o2775),
		suid,
		dev,
		fifo,
		file("deep/implicit/parents/f", "x", 0o600), // no dir entries for the parents
		entry{tar.Header{Typeflag: tar.TypeReg, Name: "far-future", Mode: 0o644, ModTime: time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)}, ""},
	)
	tmpl, err := e.store.ImportTar(ctx, bytes.NewReader(gz(t, data)), ImportOptions{Tags: []string{"demo"}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tmpl.Digest, "sha256:") || len(tmpl.Digest) != 71 {
		t.Fatalf("digest %q", tmpl.Digest)
	}
	if tmpl.Source != "tar" || len(tmpl.Tags) != 1 || tmpl.Tags[0] != "demo:latest" || tmpl.CreatedAt.IsZero() {
		t.Fatalf("template %+v", tmpl)
	}
	// Content: each inode once.
	if want := int64(len("secret\n") + len("#!/bin/sh\n") + 1); tmpl.SizeBytes != want {
		t.Errorf("size %d, want %d", tmpl.SizeBytes, want)
	}
	got, root, err := e.store.Resolve(ctx, "demo:latest")
	if err != nil || got.Digest != tmpl.Digest {
		t.Fatalf("resolve: %+v %v", got, err)
	}
	if root != filepath.Join(e.dir, strings.TrimPrefix(tmpl.Digest, "sha256:"), "rootfs") {
		t.Fatalf("rootfs dir %s", root)
	}

	st := stat(t, filepath.Join(root, "etc/owned"))
	if st.Uid != 1234 || st.Gid != 5678 || st.Mode&0o7777 != 0o640 {
		t.Errorf("etc/owned: uid %d gid %d mode %o", st.Uid, st.Gid, st.Mode&0o7777)
	}
	if time.Unix(st.Mtim.Unix()).UTC() != mtime {
		t.Errorf("mtime not preserved: %v", time.Unix(st.Mtim.Unix()))
	}
	if hard := stat(t, filepath.Join(root, "etc/hard")); hard.Ino != st.Ino || st.Nlink != 2 {
		t.Errorf("hard link not preserved: ino %d vs %d, nlink %d", hard.Ino, st.Ino, st.Nlink)
	}
	if target, err := os.Readlink(filepath.Join(root, "etc/link")); err != nil || target != "/etc/owned" {
		t.Errorf("symlink: %q %v", target, err)
	}
	if m := stat(t, filepath.Join(root, "tmp")).Mode; m&0o7777 != 0o1777 {
		t.Errorf("tmp mode %o, want 1777", m&0o7777)
	}
	if m := stat(t, filepath.Join(root, "sgid")).Mode; m&0o7777 != 0o2775 {
		t.Errorf("setgid dir mode %o, want 2775 (kept on directories)", m&0o7777)
	}
	if m := stat(t, filepath.Join(root, "usr/bin/su")).Mode; m&0o7777 != 0o755 {
		t.Errorf("setuid file mode %o, want 0755 (setuid/setgid dropped)", m&0o7777)
	}
	if _, err := os.Lstat(filepath.Join(root, "dev/null")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("device node was created: %v", err)
	}
	if m := stat(t, filepath.Join(root, "run/fifo")).Mode; m&unix.S_IFMT != unix.S_IFIFO || m&0o777 != 0o620 {
		t.Errorf("fifo mode %o", m)
	}
	if m := stat(t, filepath.Join(root, "deep/implicit")).Mode; m&0o7777 != 0o755 {
		t.Errorf("implicit parent mode %o, want 0755", m&0o7777)
	}
	// Only root may reach template trees (they hold world-writable dirs).
	for _, p := range []string{e.dir, filepath.Dir(root)} {
		if m := stat(t, p).Mode & 0o777; m != 0o700 {
			t.Errorf("%s mode %o, want 0700", p, m)
		}
	}
	e.assertClean(t, 1)

	// A plain tar whose first member's name looks like a compression magic
	// is still a tar.
	if _, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t, file("BZh91AY", "x", 0o644))), ImportOptions{}); err != nil {
		t.Errorf("tar starting with a bzip2-like name: %v", err)
	}
}

func TestDigestIsCanonicalAndDedups(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	tree := func(mt time.Time, extra ...entry) []byte {
		es := []entry{dir("a/", 0o755), file("a/f", "hello", 0o644), symlink("a/l", "f"), hardlink("a/h", "a/f")}
		for i := range es {
			es[i].ModTime = mt
		}
		return mktar(t, append(es, extra...)...)
	}
	t1, err := e.store.ImportTar(ctx, bytes.NewReader(tree(mtime)), ImportOptions{Tags: []string{"one:v1"}})
	if err != nil {
		t.Fatal(err)
	}
	// Same tree, other mtimes, gzip, other tag: same digest, one copy.
	t2, err := e.store.ImportTar(ctx, bytes.NewReader(gz(t, tree(mtime.Add(time.Hour)))), ImportOptions{Tags: []string{"two"}})
	if err != nil {
		t.Fatal(err)
	}
	if t1.Digest != t2.Digest {
		t.Fatalf("same tree, different digests: %s %s", t1.Digest, t2.Digest)
	}
	if want := []string{"one:v1", "two:latest"}; strings.Join(t2.Tags, ",") != strings.Join(want, ",") {
		t.Errorf("tags %v, want %v", t2.Tags, want)
	}
	// A directory import of the same tree agrees with the tar import.
	_, root, err := e.store.Resolve(ctx, t1.Digest)
	if err != nil {
		t.Fatal(err)
	}
	t3, err := e.store.ImportDir(ctx, root, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if t3.Digest != t1.Digest || t3.Source != "tar" {
		t.Fatalf("dir import of the same tree: %+v (want digest %s, first source kept)", t3, t1.Digest)
	}
	e.assertClean(t, 1)

	// Every described attribute changes the digest.
	variants := map[string][]byte{
		"content": mktar(t, dir("a/", 0o755), file("a/f", "hellO", 0o644), symlink("a/l", "f"), hardlink("a/h", "a/f")),
		"mode":    mktar(t, dir("a/", 0o755), file("a/f", "hello", 0o600), symlink("a/l", "f"), hardlink("a/h", "a/f")),
		"target":  mktar(t, dir("a/", 0o755), file("a/f", "hello", 0o644), symlink("a/l", "g"), hardlink("a/h", "a/f")),
		"nolink":  mktar(t, dir("a/", 0o755), file("a/f", "hello", 0o644), symlink("a/l", "f"), file("a/h", "hello", 0o644)),
		"name":    mktar(t, dir("a/", 0o755), file("a/g", "hello", 0o644), symlink("a/l", "f"), hardlink("a/h", "a/g")),
	}
	owner := file("a/f", "hello", 0o644)
	owner.Uid = 1
	variants["owner"] = mktar(t, dir("a/", 0o755), owner, symlink("a/l", "f"), hardlink("a/h", "a/f"))
	seen := map[string]string{t1.Digest: "original"}
	for name, data := range variants {
		v, err := e.store.ImportTar(ctx, bytes.NewReader(data), ImportOptions{})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if other, dup := seen[v.Digest]; dup {
			t.Errorf("variant %q has the same digest as %q", name, other)
		}
		seen[v.Digest] = name
	}
}

func TestConcurrentImportsOfSameContent(t *testing.T) {
	e := newEnv(t)
	data := mktar(t, file("x", strings.Repeat("y", 1<<20), 0o644))
	var wg sync.WaitGroup
	digests := make([]string, 4)
	errs := make([]error, 4)
	for i := range digests {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			tmpl, err := e.store.ImportTar(context.Background(), bytes.NewReader(data), ImportOptions{})
			digests[i], errs[i] = tmpl.Digest, err
		}(i)
	}
	wg.Wait()
	for i := range digests {
		if errs[i] != nil || digests[i] != digests[0] {
			t.Fatalf("import %d: %s %v", i, digests[i], errs[i])
		}
	}
	e.assertClean(t, 1)
}

func TestHostileTar(t *testing.T) {
	outside := t.TempDir()
	victim := filepath.Join(outside, "victim")
	if err := os.WriteFile(victim, []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	trunc := func(b []byte, n int) []byte { return b[:n] }
	good := mktar(t, file("a", strings.Repeat("z", 3000), 0o644), file("b", "b", 0o644))
	corruptHeader := append([]byte(nil), good...)
	corruptHeader[100] ^= 0xff // inside the first header's mode field: checksum mismatch
	gzGood := gz(t, good)
	corruptGzip := append([]byte(nil), gzGood...)
	corruptGzip[len(corruptGzip)/2] ^= 0xff
	badCRC := append([]byte(nil), gzGood...)
	badCRC[len(badCRC)-6] ^= 0xff // in the CRC-32 trailer

	cases := []struct {
		name     string
		data     []byte
		max      int64
		want     error
		contains string
	}{
		{"dotdot", mktar(t, file("../evil", "x", 0o644)), 0, errdefs.ErrInvalidArgument, "'..'"},
		{"dotdot inside", mktar(t, file("a/../../evil", "x", 0o644)), 0, errdefs.ErrInvalidArgument, "'..'"},
		{"absolute", mktar(t, file("/evil", "x", 0o644)), 0, errdefs.ErrInvalidArgument, "is absolute"},
		{"write through symlink to outside", mktar(t, symlink("l", outside), file("l/pwned", "x", 0o644)), 0,
			errdefs.ErrInvalidArgument, "not a directory (a symlink or file)"},
		{"write through symlink to parent", mktar(t, symlink("l", ".."), file("l/pwned", "x", 0o644)), 0,
			errdefs.ErrInvalidArgument, "not a directory (a symlink or file)"},
		{"dir through symlink", mktar(t, symlink("l", outside), dir("l/sub/", 0o755)), 0,
			errdefs.ErrInvalidArgument, "not a directory (a symlink or file)"},
		{"hard link absolute", mktar(t, hardlink("h", victim)), 0, errdefs.ErrInvalidArgument, "is absolute"},
		{"hard link dotdot", mktar(t, hardlink("h", "../../../../"+victim)), 0, errdefs.ErrInvalidArgument, "'..'"},
		{"hard link through symlink", mktar(t, symlink("l", outside), hardlink("h", "l/victim")), 0,
			errdefs.ErrInvalidArgument, "not a directory (a symlink or file)"},
		{"hard link to missing", mktar(t, hardlink("h", "nothere")), 0, errdefs.ErrInvalidArgument, "not in the archive"},
		{"file replaces directory", mktar(t, dir("d/", 0o755), file("d", "x", 0o644)), 0, errdefs.ErrInvalidArgument, "replace a directory"},
		{"root as file", mktar(t, file(".", "x", 0o644)), 0, errdefs.ErrInvalidArgument, "root must be a directory"},
		{"too large content", good, 2048, errdefs.ErrTooLarge, "limit of 2048 bytes"},
		{"too many entries", func() []byte {
			var es []entry
			for i := 0; i < 100; i++ {
				es = append(es, file("f"+strings.Repeat("x", i), "", 0o644))
			}
			return mktar(t, es...)
		}(), 20 * 512, errdefs.ErrTooLarge, "limit"},
		{"truncated in content", trunc(good, 512+1000), 0, errdefs.ErrInvalidArgument, `truncated inside entry "a" (1000 of 3000 bytes)`},
		{"truncated in header", trunc(good, 512+3072+100), 0, errdefs.ErrInvalidArgument, `truncated in header after entry "a"`},
		{"truncated between entries", trunc(good, 512+3072), 0, errdefs.ErrInvalidArgument, "no end-of-archive marker"},
		{"corrupt header", corruptHeader, 0, errdefs.ErrInvalidArgument, "corrupt tar header"},
		{"corrupt gzip", corruptGzip, 0, errdefs.ErrInvalidArgument, "gzip"},
		{"gzip bad crc", badCRC, 0, errdefs.ErrInvalidArgument, "gzip"},
		{"truncated gzip", trunc(gzGood, len(gzGood)/2), 0, errdefs.ErrInvalidArgument, "gzip-compressed archive truncated"},
		{"empty", nil, 0, errdefs.ErrInvalidArgument, "empty"},
		{"zstd", append([]byte{0x28, 0xb5, 0x2f, 0xfd}, good...), 0, errdefs.ErrInvalidArgument, "zstd-compressed"},
		{"not an archive", []byte(strings.Repeat("this is not a tar file\n", 100)), 0, errdefs.ErrInvalidArgument, "corrupt tar header"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			_, err := e.store.ImportTar(context.Background(), bytes.NewReader(tc.data), ImportOptions{MaxBytes: tc.max})
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if !strings.Contains(err.Error(), tc.contains) {
				t.Errorf("err = %q, want it to mention %q", err, tc.contains)
			}
			t.Logf("rejected: %v", err)
			e.assertClean(t, 0)
			if b, _ := os.ReadFile(victim); string(b) != "original" {
				t.Fatalf("victim outside the store was modified: %q", b)
			}
			if left, _ := os.ReadDir(outside); len(left) != 1 {
				t.Fatalf("something was written outside the store: %v", left)
			}
		})
	}
}

// A later entry replacing a symlink must replace the link, not write
// through it.
func TestTarReplacesSymlinkInsteadOfFollowing(t *testing.T) {
	e := newEnv(t)
	outside := filepath.Join(t.TempDir(), "victim")
	os.WriteFile(outside, []byte("original"), 0o644)
	tmpl, err := e.store.ImportTar(context.Background(), bytes.NewReader(mktar(t,
		symlink("x", outside), file("x", "replaced", 0o644),
		symlink("y", outside), hardlink("y", "x"),
	)), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(outside); string(b) != "original" {
		t.Fatalf("wrote through a symlink: %q", b)
	}
	_, root, _ := e.store.Resolve(context.Background(), tmpl.Digest)
	for _, n := range []string{"x", "y"} {
		if b, err := os.ReadFile(filepath.Join(root, n)); err != nil || string(b) != "replaced" {
			t.Fatalf("%s = %q %v", n, b, err)
		}
	}
}

func TestImportDirPolicies(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "bin"), 0o755))
	must(os.WriteFile(filepath.Join(src, "bin/suid"), []byte("x"), 0o755))
	must(os.Chmod(filepath.Join(src, "bin/suid"), 0o4755|os.ModeSetuid))
	must(unix.Chmod(filepath.Join(src, "bin/suid"), 0o4755))
	must(os.WriteFile(filepath.Join(src, "bin/a"), []byte("aaa"), 0o644))
	must(os.Link(filepath.Join(src, "bin/a"), filepath.Join(src, "bin/b")))
	must(os.Symlink("/etc/passwd", filepath.Join(src, "passwd"))) // kept as a link, not followed
	must(unix.Mknod(filepath.Join(src, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(unix.Mkfifo(filepath.Join(src, "fifo"), 0o600))
	must(os.Chown(filepath.Join(src, "bin/a"), 42, 43))
	tmpl, err := e.store.ImportDir(context.Background(), src, ImportOptions{Tags: []string{"d:1"}, MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.Source != "dir" || tmpl.SizeBytes != 4 {
		t.Errorf("template %+v", tmpl)
	}
	_, root, _ := e.store.Resolve(context.Background(), "d:1")
	if m := stat(t, filepath.Join(root, "bin/suid")).Mode; m&0o7777 != 0o755 {
		t.Errorf("setuid kept: %o", m&0o7777)
	}
	a, b := stat(t, filepath.Join(root, "bin/a")), stat(t, filepath.Join(root, "bin/b"))
	if a.Ino != b.Ino || a.Uid != 42 || a.Gid != 43 {
		t.Errorf("hard link/ownership: a %+v b %+v", a.Ino, b.Ino)
	}
	if tgt, _ := os.Readlink(filepath.Join(root, "passwd")); tgt != "/etc/passwd" {
		t.Errorf("symlink target %q", tgt)
	}
	if _, err := os.Lstat(filepath.Join(root, "null")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("device node copied: %v", err)
	}
	if m := stat(t, filepath.Join(root, "fifo")).Mode; m&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("fifo not kept: %o", m)
	}
	if _, err := e.store.ImportDir(context.Background(), src, ImportOptions{MaxBytes: 1000}); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Errorf("MaxBytes on dir import: %v", err)
	}
	if _, err := e.store.ImportDir(context.Background(), filepath.Join(src, "nope"), ImportOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing source: %v", err)
	}
	if _, err := e.store.ImportDir(context.Background(), filepath.Join(src, "bin/a"), ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("file as source: %v", err)
	}
	e.assertClean(t, 1)
}

func TestTagsAndResolve(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	t1, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t, file("f", "1", 0o644))), ImportOptions{Tags: []string{"app:v1", "app"}})
	if err != nil {
		t.Fatal(err)
	}
	t2, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t, file("f", "2", 0o644))), ImportOptions{Parent: "app:v1", Source: "snapshot"})
	if err != nil {
		t.Fatal(err)
	}
	if t2.Parent != t1.Digest || t2.Source != "snapshot" {
		t.Errorf("parent/source: %+v", t2)
	}
	for _, ref := range []string{"app", "app:latest", "app:v1", t1.Digest, t1.Digest[:7+12]} {
		got, err := e.store.Get(ctx, ref)
		if err != nil || got.Digest != t1.Digest {
			t.Errorf("Get(%q) = %s, %v", ref, got.Digest, err)
		}
	}
	// Moving a tag.
	if err := e.store.Tag(ctx, t2.Digest, "app"); err != nil {
		t.Fatal(err)
	}
	if got, _ := e.store.Get(ctx, "app"); got.Digest != t2.Digest {
		t.Errorf("tag not moved: %s", got.Digest)
	}
	if got, _ := e.store.Get(ctx, t1.Digest); strings.Join(got.Tags, ",") != "app:v1" {
		t.Errorf("t1 tags after move: %v", got.Tags)
	}
	if err := e.store.Untag(ctx, "app:v1"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.Get(ctx, "app:v1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("after untag: %v", err)
	}
	// The content stays addressable by digest.
	if _, _, err := e.store.Resolve(ctx, t1.Digest); err != nil {
		t.Errorf("untagged template gone: %v", err)
	}
	if err := e.store.Untag(ctx, "app:v1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("second untag: %v", err)
	}
	list, err := e.store.List(ctx)
	if err != nil || len(list) != 2 || list[0].Digest != t1.Digest || len(list[0].Tags) != 0 {
		t.Fatalf("List = %+v %v", list, err)
	}

	for _, bad := range []string{"", "App", "-x", "a b", "a:", "a:" + strings.Repeat("t", 129), "a:t/x", "sha256:xyz",
		"sha256", "sha256:" + strings.Repeat("a", 11), "a:b:c", strings.Repeat("n", 129)} {
		if _, err := e.store.Get(ctx, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Get(%q): %v, want invalid argument", bad, err)
		}
	}
	for _, bad := range []string{"Bad", "sha256:latest", "x:a b"} {
		if err := e.store.Tag(ctx, t1.Digest, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Tag(%q): %v", bad, err)
		}
		if _, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t)), ImportOptions{Tags: []string{bad}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("import tag %q: %v", bad, err)
		}
	}
	for _, missing := range []string{"nope", "nope:v1", "sha256:" + strings.Repeat("0", 64), "sha256:" + strings.Repeat("0", 12)} {
		if _, _, err := e.store.Resolve(ctx, missing); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Resolve(%q): %v", missing, err)
		}
	}
	if err := e.store.Tag(ctx, "nope", "x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Tag of missing ref: %v", err)
	}
	if _, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t)), ImportOptions{Parent: "nope"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing parent: %v", err)
	}
	for in, want := range map[string]string{"a": "a:latest", "a.b-c_d:V1.0_x-y": "a.b-c_d:V1.0_x-y", "0:0": "0:0"} {
		if got, err := ParseTag(in); err != nil || got != want {
			t.Errorf("ParseTag(%q) = %q, %v", in, got, err)
		}
	}
}

func TestOpenRemovesCrashLeftovers(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	kept, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t, file("f", "keep", 0o644))), ImportOptions{Tags: []string{"kept"}})
	if err != nil {
		t.Fatal(err)
	}
	gone, err := e.store.ImportTar(ctx, bytes.NewReader(mktar(t, file("f", "gone", 0o644))), ImportOptions{Tags: []string{"gone"}})
	if err != nil {
		t.Fatal(err)
	}
	// Simulate crashes: an interrupted import, a rename without a record,
	// a record whose content vanished.
	junk := filepath.Join(e.dir, "tmp", "import-123", "rootfs", "usr")
	os.MkdirAll(junk, 0o755)
	orphan := filepath.Join(e.dir, strings.Repeat("ab", 32), "rootfs")
	os.MkdirAll(orphan, 0o755)
	os.RemoveAll(filepath.Join(e.dir, strings.TrimPrefix(gone.Digest, "sha256:")))

	// While another Store holds the directory, nothing is collected.
	second := e.open(t)
	if _, err := os.Stat(junk); err != nil {
		t.Fatalf("junk removed while another store was open: %v", err)
	}
	second.Close()
	e.store.Close()

	e.store = e.open(t)
	if _, err := os.Stat(filepath.Join(e.dir, "tmp", "import-123")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("interrupted import not removed: %v", err)
	}
	if _, err := os.Stat(filepath.Dir(orphan)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("unrecorded content not removed: %v", err)
	}
	if _, err := e.store.Get(ctx, "gone"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("template without content still listed: %v", err)
	}
	if _, _, err := e.store.Resolve(ctx, "kept"); err != nil {
		t.Errorf("good template lost: %v", err)
	}
	e.assertClean(t, 1)
	_ = kept
}

// TestEnsureBase imports the cached debootstrap base (see TestBuildBase)
// into a fresh store from several goroutines at once: they share one import.
func TestEnsureBase(t *testing.T) {
	baseRoot := testenv.BaseRootfs(t)
	e := newEnv(t)
	var logs bytes.Buffer
	var logMu sync.Mutex
	s, err := Open(e.db.SQL(), filepath.Join(filepath.Dir(e.dir), "templates2"), testenv.CacheDir(),
		slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
			logMu.Lock()
			defer logMu.Unlock()
			return logs.Write(p)
		}), nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	// A caller that gives up cancels the shared run when it was the only
	// one waiting: nothing is imported and nothing is left behind.
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err = s.EnsureBase(short, nil)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("EnsureBase with a 300ms deadline: %v", err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		junk, _ := os.ReadDir(filepath.Join(s.Dir(), "tmp"))
		if len(junk) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("cancelled base import still running or left junk: %v", junk)
		}
	}
	if l, _ := s.List(context.Background()); len(l) != 0 {
		t.Fatalf("cancelled EnsureBase imported %+v", l)
	}

	start := time.Now()
	const callers = 3
	var wg sync.WaitGroup
	results := make([]api.Template, callers)
	errs := make([]error, callers)
	var progressMu sync.Mutex
	phases := map[string]int{}
	for i := 0; i < callers; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			results[i], errs[i] = s.EnsureBase(context.Background(), func(p Progress) {
				progressMu.Lock()
				phases[p.Phase]++
				progressMu.Unlock()
			})
		}(i)
	}
	wg.Wait()
	t.Logf("EnsureBase (import of %s) took %s; progress events %v", baseRoot, time.Since(start), phases)
	for i := range results {
		if errs[i] != nil {
			t.Fatalf("caller %d: %v", i, errs[i])
		}
		if results[i].Digest != results[0].Digest {
			t.Fatalf("callers disagree: %s vs %s", results[i].Digest, results[0].Digest)
		}
	}
	tmpl := results[0]
	if tmpl.Source != "debootstrap:bookworm" || strings.Join(tmpl.Tags, ",") != BaseTag || tmpl.SizeBytes < 100<<20 {
		t.Fatalf("base template %+v", tmpl)
	}
	if n := strings.Count(logs.String(), "template imported"); n != 1 {
		t.Fatalf("%d imports, want exactly 1 shared import:\n%s", n, logs.String())
	}
	if phases[PhaseImport] == 0 {
		t.Errorf("no import progress reported")
	}
	_, root, err := s.Resolve(context.Background(), BaseTag)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"usr/bin/python3", "usr/bin/git", "etc/ssl/certs/ca-certificates.crt"} {
		if _, err := os.Stat(filepath.Join(root, f)); err != nil {
			t.Error(err)
		}
	}
	if _, err := os.Lstat(filepath.Join(root, "dev/null")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("base template carries device nodes: %v", err)
	}
	if m := stat(t, filepath.Join(root, "usr/bin/passwd")).Mode; m&0o6000 != 0 {
		t.Errorf("setuid passwd in template: %o", m)
	}
	if m := stat(t, filepath.Join(root, "tmp")).Mode; m&0o7777 != 0o1777 {
		t.Errorf("/tmp mode %o", m&0o7777)
	}
	// Second call: already there, no work.
	again, err := s.EnsureBase(context.Background(), nil)
	if err != nil || again.Digest != tmpl.Digest {
		t.Fatalf("second EnsureBase: %+v %v", again, err)
	}
	// Re-importing the same cache dir dedups to the same digest.
	re, err := s.ImportDir(context.Background(), baseRoot, ImportOptions{})
	if err != nil || re.Digest != tmpl.Digest {
		t.Fatalf("re-import: %s %v (want %s)", re.Digest, err, tmpl.Digest)
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
