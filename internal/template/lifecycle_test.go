package template

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// mergedUsr is a small tree shaped like Debian's: /bin -> usr/bin.
func mergedUsr(t *testing.T, e *env) api.Template {
	t.Helper()
	tpl, err := e.store.ImportTar(context.Background(), bytes.NewReader(mktar(t,
		dir("usr/", 0o755), dir("usr/bin/", 0o755), file("usr/bin/tool", "v1", 0o755),
		symlink("bin", "usr/bin"), dir("etc/", 0o755), file("etc/hostname", "box", 0o644),
		dir("opt/", 0o755), dir("opt/keep/", 0o755), file("opt/keep/a", "a", 0o644), file("opt/keep/b", "b", 0o644),
	)), ImportOptions{Tags: []string{"mini"}})
	if err != nil {
		t.Fatal(err)
	}
	return tpl
}

func TestDeriveConfigOnlySharesTheTree(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := mergedUsr(t, e)
	cfg := api.TemplateConfig{Env: map[string]string{"A": "1"}, Workdir: "/opt"}
	c, err := e.store.Derive(ctx, p.Digest, DeriveOptions{Config: cfg, Layer: api.TemplateLayer{CreatedBy: "ENV A=1"}})
	if err != nil {
		t.Fatal(err)
	}
	if c.TreeDigest != p.TreeDigest || c.Digest == p.Digest || c.Parent != p.Digest {
		t.Fatalf("child %+v of %+v", c, p)
	}
	if c.Config.Env["A"] != "1" || len(c.Layers) != 1 || c.Layers[0].Digest != c.Digest {
		t.Fatalf("child config/layers: %+v", c)
	}
	// Same tree + same config = same digest (dedup), and a bad config is refused.
	again, err := e.store.Derive(ctx, p.Digest, DeriveOptions{Config: cfg})
	if err != nil || again.Digest != c.Digest {
		t.Fatalf("again: %v %v", again.Digest, err)
	}
	if _, err := e.store.Derive(ctx, p.Digest, DeriveOptions{Config: api.TemplateConfig{Workdir: "rel"}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("relative workdir: %v", err)
	}
}

func TestDeriveAppliesChangesWithoutTouchingParent(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := mergedUsr(t, e)
	_, proot, _ := e.store.Resolve(ctx, p.Digest)

	// A fake overlay upper: a changed file, a new dir, a whiteout, an opaque dir.
	up := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	const base = 100000000
	must(os.MkdirAll(filepath.Join(up, "usr/bin"), 0o755))
	must(os.WriteFile(filepath.Join(up, "usr/bin/tool"), []byte("v2"), 0o755))
	must(os.Lchown(filepath.Join(up, "usr/bin/tool"), base+0, base+0))
	must(os.MkdirAll(filepath.Join(up, "srv/app"), 0o750))
	must(os.WriteFile(filepath.Join(up, "srv/app/f"), []byte("x"), 0o600))
	must(os.Lchown(filepath.Join(up, "srv/app/f"), base+1000, base+1000))
	must(unix.Lsetxattr(filepath.Join(up, "srv/app/f"), "user.kept", []byte("v"), 0))
	must(unix.Lsetxattr(filepath.Join(up, "srv/app"), "user.dirattr", []byte("d"), 0))
	must(unix.Lsetxattr(filepath.Join(up, "srv/app"), "user.overlay.redirect", []byte("/etc"), 0))
	must(os.MkdirAll(filepath.Join(up, "etc"), 0o755))
	must(unix.Mknod(filepath.Join(up, "etc/hostname"), unix.S_IFCHR, 0)) // a whiteout: a 0/0 character device
	must(os.MkdirAll(filepath.Join(up, "opt/keep"), 0o755))
	must(unix.Lsetxattr(filepath.Join(up, "opt/keep"), "trusted.overlay.opaque", []byte("y"), 0))
	must(os.WriteFile(filepath.Join(up, "opt/keep/new"), []byte("n"), 0o644))

	c, err := e.store.Derive(ctx, p.Digest, DeriveOptions{Layer: api.TemplateLayer{CreatedBy: "RUN x"},
		Apply: func(ctx context.Context, tr *Tree) error {
			return tr.ApplyUpperDir(ctx, Upper{Dir: up, OpaqueXattr: "trusted.overlay.opaque", IDBase: base})
		}})
	if err != nil {
		t.Fatal(err)
	}
	_, root, _ := e.store.Resolve(ctx, c.Digest)
	if b, _ := os.ReadFile(filepath.Join(root, "usr/bin/tool")); string(b) != "v2" {
		t.Errorf("tool = %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(proot, "usr/bin/tool")); string(b) != "v1" {
		t.Errorf("parent's tool changed to %q", b)
	}
	if st := stat(t, filepath.Join(root, "srv/app/f")); st.Uid != 1000 || st.Mode&0o777 != 0o600 {
		t.Errorf("srv/app/f uid %d mode %o", st.Uid, st.Mode&0o777)
	}
	xv := func(p, name string) string {
		b := make([]byte, 64)
		n, err := unix.Lgetxattr(p, name, b)
		if err != nil {
			return ""
		}
		return string(b[:n])
	}
	if xv(filepath.Join(root, "srv/app/f"), "user.kept") != "v" || xv(filepath.Join(root, "srv/app"), "user.dirattr") != "d" {
		t.Error("user.* xattrs of the changes were not kept")
	}
	if xv(filepath.Join(root, "srv/app"), "user.overlay.redirect") != "" {
		t.Error("user.overlay.* must never reach a template")
	}
	if _, err := os.Lstat(filepath.Join(root, "etc/hostname")); !os.IsNotExist(err) {
		t.Errorf("whiteout did not delete etc/hostname: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(proot, "etc/hostname")); err != nil {
		t.Errorf("parent lost etc/hostname: %v", err)
	}
	names, _ := os.ReadDir(filepath.Join(root, "opt/keep"))
	if len(names) != 1 || names[0].Name() != "new" {
		t.Errorf("opaque opt/keep = %v", names)
	}
	// Unchanged files share storage with the parent.
	if st := stat(t, filepath.Join(root, "etc")); st.Nlink == 0 {
		t.Fatal("etc missing")
	}
	if a, b := stat(t, filepath.Join(root, "opt")), stat(t, filepath.Join(proot, "opt")); a.Ino == b.Ino {
		t.Error("directories must be copies, not shared")
	}

	// The digest is the content's: the same tree imported from a tar matches.
	var buf bytes.Buffer
	if err := e.store.Export(ctx, c.Digest, &buf); err != nil {
		t.Fatal(err)
	}
	other := newEnv(t)
	got, err := other.store.ImportArchive(ctx, bytes.NewReader(buf.Bytes()), ImportOptions{Tags: []string{"moved:1"}})
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != c.Digest || got.TreeDigest != c.TreeDigest || got.Parent != p.Digest || len(got.Layers) != 1 {
		t.Fatalf("archive round trip: %+v vs %+v", got, c)
	}
	// A config-only child of a tree with xattrs keeps the tree, and a no-op
	// change re-derives the same tree (the clone keeps directory xattrs).
	same, err := e.store.Derive(ctx, c.Digest, DeriveOptions{Apply: func(context.Context, *Tree) error { return nil }})
	if err != nil || same.TreeDigest != c.TreeDigest {
		t.Fatalf("no-op derive changed the tree: %v %v", same.TreeDigest, err)
	}
}

func TestArchiveImportRejectsTamperingAndLeavesNothing(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := mergedUsr(t, e)
	var buf bytes.Buffer
	if err := e.store.Export(ctx, p.Digest, &buf); err != nil {
		t.Fatal(err)
	}
	good := buf.Bytes()
	other := newEnv(t)
	tampered := bytes.Replace(good, []byte("box"), []byte("bot"), 1)
	_, err := other.store.ImportArchive(ctx, bytes.NewReader(tampered), ImportOptions{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "digest mismatch") {
		t.Fatalf("tampered: %v", err)
	}
	_, err = other.store.ImportArchive(ctx, bytes.NewReader(good[:len(good)/2]), ImportOptions{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("truncated: %v", err)
	}
	_, err = other.store.ImportArchive(ctx, bytes.NewReader(mktar(t, file("etc/x", "x", 0o644))), ImportOptions{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "not a template archive") {
		t.Fatalf("plain tar: %v", err)
	}
	other.assertClean(t, 0)
}

func TestGCKeepsWhatIsNeededAndReportsBytes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := mergedUsr(t, e)
	big := strings.Repeat("z", 1<<20)
	derive := func(parent, name string) api.Template {
		t.Helper()
		c, err := e.store.Derive(ctx, parent, DeriveOptions{Apply: func(ctx context.Context, tr *Tree) error {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, name), []byte(big+name), 0o644); err != nil {
				return err
			}
			return tr.CopyIn(ctx, filepath.Join(dir, name), "/bin/", CopyOptions{})
		}})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	a := derive(p.Digest, "a")    // untagged, no users: garbage
	b := derive(p.Digest, "b")    // used by a sandbox
	c1 := derive(p.Digest, "c1")  // parent of a tagged template
	c2 := derive(c1.Digest, "c2") // tagged
	if err := e.store.Tag(ctx, c2.Digest, "keep:1"); err != nil {
		t.Fatal(err)
	}
	_, root, _ := e.store.Resolve(ctx, b.Digest)
	if _, err := os.Stat(filepath.Join(root, "usr/bin/b")); err != nil {
		t.Fatalf("COPY into /bin/ must follow the in-tree symlink to usr/bin: %v", err)
	}
	// Remove of a tagged or used template is refused; of a tag keeps content.
	if err := e.store.Remove(ctx, c2.Digest, false, nil); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("remove tagged: %v", err)
	}
	if err := e.store.Remove(ctx, b.Digest, false, map[string]bool{b.Digest: true}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("remove used: %v", err)
	}
	var forgot []string
	res, err := e.store.GC(ctx, map[string]bool{b.Digest: true}, func(_ context.Context, tree string) error {
		forgot = append(forgot, tree)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Removed) != 1 || res.Removed[0] != a.Digest || res.Trees != 1 || len(forgot) != 1 {
		t.Fatalf("gc: %+v forgot %v", res, forgot)
	}
	// Only a's own file (1 MiB) and its directories are freed, not the shared files.
	if res.BytesFreed < 1<<20 || res.BytesFreed > 1<<20+256<<10 {
		t.Errorf("bytes freed %d, want about 1 MiB", res.BytesFreed)
	}
	for _, d := range []string{p.Digest, b.Digest, c1.Digest, c2.Digest} {
		if _, _, err := e.store.Resolve(ctx, d); err != nil {
			t.Errorf("gc removed live %s: %v", d, err)
		}
	}
	// A held template survives; untagging makes the chain collectable.
	release := e.store.Hold(c2.Digest)
	if err := e.store.Remove(ctx, "keep:1", false, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.store.Remove(ctx, "mini", false, nil); err != nil {
		t.Fatal(err)
	}
	if res, _ := e.store.GC(ctx, nil, nil); len(res.Removed) != 1 { // b only
		t.Fatalf("gc with hold: %+v", res)
	}
	release()
	res, err = e.store.GC(ctx, nil, nil)
	if err != nil || len(res.Removed) != 3 {
		t.Fatalf("final gc: %+v %v", res, err)
	}
	e.assertClean(t, 0)
}

// A derived tree reuses the parent's file hashes only for the very same
// inodes: a changed file is hashed again, so the digest stays the content's.
func TestDeriveReusesHashesOnlyForSharedInodes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := mergedUsr(t, e)
	pdir := filepath.Dir(filepath.Join(e.dir, strings.TrimPrefix(p.TreeDigest, "sha256:"), "rootfs"))
	sums := readSums(pdir)
	if len(sums) == 0 || sums["etc/hostname"] == "" {
		t.Fatalf("import wrote no sums: %v", sums)
	}
	// Poison the parent's recorded hash of a file the child replaces, and of
	// one it keeps: only the kept one may be trusted (same inode).
	sums["usr/bin/tool"] = strings.Repeat("0", 64)
	if err := writeSums(pdir, sums); err != nil {
		t.Fatal(err)
	}
	up := t.TempDir()
	os.MkdirAll(filepath.Join(up, "usr/bin"), 0o755)
	os.WriteFile(filepath.Join(up, "usr/bin/tool"), []byte("v2"), 0o755)
	c, err := e.store.Derive(ctx, p.Digest, DeriveOptions{Apply: func(ctx context.Context, tr *Tree) error {
		return tr.ApplyUpperDir(ctx, Upper{Dir: up})
	}})
	if err != nil {
		t.Fatal(err)
	}
	_, root, _ := e.store.Resolve(ctx, c.Digest)
	want, _, _, err := treeDigest(root, nil) // from scratch, no reuse
	if err != nil {
		t.Fatal(err)
	}
	if c.TreeDigest != want {
		t.Fatalf("derived digest %s, from scratch %s", c.TreeDigest, want)
	}
	// And reuse is really in effect: a poisoned hash of a kept (shared)
	// file does flow into the child's digest.
	sums["etc/hostname"] = strings.Repeat("1", 64)
	writeSums(pdir, sums)
	os.WriteFile(filepath.Join(up, "usr/bin/tool"), []byte("v3"), 0o755)
	c2, err := e.store.Derive(ctx, p.Digest, DeriveOptions{Apply: func(ctx context.Context, tr *Tree) error {
		return tr.ApplyUpperDir(ctx, Upper{Dir: up})
	}})
	if err != nil {
		t.Fatal(err)
	}
	_, root2, _ := e.store.Resolve(ctx, c2.Digest)
	if scratch, _, _, _ := treeDigest(root2, nil); scratch == c2.TreeDigest {
		t.Fatal("the parent's recorded hashes were not reused")
	}
}
