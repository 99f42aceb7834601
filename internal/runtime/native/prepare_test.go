package native

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/testenv"
)

// TestPrepareAndForgetTemplate: PrepareTemplate builds the shifted copy
// that Create would, ForgetTemplate removes it (idempotently) unless a
// sandbox records it as its root, and a start that holds the copy keeps
// ForgetTemplate waiting.
func TestPrepareAndForgetTemplate(t *testing.T) {
	testenv.RequireRoot(t)
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "etc/f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := &Runtime{cfg: runtime.Config{DataDir: t.TempDir()}}
	ctx := context.Background()
	const digest = "sha256:tree1"
	copyDir := filepath.Join(r.rootfsBase(), "sha256-tree1")
	var pr runtime.TemplatePreparer = r
	if err := pr.PrepareTemplate(ctx, digest, src); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(copyDir, "etc/f"), &st); err != nil || st.Uid != hostIDBase {
		t.Fatalf("prepared copy: uid %d, %v", st.Uid, err)
	}
	if err := pr.PrepareTemplate(ctx, digest, src); err != nil {
		t.Fatalf("second prepare: %v", err)
	}
	if err := pr.PrepareTemplate(ctx, "sha256:../x", src); err == nil {
		t.Fatal("prepare accepted a digest with ..")
	}

	// A sandbox recording the copy as its root blocks forgetting it.
	inst, err := r.newInstance(runtime.Spec{ID: "sb-user", TemplateDigest: digest})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(inst.dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := inst.recordTemplate(); err != nil {
		t.Fatal(err)
	}
	if err := pr.ForgetTemplate(ctx, digest); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("forget a template in use: %v, want ErrConflict", err)
	}
	if _, err := os.Stat(copyDir); err != nil {
		t.Fatalf("copy gone after a refused forget: %v", err)
	}
	os.RemoveAll(inst.dir)

	// A starting sandbox's hold makes Forget wait for it.
	path, release, err := r.acquireRootfs(ctx, src, digest)
	if err != nil || path != copyDir {
		t.Fatalf("acquire: %q %v", path, err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	err = pr.ForgetTemplate(short, digest)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("forget while held: %v, want to wait", err)
	}
	done := make(chan error, 1)
	go func() { done <- pr.ForgetTemplate(ctx, digest) }()
	time.Sleep(50 * time.Millisecond)
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(copyDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("copy still there after forget: %v", err)
	}
	ents, _ := os.ReadDir(r.rootfsBase())
	if len(ents) != 0 {
		t.Fatalf("rootfs dir not empty after forget: %v", ents)
	}
	if err := pr.ForgetTemplate(ctx, digest); err != nil {
		t.Fatalf("second forget: %v", err)
	}
	// A later start builds it again on demand.
	path, release, err = r.acquireRootfs(ctx, src, digest)
	if err != nil {
		t.Fatal(err)
	}
	release()
	if _, err := os.Stat(filepath.Join(path, "etc/f")); err != nil {
		t.Fatal(err)
	}
}

// TestShiftReusesParentCopy: the copy of a tree that shares inodes with an
// earlier copy's tree (a derived template) hard-links those files instead
// of copying them, never through a symlink of either tree, and copies
// what changed.
func TestShiftReusesParentCopy(t *testing.T) {
	testenv.RequireRoot(t)
	store := t.TempDir()
	parent := filepath.Join(store, "p")
	child := filepath.Join(store, "c")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(parent, "bin"), 0o755))
	must(os.MkdirAll(filepath.Join(parent, "real"), 0o755))
	must(os.WriteFile(filepath.Join(parent, "bin/tool"), []byte("tool"), 0o755))
	must(os.WriteFile(filepath.Join(parent, "etc-conf"), []byte("old"), 0o644))
	must(os.WriteFile(filepath.Join(parent, "real/f"), []byte("via symlink"), 0o644))
	must(os.Symlink("real", filepath.Join(parent, "x")))
	// The child: the parent cloned by hard links (as Derive does), one
	// file replaced, and x a real directory holding the parent's real/f
	// (and real/ gone), so that only a lookup through the parent's
	// symlink x could match it.
	must(os.MkdirAll(filepath.Join(child, "bin"), 0o755))
	must(os.MkdirAll(filepath.Join(child, "x"), 0o755))
	must(os.Link(filepath.Join(parent, "bin/tool"), filepath.Join(child, "bin/tool")))
	must(os.Link(filepath.Join(parent, "real/f"), filepath.Join(child, "x/f")))
	must(os.WriteFile(filepath.Join(child, "etc-conf"), []byte("new"), 0o644))

	r := &Runtime{cfg: runtime.Config{DataDir: t.TempDir()}}
	ctx := context.Background()
	pc, err := r.ensureShiftedRootfs(ctx, parent, "sha256:parent")
	must(err)
	cc, err := r.ensureShiftedRootfs(ctx, child, "sha256:child")
	must(err)
	ino := func(p string) (uint64, uint32) {
		t.Helper()
		var st unix.Stat_t
		must(unix.Lstat(p, &st))
		return st.Ino, st.Uid
	}
	pi, _ := ino(filepath.Join(pc, "bin/tool"))
	ci, uid := ino(filepath.Join(cc, "bin/tool"))
	if pi != ci || uid != hostIDBase {
		t.Errorf("bin/tool: child copy inode %d uid %d, parent copy inode %d: want the same inode", ci, uid, pi)
	}
	// x/f is the parent's real/f, but the parent's x is a symlink.
	if a, _ := ino(filepath.Join(pc, "real/f")); a == func() uint64 { i, _ := ino(filepath.Join(cc, "x/f")); return i }() {
		t.Error("x/f was linked through the parent's symlink x")
	}
	if b, err := os.ReadFile(filepath.Join(cc, "x/f")); err != nil || string(b) != "via symlink" {
		t.Errorf("x/f: %q %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(cc, "etc-conf")); err != nil || string(b) != "new" {
		t.Errorf("changed file: %q %v", b, err)
	}
	if a, _ := ino(filepath.Join(pc, "etc-conf")); a == func() uint64 { i, _ := ino(filepath.Join(cc, "etc-conf")); return i }() {
		t.Error("a changed file shares the parent copy's inode")
	}
	// Forgetting the parent keeps the child's files.
	must(r.ForgetTemplate(ctx, "sha256:parent"))
	if b, err := os.ReadFile(filepath.Join(cc, "bin/tool")); err != nil || string(b) != "tool" {
		t.Errorf("child's linked file after the parent was forgotten: %q %v", b, err)
	}
	if _, err := os.Stat(srcRecord(r.rootfsBase(), "sha256-parent")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("source record of a forgotten copy: %v", err)
	}
}
