package template

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
)

// TestBuildBase runs debootstrap for real into testenv.CacheDir() (it reuses
// a complete earlier build). It needs root and the Debian mirror, and takes
// minutes the first time.
func TestBuildBase(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := exec.LookPath("debootstrap")
	testenv.Require(t, "debootstrap", err == nil, "debootstrap not installed")

	start := time.Now()
	var last Progress
	phases := map[string]int{}
	rootfs, err := BuildBase(context.Background(), testenv.CacheDir(), func(p Progress) {
		phases[p.Phase]++
		if p.Phase != last.Phase || p.Done%25 == 0 {
			t.Logf("%s %d/%d %s", p.Phase, p.Done, p.Total, p.Message)
		}
		last = p
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("BuildBase took %s; phases: %v", time.Since(start), phases)
	if want := filepath.Join(testenv.CacheDir(), "base-bookworm", "rootfs"); rootfs != want {
		t.Fatalf("rootfs = %q, want %q", rootfs, want)
	}
	if fi, err := os.Stat(filepath.Join(testenv.CacheDir(), "base-bookworm")); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("base-bookworm must be root-only (0700): %v %v", fi.Mode(), err)
	}
	if _, err := os.Stat(filepath.Join(testenv.CacheDir(), "base-bookworm", "complete")); err != nil {
		t.Fatalf("complete marker: %v", err)
	}
	for _, f := range []string{"usr/bin/python3", "usr/bin/curl", "usr/bin/git", "usr/bin/ps", "etc/ssl/certs/ca-certificates.crt", "bin/sh"} {
		if _, err := os.Stat(filepath.Join(rootfs, f)); err != nil {
			t.Errorf("base rootfs lacks %s: %v", f, err)
		}
	}
	fi, err := os.Lstat(filepath.Join(rootfs, "tmp"))
	if err != nil || fi.Mode()&os.ModeSticky == 0 || fi.Mode().Perm() != 0o777 {
		t.Errorf("/tmp mode = %v, %v; want 1777", fi.Mode(), err)
	}
	if fi, err := os.Lstat(filepath.Join(rootfs, "etc/resolv.conf")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("/etc/resolv.conf not a regular file: %v", err)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "etc/hostname")); err != nil {
		t.Error(err)
	}
	debs, _ := filepath.Glob(filepath.Join(rootfs, "var/cache/apt/archives/*.deb"))
	lists, _ := filepath.Glob(filepath.Join(rootfs, "var/lib/apt/lists/*Packages*"))
	if len(debs)+len(lists) != 0 {
		t.Errorf("apt caches not cleaned: %d debs, %d lists", len(debs), len(lists))
	}
}
