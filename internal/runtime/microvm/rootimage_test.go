package microvm

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/testenv"
)

// requireMkfsErofs skips (locally) or fails (in CI, where setup installs
// erofs-utils) without mkfs.erofs.
func requireMkfsErofs(t *testing.T) {
	t.Helper()
	_, err := exec.LookPath(DefaultMkfsErofs)
	testenv.Require(t, "erofs-utils", err == nil, "install erofs-utils (scripts/setup.sh)")
}

// hostMountsErofs reports whether this kernel can mount erofs (built in or
// already loaded; tests do not load modules).
func hostMountsErofs() bool {
	b, err := os.ReadFile("/proc/filesystems")
	return err == nil && bytes.Contains(b, []byte("\terofs\n"))
}

// makeTree builds a small tree with the things an image must keep: modes,
// owners (shifted), mtimes, a symlink, a hard link, a device node and a
// user xattr; and a file owned by an id the shift does not map.
func makeTree(t *testing.T) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "tree")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "etc", "sub"), 0o755))
	must(os.Mkdir(filepath.Join(root, "tmp"), 0o755))
	must(unix.Chmod(filepath.Join(root, "tmp"), 0o1777))
	must(os.WriteFile(filepath.Join(root, "etc", "secret"), []byte("top secret\n"), 0o600))
	must(os.Chown(filepath.Join(root, "etc", "secret"), 1000, 1001))
	must(os.WriteFile(filepath.Join(root, "etc", "tool"), bytes.Repeat([]byte("tool body "), 10000), 0o755))
	must(unix.Chmod(filepath.Join(root, "etc", "tool"), 0o4755)) // setuid survives
	must(os.Link(filepath.Join(root, "etc", "secret"), filepath.Join(root, "etc", "sub", "hard")))
	must(os.Symlink("../secret", filepath.Join(root, "etc", "sub", "link")))
	must(unix.Lchown(filepath.Join(root, "etc", "sub", "link"), 7, 8))
	must(unix.Mknod(filepath.Join(root, "etc", "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(unix.Chmod(filepath.Join(root, "etc", "null"), 0o666)) // past the umask
	must(unix.Setxattr(filepath.Join(root, "etc", "tool"), "user.space.test", []byte("kept"), 0))
	must(os.WriteFile(filepath.Join(root, "etc", "far"), nil, 0o644))
	must(os.Chown(filepath.Join(root, "etc", "far"), 70000, 70000))
	old := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	must(os.Chtimes(filepath.Join(root, "etc", "tool"), old, old))
	return root
}

func TestImagesPrepareForget(t *testing.T) {
	testenv.RequireRoot(t) // real owners and device nodes in the test tree
	requireMkfsErofs(t)
	tree := makeTree(t)
	im := &Images{Dir: filepath.Join(t.TempDir(), "images"), AgentBinary: testenv.AgentBinary(t)}
	const digest = "sha256:0123456789abcdef"
	ctx := context.Background()

	// Concurrent prepares build once and agree on the path.
	var wg sync.WaitGroup
	paths := make([]string, 3)
	errs := make([]error, 3)
	for i := range paths {
		wg.Add(1)
		go func() {
			defer wg.Done()
			paths[i], errs[i] = im.Prepare(ctx, digest, tree)
		}()
	}
	wg.Wait()
	for i := range paths {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if paths[i] != paths[0] {
			t.Fatalf("prepares disagree: %q vs %q", paths[i], paths[0])
		}
	}
	img := paths[0]
	if want := filepath.Join(im.Dir, "sha256-0123456789abcdef.v2.erofs"); img != want {
		t.Fatalf("image at %q, want %q", img, want)
	}
	var before unix.Stat_t
	if err := unix.Stat(img, &before); err != nil {
		t.Fatal(err)
	}
	if again, err := im.Prepare(ctx, digest, tree); err != nil || again != img {
		t.Fatalf("second prepare: %q, %v", again, err)
	}
	var after unix.Stat_t
	if err := unix.Stat(img, &after); err != nil {
		t.Fatal(err)
	}
	if n := im.builds.Load(); n != 1 || before.Ino != after.Ino {
		t.Fatalf("built %d times (inode %d → %d), want once", n, before.Ino, after.Ino)
	}
	if before.Mode&0o777 != 0o444 {
		t.Errorf("image mode %o, want 0444", before.Mode&0o777)
	}
	for _, pat := range []string{".tmp-*", ".mnt-*"} {
		if left, _ := filepath.Glob(filepath.Join(im.Dir, pat)); len(left) != 0 {
			t.Errorf("temp files left: %v", left)
		}
	}
	if mnts, err := hostfs.MountsUnder(im.Dir); err != nil || len(mnts) != 0 {
		t.Errorf("mounts left under the image dir: %v %v", mnts, err)
	}

	// erofs-utils' view always; the kernel's too when this host mounts erofs
	// (CI hosts may not).
	verifyDumped(t, img)
	if hostMountsErofs() {
		verifyMounted(t, img)
	}

	if err := im.Forget(ctx, digest); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("image after Forget: %v", err)
	}
	if left, _ := os.ReadDir(im.Dir); len(left) != 0 {
		t.Errorf("Forget left %v", left)
	}
	if err := im.Forget(ctx, digest); err != nil {
		t.Fatalf("second Forget: %v", err)
	}
	// Forgotten images are built again.
	if _, err := im.Prepare(ctx, digest, tree); err != nil || im.builds.Load() != 2 {
		t.Fatalf("prepare after forget: %v, builds %d", err, im.builds.Load())
	}
}

// verifyMounted loop-mounts the image read-only and checks the tree in it.
func verifyMounted(t *testing.T, img string) {
	t.Helper()
	mnt := t.TempDir()
	if out, err := exec.Command("mount", "-t", "erofs", "-o", "ro,loop,nodev,nosuid", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount erofs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount: %v", err)
		}
	})
	p := func(s string) string { return filepath.Join(mnt, s) }
	st := func(s string) unix.Stat_t {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(p(s), &st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	if b, err := os.ReadFile(p("etc/secret")); err != nil || string(b) != "top secret\n" {
		t.Errorf("etc/secret = %q, %v", b, err)
	}
	if b, err := os.ReadFile(p("etc/tool")); err != nil || !bytes.Equal(b, bytes.Repeat([]byte("tool body "), 10000)) {
		t.Errorf("etc/tool: %d bytes, %v", len(b), err)
	}
	sec := st("etc/secret")
	if sec.Mode != unix.S_IFREG|0o600 || sec.Uid != confine.IDBase+1000 || sec.Gid != confine.IDBase+1001 || sec.Nlink != 2 {
		t.Errorf("etc/secret mode %o owner %d:%d nlink %d", sec.Mode, sec.Uid, sec.Gid, sec.Nlink)
	}
	if hard := st("etc/sub/hard"); hard.Ino != sec.Ino {
		t.Errorf("hard link is inode %d, secret %d", hard.Ino, sec.Ino)
	}
	tool := st("etc/tool")
	if tool.Mode != unix.S_IFREG|0o4755 || tool.Mtim.Sec != time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC).Unix() {
		t.Errorf("etc/tool mode %o mtime %d", tool.Mode, tool.Mtim.Sec)
	}
	if tmp := st("tmp"); tmp.Mode != unix.S_IFDIR|0o1777 {
		t.Errorf("tmp mode %o", tmp.Mode)
	}
	if link, err := os.Readlink(p("etc/sub/link")); err != nil || link != "../secret" {
		t.Errorf("link → %q, %v", link, err)
	}
	if l := st("etc/sub/link"); l.Uid != confine.IDBase+7 || l.Gid != confine.IDBase+8 {
		t.Errorf("link owner %d:%d", l.Uid, l.Gid)
	}
	if r := st("etc"); r.Uid != confine.IDBase || r.Gid != confine.IDBase {
		t.Errorf("root-owned etc is %d:%d in the image, want IDBase", r.Uid, r.Gid)
	}
	// Outside the mapped range: the overflow id, not the tree's.
	if f := st("etc/far"); f.Uid != 65534 || f.Gid != 65534 {
		t.Errorf("etc/far owner %d:%d, want the overflow id 65534", f.Uid, f.Gid)
	}
	if null := st("etc/null"); null.Mode != unix.S_IFCHR|0o666 || null.Rdev != unix.Mkdev(1, 3) {
		t.Errorf("etc/null mode %o rdev %x", null.Mode, null.Rdev)
	}
	buf := make([]byte, 64)
	if n, err := unix.Lgetxattr(p("etc/tool"), "user.space.test", buf); err != nil || string(buf[:n]) != "kept" {
		t.Errorf("xattr = %q, %v", buf[:max(n, 0)], err)
	}
	if err := os.WriteFile(p("etc/new"), nil, 0o644); err == nil {
		t.Error("wrote into a read-only erofs mount")
	}
}

