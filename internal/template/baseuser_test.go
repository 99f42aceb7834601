package template

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/spacehq/space/internal/testenv"
)

// TestEnsureBaseUser: the account is added once, an existing "user" entry
// that differs is replaced, other entries and the databases' modes and
// owners are kept, a second run changes nothing, and an id taken by
// another name is an error.
func TestEnsureBaseUser(t *testing.T) {
	testenv.RequireRoot(t)
	root := t.TempDir()
	write := func(rel, content string, mode os.FileMode, gid int) {
		p := filepath.Join(root, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode)
		os.Chown(p, 0, gid)
	}
	write("etc/passwd", "root:x:0:0:root:/root:/bin/bash\nuser:x:1001:1001::/nowhere:/bin/sh\n", 0o644, 0)
	write("etc/group", "root:x:0:\n", 0o644, 0)
	write("etc/shadow", "root:*:19000:0:99999:7:::\n", 0o640, 42)
	write("etc/gshadow", "root:*::\n", 0o640, 42)
	write("etc/skel/.bashrc", "# bashrc\n", 0o644, 0)

	if ok, err := ensureBaseUser(root, false); err != nil || ok {
		t.Fatalf("dry run on a root without the account: ok=%v err=%v", ok, err)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "etc/passwd")); !strings.Contains(string(b), "1001") {
		t.Fatal("the dry run changed /etc/passwd")
	}
	if _, err := ensureBaseUser(root, true); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"etc/passwd":  "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
		"etc/group":   "root:x:0:\nuser:x:1000:\n",
		"etc/shadow":  "root:*:19000:0:99999:7:::\nuser:!::0:99999:7:::\n",
		"etc/gshadow": "root:*::\nuser:!::\n",
	}
	for f, w := range want {
		b, _ := os.ReadFile(filepath.Join(root, f))
		if string(b) != w {
			t.Errorf("%s = %q, want %q", f, b, w)
		}
	}
	fi, _ := os.Stat(filepath.Join(root, "etc/shadow"))
	if st := fi.Sys().(*syscall.Stat_t); fi.Mode().Perm() != 0o640 || st.Gid != 42 {
		t.Errorf("shadow is now %v gid %d", fi.Mode(), st.Gid)
	}
	for _, p := range []string{"home/user", "home/user/.bashrc"} {
		fi, err := os.Lstat(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 1000 || st.Gid != 1000 {
			t.Errorf("%s owned by %d:%d", p, st.Uid, st.Gid)
		}
		if p == "home/user" && fi.Mode().Perm() != 0o755 {
			t.Errorf("home mode %v", fi.Mode())
		}
	}
	if ok, err := ensureBaseUser(root, false); err != nil || !ok {
		t.Fatalf("after applying, the dry run says ok=%v err=%v", ok, err)
	}
	before, _ := os.Stat(filepath.Join(root, "etc/passwd"))
	if _, err := ensureBaseUser(root, true); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.Stat(filepath.Join(root, "etc/passwd")); !os.SameFile(before, after) {
		t.Error("a second run rewrote /etc/passwd")
	}
	// A home with the wrong owner is fixed.
	os.Chown(filepath.Join(root, "home/user"), 0, 0)
	if ok, _ := ensureBaseUser(root, false); ok {
		t.Fatal("a root-owned home passes")
	}
	ensureBaseUser(root, true)
	if ok, _ := ensureBaseUser(root, false); !ok {
		t.Fatal("home owner not fixed")
	}

	other := t.TempDir()
	os.MkdirAll(filepath.Join(other, "etc"), 0o755)
	os.WriteFile(filepath.Join(other, "etc/passwd"), []byte("alice:x:1000:1000::/home/alice:/bin/sh\n"), 0o644)
	if _, err := ensureBaseUser(other, true); err == nil || !strings.Contains(err.Error(), `belongs to "alice"`) {
		t.Fatalf("uid 1000 taken: %v", err)
	}
}

// TestBuildBaseAddsUserToCachedRootfs: a cached base built before the
// account existed gets it from BuildBase, without a rebuild.
func TestBuildBaseAddsUserToCachedRootfs(t *testing.T) {
	testenv.RequireRoot(t)
	cache := t.TempDir()
	rootfs := filepath.Join(cache, baseCacheDir, "rootfs")
	os.MkdirAll(filepath.Join(rootfs, "etc"), 0o755)
	for _, f := range []string{"passwd", "group", "shadow"} {
		os.WriteFile(filepath.Join(rootfs, "etc", f), []byte("root:x:0:0:root:/root:/bin/bash\n"), 0o644)
	}
	os.WriteFile(filepath.Join(cache, baseCacheDir, completeMarker), []byte("old\n"), 0o644)
	got, err := BuildBase(context.Background(), cache, nil)
	if err != nil || got != rootfs {
		t.Fatalf("BuildBase: %q %v", got, err)
	}
	if ok, err := ensureBaseUser(rootfs, false); !ok || err != nil {
		t.Fatalf("cached base has no account after BuildBase: %v %v", ok, err)
	}
}
