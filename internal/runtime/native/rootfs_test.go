package native

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/testenv"
)

func TestShiftedRootfsCopy(t *testing.T) {
	testenv.RequireRoot(t)
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "usr/bin"), 0o755))
	must(os.WriteFile(filepath.Join(src, "usr/bin/su"), []byte("suid"), 0o755))
	must(os.Chmod(filepath.Join(src, "usr/bin/su"), 0o4755|os.ModeSetuid))
	must(unix.Chmod(filepath.Join(src, "usr/bin/su"), 0o4755))
	must(os.Link(filepath.Join(src, "usr/bin/su"), filepath.Join(src, "usr/bin/su-hardlink")))
	must(os.Symlink("usr/bin", filepath.Join(src, "bin")))
	must(os.WriteFile(filepath.Join(src, "owned"), []byte("x"), 0o600))
	must(os.Lchown(filepath.Join(src, "owned"), 1000, 1000))
	must(os.WriteFile(filepath.Join(src, "alien"), []byte("x"), 0o600))
	must(os.Lchown(filepath.Join(src, "alien"), 70000, 0))
	must(unix.Mknod(filepath.Join(src, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(os.Mkdir(filepath.Join(src, "tmp"), 0o777))
	must(unix.Chmod(filepath.Join(src, "tmp"), 0o1777))

	r := &Runtime{cfg: runtime.Config{DataDir: t.TempDir()}}
	// Concurrent creates of one digest build it once and agree on the path.
	var wg sync.WaitGroup
	paths := make([]string, 4)
	errs := make([]error, 4)
	for i := range paths {
		wg.Add(1)
		go func() {
			defer wg.Done()
			paths[i], errs[i] = r.ensureShiftedRootfs(context.Background(), src, "sha256:abc")
		}()
	}
	wg.Wait()
	for i := range paths {
		if errs[i] != nil || paths[i] != paths[0] {
			t.Fatalf("concurrent shift %d: %q, %v", i, paths[i], errs[i])
		}
	}
	dst := paths[0]
	if filepath.Base(dst) != "sha256-abc" {
		t.Fatalf("rootfs dir %s", dst)
	}
	ents, _ := os.ReadDir(filepath.Dir(dst))
	for _, e := range ents {
		if e.IsDir() && e.Name() != "sha256-abc" {
			t.Fatalf("leftover %s in rootfs dir", e.Name())
		}
	}
	stat := func(p string) unix.Stat_t {
		t.Helper()
		var st unix.Stat_t
		must(unix.Lstat(filepath.Join(dst, p), &st))
		return st
	}
	if st := stat("usr/bin/su"); st.Uid != hostIDBase || st.Mode&0o7777 != 0o4755 {
		t.Fatalf("su: uid %d mode %o", st.Uid, st.Mode&0o7777)
	}
	if a, b := stat("usr/bin/su"), stat("usr/bin/su-hardlink"); a.Ino != b.Ino {
		t.Fatal("hard link not preserved")
	}
	if st := stat("bin"); st.Mode&unix.S_IFMT != unix.S_IFLNK || st.Uid != hostIDBase {
		t.Fatalf("symlink: mode %o uid %d", st.Mode, st.Uid)
	}
	if st := stat("owned"); st.Uid != hostIDBase+1000 || st.Gid != hostIDBase+1000 {
		t.Fatalf("owned: %d:%d", st.Uid, st.Gid)
	}
	if st := stat("alien"); st.Uid != hostIDBase+65534 {
		t.Fatalf("unmappable owner became %d, want nobody", st.Uid)
	}
	if st := stat("tmp"); st.Mode&0o7777 != 0o1777 {
		t.Fatalf("tmp mode %o", st.Mode&0o7777)
	}
	if _, err := os.Lstat(filepath.Join(dst, "null")); !os.IsNotExist(err) {
		t.Fatalf("device node copied: %v", err)
	}
	if _, err := r.ensureShiftedRootfs(context.Background(), src, "sha256:a,lowerdir=/"); err == nil {
		t.Fatal("digest with overlay option syntax accepted")
	}
}
