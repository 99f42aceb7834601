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
