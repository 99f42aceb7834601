package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// DefaultMkfsErofs is the erofs-utils image builder scripts/setup.sh installs.
const DefaultMkfsErofs = "mkfs.erofs"

// DefaultImageBuildTimeout bounds one mkfs.erofs run. The Debian base tree
// takes seconds (docs/microvm.md); a tree that takes minutes is either huge
// or a stuck builder, and either way must not hold the image lock forever.
const DefaultImageBuildTimeout = 5 * time.Minute

// Images derives and caches read-only erofs root images, one per template
// tree digest, in Dir (the runtime's DataDir/images). Template trees are
// immutable, so an image, once renamed into place, never changes; a guest
// mounts it read-only as the lower layer of its root overlay.
//
// Modes, times, symlinks, hard links, device nodes and xattrs are kept as
// they are in the tree; owners are shifted by confine.IDBase. Inside the
// guest the sandbox runs in a user namespace whose root is guest uid
// IDBase (package vminit), so a file the template gives to root must be
// IDBase's in the image for the sandbox to see it as root's. The shift is
// made by building from a read-only id-mapped mount of the tree (host id N
// → IDBase+N for N < confine.IDSize); the tree on disk is not touched. Ids
// ≥ IDSize in the tree have no mapping and land in the image as the
// overflow id (65534, nobody) — Debian's trees use none.
type Images struct {
	Dir string
	// AgentBinary is space-agent: started in a new user namespace (its
	// hold stage), it makes the namespace of the id-mapped mount. Required.
	AgentBinary string
	// Mkfs is the mkfs.erofs binary; DefaultMkfsErofs when empty.
	Mkfs string
	// Timeout bounds one build; DefaultImageBuildTimeout when zero.
	Timeout time.Duration

	builds atomic.Int64 // mkfs runs that produced an image, for tests
}

// imageSuffix names the image format: ".v2" has owners shifted by IDBase;
// an unshifted image of an older build (".erofs") is never reused.
const imageSuffix = ".v2.erofs"