// verifyDumped checks the image with erofs-utils alone (no kernel erofs
// needed): dump.erofs for inodes, fsck.erofs --extract for contents. The
// extraction of erofs-utils 1.5 does not keep hard links, so those are
// checked by inode number in the dump.
func verifyDumped(t *testing.T, img string) {
	t.Helper()
	dump := func(path string) string {
		t.Helper()
		b, err := exec.Command("dump.erofs", "--path="+path, img).CombinedOutput()
		if err != nil {
			t.Fatalf("dump.erofs --path=%s: %v: %s", path, err, b)
		}
		return string(b)
	}
	nid := func(out string) string {
		f := strings.Fields(out[strings.Index(out, "NID:"):])
		return f[1]
	}
	sec, hard := dump("/etc/secret"), dump("/etc/sub/hard")
	for _, want := range []string{"Links: 2", "Uid: 100001000   Gid: 100001001", "Access: 0600/"} {
		if !strings.Contains(sec, want) {
			t.Errorf("dump of /etc/secret lacks %q:\n%s", want, sec)
		}
	}
	if !strings.Contains(sec, "NID:") || !strings.Contains(hard, "NID:") || nid(sec) != nid(hard) {
		t.Errorf("hard link is not the same inode:\n%s\n%s", sec, hard)
	}
	// dump.erofs 1.5 prints only the permission bits (setuid is checked on
	// the mount); the xattr must take room in the inode.
	if tool := dump("/etc/tool"); !strings.Contains(tool, "Access: 0755/") || strings.Contains(tool, "Xattr size: 0\n") {
		t.Errorf("dump of /etc/tool:\n%s", tool)
	}
	if link := dump("/etc/sub/link"); !strings.Contains(link, "Uid: 100000007   Gid: 100000008") {
		t.Errorf("dump of /etc/sub/link:\n%s", link)
	}
	out := filepath.Join(t.TempDir(), "x")
	if b, err := exec.Command("fsck.erofs", "--extract="+out, img).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs: %v: %s", err, b)
	}
	if b, err := os.ReadFile(filepath.Join(out, "etc/secret")); err != nil || string(b) != "top secret\n" {
		t.Errorf("extracted etc/secret = %q, %v", b, err)
	}
	if link, err := os.Readlink(filepath.Join(out, "etc/sub/link")); err != nil || link != "../secret" {
		t.Errorf("link → %q, %v", link, err)
	}
}

