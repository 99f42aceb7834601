package native

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/testenv"
)

func TestDiskPool(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	p := newDiskPool(filepath.Join(dir, "pool"))
	dst := filepath.Join(dir, "a.img")
	if _, ok := p.take(16, dst); ok {
		t.Fatal("empty pool gave an image")
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(p.images(16)) < p.depth {
		if time.Now().After(deadline) {
			t.Fatalf("pool holds %d images after 30s, want %d", len(p.images(16)), p.depth)
		}
		time.Sleep(10 * time.Millisecond)
	}
	mfd, ok := p.take(16, dst)
	if !ok {
		t.Fatal("full pool gave no image")
	}
	if mfd < 0 {
		t.Fatal("spare came without its mount")
	}
	// Spares are in no mount table until attached.
	if m, _ := hostfs.MountsUnder(dir); len(m) != 0 {
		t.Fatalf("pool left mounts in the table: %v", m)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := attachMount(mfd, mnt); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(mnt, "upper")); err != nil || !fi.IsDir() {
		t.Fatalf("spare has no upper/: %v", err)
	}
	// A pooled image is a complete, mountable ext4 of the asked size.
	if fi, err := os.Stat(dst); err != nil || fi.Size() != 16<<20 {
		t.Fatalf("taken image: %v %v", fi, err)
	}
	if err := hostfs.UnmountAll(mnt); err != nil {
		t.Fatal(err)
	}
	if len(p.images(32)) != 0 {
		t.Fatal("pool formatted a size nobody asked for")
	}
	// A half-formatted image from a crash is removed by clean; complete
	// ones stay for reuse.
	crash := filepath.Join(p.dir, ".tmp-16-dead.img")
	if err := os.WriteFile(crash, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.clean(false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(crash); !os.IsNotExist(err) {
		t.Fatalf("clean left %s", crash)
	}
	if err := p.close(); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(p.dir); len(ents) != 0 {
		t.Fatalf("close left %d entries", len(ents))
	}
	// After close the pool only formats on demand.
	if _, ok := p.take(16, filepath.Join(dir, "b.img")); ok {
		t.Fatal("closed pool gave an image")
	}
}

func TestIsMountPoint(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	if hostfs.IsMountPoint(dir) {
		t.Fatalf("%s is not a mount point", dir)
	}
	if !hostfs.IsMountPoint("/proc") {
		t.Fatal("/proc is a mount point")
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(dir, 0)
	if !hostfs.IsMountPoint(dir) {
		t.Fatalf("bind-mounted %s is a mount point", dir)
	}
	if hostfs.IsMountPoint(filepath.Join(dir, "missing")) {
		t.Fatal("a missing path is no mount point")
	}
}
