package hostfs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
)

func TestMkdirSandboxConflict(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "sandboxes", "sb1")
	if err := MkdirSandbox(dir, "sb1"); err != nil {
		t.Fatal(err)
	}
	if err := MkdirSandbox(dir, "sb1"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second MkdirSandbox: %v, want ErrConflict", err)
	}
}

// TestRemoveSandboxRefusesLiveMounts: what is mounted below a sandbox's
// directory survives a RemoveSandbox, which removes nothing until it is
// unmounted.
func TestRemoveSandboxRefusesLiveMounts(t *testing.T) {
	testenv.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "sb2")
	mnt := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	keep := filepath.Join(mnt, "template-file")
	if err := os.WriteFile(keep, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := RemoveSandbox(dir, "sb2"); err == nil {
		t.Fatal("RemoveSandbox removed a directory with a live mount below it")
	}
	if _, err := os.Stat(keep); err != nil {
		t.Fatalf("a file on the mount is gone: %v", err)
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	if err := RemoveSandbox(dir, "sb2"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("directory still there: %v", err)
	}
}