var imageNameRE = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,200}$`)

// imageName turns a tree digest into a file name ("sha256:ab…" →
// "sha256-ab…"), refusing anything that could leave Dir.
func imageName(treeDigest string) (string, error) {
	if !imageNameRE.MatchString(treeDigest) || strings.Contains(treeDigest, "..") || strings.HasPrefix(treeDigest, ".") {
		return "", fmt.Errorf("tree digest %q is not a valid name: %w", treeDigest, errdefs.ErrInvalidArgument)
	}
	return strings.ReplaceAll(treeDigest, ":", "-"), nil
}

// Path is where the image of treeDigest lives (whether or not it exists).
func (im *Images) Path(treeDigest string) (string, error) {
	name, err := imageName(treeDigest)
	if err != nil {
		return "", err
	}
	return filepath.Join(im.Dir, name+imageSuffix), nil
}

// Prepare returns the image of the tree rootfs, whose digest is treeDigest,
// building it first if it does not exist. The image is written to a
// temporary file and renamed into place under an exclusive flock, so
// concurrent Prepares (in this process or another) build it once and nobody
// ever sees a partial image. Idempotent.
func (im *Images) Prepare(ctx context.Context, treeDigest, rootfs string) (string, error) {
	dst, err := im.Path(treeDigest)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(dst); err == nil {
		return dst, nil
	}
	fi, err := os.Stat(rootfs)
	if err != nil {
		return "", fmt.Errorf("microvm: image of %s: %w", treeDigest, err)
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("microvm: image of %s: %s is not a directory: %w", treeDigest, rootfs, errdefs.ErrInvalidArgument)
	}
	unlock, err := im.lock(ctx, dst)
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(dst); err == nil {
		return dst, nil // built by someone else while we waited
	}
	// A build that died with its process (crash, SIGKILL) left its temp
	// file; under the lock nobody else builds this image, so drop them.
	stale, _ := filepath.Glob(filepath.Join(im.Dir, ".tmp-"+filepath.Base(dst)+"-*"))
	for _, f := range stale {
		os.Remove(f)
	}
	// And its id-mapped mount, if it died before unmounting.
	mnts, _ := filepath.Glob(filepath.Join(im.Dir, ".mnt-"+filepath.Base(dst)+"-*"))
	for _, m := range mnts {
		_ = unix.Unmount(m, unix.MNT_DETACH)
		os.Remove(m)
	}
	tmp, err := os.CreateTemp(im.Dir, ".tmp-"+filepath.Base(dst)+"-")
	if err != nil {
		return "", err
	}
	tmp.Close()
	defer os.Remove(tmp.Name()) // a no-op after the rename
	if err := im.buildShifted(ctx, tmp.Name(), rootfs, dst); err != nil {
		return "", fmt.Errorf("microvm: image of %s: %w", treeDigest, err)
	}
	// The image is shared read-only by every guest of the template.
	if err := os.Chmod(tmp.Name(), 0o444); err != nil {
		return "", err
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", err
	}
	im.builds.Add(1)
	return dst, nil
}

// Forget removes the image of treeDigest, if any. A guest that runs on it
// keeps its open file (QEMU holds the descriptor), so there is nothing to
// refuse here, unlike native's shared lower directories. Idempotent.
func (im *Images) Forget(ctx context.Context, treeDigest string) error {
	dst, err := im.Path(treeDigest)
	if err != nil {
		return err
	}
	if _, err := os.Stat(im.Dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	unlock, err := im.lock(ctx, dst)
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.Remove(dst); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("microvm: forget image of %s: %w", treeDigest, err)
	}
	// The lock file goes with the image; lock re-checks the inode it holds,
	// so a Prepare waiting on this one locks a fresh file instead.
	if err := os.Remove(lockPath(dst)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("microvm: forget image of %s: %w", treeDigest, err)
	}
	return nil
}

func lockPath(image string) string {
	return filepath.Join(filepath.Dir(image), "."+filepath.Base(image)+".lock")
}

// lock takes the exclusive flock of image's lock file, waiting as long as
// ctx allows. Forget removes the lock file, so after locking it checks that
// the file it holds is still the one at the path.
func (im *Images) lock(ctx context.Context, image string) (unlock func(), err error) {
	if err := os.MkdirAll(im.Dir, 0o700); err != nil {
		return nil, err
	}
	path := lockPath(image)
	for {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, err
		}
		if err := flockContext(ctx, f); err != nil {
			f.Close()
			return nil, fmt.Errorf("microvm: lock image %s: %w", filepath.Base(image), err)
		}
		var held, cur unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Lstat(path, &cur) == nil && held.Dev == cur.Dev && held.Ino == cur.Ino {
			return func() {
				unix.Flock(int(f.Fd()), unix.LOCK_UN)
				f.Close()
			}, nil
		}
		f.Close() // removed while we waited: lock the current one
	}
}

// flockContext takes an exclusive flock, polling so that ctx can end the
// wait (a blocking flock cannot be interrupted).
func flockContext(ctx context.Context, f *os.File) error {
	delay := time.Millisecond
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay = min(2*delay, 50*time.Millisecond)
	}
}

// mkfsArgs are the mkfs.erofs (erofs-utils 1.5) options:
//   - -zlz4: the guest kernel has EROFS_FS_ZIP with LZ4 built in; lz4 is
//     fast to build and to read (lz4hc builds several times slower).
//   - --preserve-mtime: keep every file's mtime, not the build time.
//   - no --all-root/--force-uid: real (shifted) owners are the point.
//   - -x left at its default: xattrs (user.*, security.capability, ACLs) are
//     kept; device nodes, fifos and sockets are kept as inodes.
var mkfsArgs = []string{"-zlz4", "--preserve-mtime", "--quiet"}

// buildShifted writes into image the erofs of rootfs as seen through a
// read-only id-mapped mount (host 0 → IDBase), which it always unmounts.
// The mount point is named after dst so that the next build of the same
// image, under the same lock, finds one a crash left behind.
func (im *Images) buildShifted(ctx context.Context, image, rootfs, dst string) error {
	if im.AgentBinary == "" {
		return fmt.Errorf("no agent binary for the id-mapped mount: %w", errdefs.ErrInvalidArgument)
	}
	userns, err := hostfs.OpenUserns([]string{im.AgentBinary, hostfs.HoldArg}, []string{},
		hostfs.IDMap{HostID: confine.IDBase, Size: confine.IDSize})
	if err != nil {
		return err
	}
	defer unix.Close(userns)
	mnt, err := os.MkdirTemp(im.Dir, ".mnt-"+filepath.Base(dst)+"-")
	if err != nil {
		return err
	}
	defer os.Remove(mnt)
	if err := hostfs.MountIDMapped(rootfs, mnt, userns); err != nil {
		return err
	}
	// Lazily: mkfs may be killed by the timeout with files still open.
	defer unix.Unmount(mnt, unix.MNT_DETACH)
	return im.mkfs(ctx, image, mnt)
}

// mkfs runs mkfs.erofs into image (which it overwrites) from rootfs, bounded
// by the build timeout, and returns its stderr in the error.
func (im *Images) mkfs(ctx context.Context, image, rootfs string) error {
	bin := im.Mkfs
	if bin == "" {
		bin = DefaultMkfsErofs
	}
	timeout := im.Timeout
	if timeout <= 0 {
		timeout = DefaultImageBuildTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	args := append(append([]string{}, mkfsArgs...), image, rootfs)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"}
	var stderr bytes.Buffer
	cmd.Stdout = &stderr // --quiet: anything on stdout is a diagnostic too
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second
	start := time.Now()
	err := cmd.Run()
	if err == nil {
		return nil
	}
	msg := strings.TrimSpace(stderr.String())
	if len(msg) > 2048 {
		msg = "…" + msg[len(msg)-2048:]
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%s %s did not finish within %s (%w): %s", bin, rootfs, time.Since(start).Round(time.Millisecond), ctx.Err(), msg)
	}
	return fmt.Errorf("%s %s: %w: %s", bin, rootfs, err, msg)
}