// TestImagesLockWaitAndStaleTemp: a Prepare waiting for another's lock
// gives up with its context, and a temp file left by a build that died is
// removed by the next build.
func TestImagesLockWaitAndStaleTemp(t *testing.T) {
	testenv.RequireRoot(t) // the build's id-mapped mount
	requireMkfsErofs(t)
	im := &Images{Dir: t.TempDir(), AgentBinary: testenv.AgentBinary(t)}
	img, err := im.Path("sha256:bb")
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := im.lock(context.Background(), img)
	if err != nil {
		t.Fatal(err)
	}
	tree := t.TempDir()
	if err := os.WriteFile(filepath.Join(tree, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := im.Prepare(ctx, "sha256:bb", tree); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Prepare while locked: %v, want deadline exceeded", err)
	}
	unlock()

	stale := filepath.Join(im.Dir, ".tmp-sha256-bb.v2.erofs-123")
	if err := os.WriteFile(stale, []byte("half an image"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A build that died also left its id-mapped mount attached.
	staleMnt := filepath.Join(im.Dir, ".mnt-sha256-bb.v2.erofs-123")
	if err := os.Mkdir(staleMnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", staleMnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(staleMnt, unix.MNT_DETACH) })
	if _, err := im.Prepare(context.Background(), "sha256:bb", tree); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale temp file kept: %v", err)
	}
	if _, err := os.Stat(staleMnt); !errors.Is(err, os.ErrNotExist) || hostfs.IsMountPoint(staleMnt) {
		t.Errorf("stale mount kept: %v", err)
	}
}

func TestImagesRefuse(t *testing.T) {
	im := &Images{Dir: t.TempDir()}
	ctx := context.Background()
	for _, d := range []string{"", "..", "../x", "a/b", ".hidden", "sha256:ab/../../x", strings.Repeat("a", 201)} {
		if _, err := im.Prepare(ctx, d, t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Prepare(%q): %v, want ErrInvalidArgument", d, err)
		}
		if err := im.Forget(ctx, d); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Forget(%q): %v, want ErrInvalidArgument", d, err)
		}
	}
	f := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := im.Prepare(ctx, "sha256:aa", f); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Prepare of a file: %v", err)
	}
	// Without the agent there is no shift: refuse rather than build an
	// image whose root files the sandbox would not own.
	if _, err := im.Prepare(ctx, "sha256:aa", t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Prepare without AgentBinary: %v", err)
	}
}

// TestImagesMkfsFailureAndTimeout: mkfs.erofs's own message reaches the
// error, and a builder that hangs is ended by the timeout without leaving
// an image or a temp file behind.
func TestImagesMkfsFailureAndTimeout(t *testing.T) {
	testenv.RequireRoot(t) // the build's id-mapped mount
	agent := testenv.AgentBinary(t)
	dir := t.TempDir()
	fail := filepath.Join(dir, "mkfs-fail")
	hang := filepath.Join(dir, "mkfs-hang")
	if err := os.WriteFile(fail, []byte("#!/bin/sh\necho 'bad tree: boom' >&2\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(hang, []byte("#!/bin/sh\nexec sleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	tree := t.TempDir()
	ctx := context.Background()

	im := &Images{Dir: filepath.Join(dir, "images"), Mkfs: fail, AgentBinary: agent}
	_, err := im.Prepare(ctx, "sha256:aa", tree)
	if err == nil || !strings.Contains(err.Error(), "bad tree: boom") {
		t.Fatalf("failed mkfs: %v, want its stderr", err)
	}

	im = &Images{Dir: filepath.Join(dir, "images"), Mkfs: hang, Timeout: 300 * time.Millisecond, AgentBinary: agent}
	start := time.Now()
	_, err = im.Prepare(ctx, "sha256:aa", tree)
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 10*time.Second {
		t.Fatalf("hung mkfs: %v after %s", err, time.Since(start))
	}
	for _, pat := range []string{"*.erofs", ".tmp-*", ".mnt-*"} {
		if left, _ := filepath.Glob(filepath.Join(im.Dir, pat)); len(left) != 0 {
			t.Errorf("left behind: %v", left)
		}
	}
}

// TestImageOfBaseRootfs builds the image of the real Debian base tree once
// and logs the time and size (docs/microvm.md quotes them).
func TestImageOfBaseRootfs(t *testing.T) {
	if testing.Short() {
		t.Skip("builds an image of the whole base tree")
	}
	testenv.RequireRoot(t)
	requireMkfsErofs(t)
	base := testenv.BaseRootfs(t)
	im := &Images{Dir: t.TempDir(), AgentBinary: testenv.AgentBinary(t)}
	start := time.Now()
	img, err := im.Prepare(context.Background(), "sha256:base", base)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("base rootfs image: %.1f MiB in %s", float64(fi.Size())/(1<<20), time.Since(start).Round(time.Millisecond))
	if hostMountsErofs() {
		mnt := t.TempDir()
		if out, err := exec.Command("mount", "-t", "erofs", "-o", "ro,loop,nodev,nosuid", img, mnt).CombinedOutput(); err != nil {
			t.Fatalf("mount erofs: %v: %s", err, out)
		}
		defer unix.Unmount(mnt, 0)
		if _, err := os.Stat(filepath.Join(mnt, "bin", "sh")); err != nil {
			t.Errorf("base image has no /bin/sh: %v", err)
		}
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(mnt, "etc", "passwd"), &st); err != nil || st.Uid != confine.IDBase {
			t.Errorf("base image /etc/passwd owner %d (%v), want IDBase", st.Uid, err)
		}
	}
}
