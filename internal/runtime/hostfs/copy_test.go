package hostfs

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// TestCopySparse: holes stay holes (the copy allocates about what the
// source does), data is copied, the destination must not exist, and
// anything but a regular file is refused without following or waiting.
func TestCopySparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	chunks := map[int64][]byte{0: []byte("head"), 10 << 20: bytes.Repeat([]byte("x"), 300<<10), size - 4: []byte("tail")}
	for off, b := range chunks {
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	dst := filepath.Join(dir, "dst")
	if err := CopySparse(src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(a, b) {
		t.Fatalf("copy differs (%v)", err)
	}
	var sst, dst2 unix.Stat_t
	if err := unix.Stat(src, &sst); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(dst, &dst2); err != nil {
		t.Fatal(err)
	}
	if dst2.Size != size {
		t.Errorf("copy size %d, want %d", dst2.Size, size)
	}
	// A clone shares the source's blocks; a sparse copy allocates what
	// the source has allocated (give or take a filesystem block per
	// extent). A dense copy would be all 64 MiB.
	if used := dst2.Blocks * 512; used > sst.Blocks*512+1<<20 {
		t.Errorf("copy of a sparse %d MiB file (%d bytes allocated) allocates %d bytes", size>>20, sst.Blocks*512, used)
	}
	if fi, _ := os.Stat(dst); fi.Mode().Perm() != 0o600 {
		t.Errorf("copy mode %v", fi.Mode())
	}
	if err := CopySparse(src, dst); err == nil {
		t.Fatal("copy over an existing file succeeded")
	}
	if err := CopySparse(filepath.Join(dir, "none"), filepath.Join(dir, "x")); err == nil {
		t.Fatal("copy of a missing file succeeded")
	}
	if _, err := os.Stat(filepath.Join(dir, "x")); !os.IsNotExist(err) {
		t.Fatal("failed copy left its destination")
	}

	link := filepath.Join(dir, "link")
	if err := os.Symlink(src, link); err != nil {
		t.Fatal(err)
	}
	if err := CopySparse(link, filepath.Join(dir, "from-link")); !errors.Is(err, unix.ELOOP) {
		t.Errorf("copy of a symlink: %v, want ELOOP", err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	// Without O_NONBLOCK this would hang: nobody writes the FIFO.
	if err := CopySparse(fifo, filepath.Join(dir, "from-fifo")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("copy of a FIFO: %v, want invalid argument", err)
	}
	if err := CopySparse(dir, filepath.Join(dir, "from-dir")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("copy of a directory: %v, want invalid argument", err)
	}
	for _, n := range []string{"from-link", "from-fifo", "from-dir"} {
		if _, err := os.Lstat(filepath.Join(dir, n)); !os.IsNotExist(err) {
			t.Errorf("refused copy left %s", n)
		}
	}
}
