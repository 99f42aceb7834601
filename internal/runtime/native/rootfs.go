package native

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/confine"
)

// Sandbox ids 0..idRange-1 map to host ids hostIDBase.. in every sandbox.
const (
	hostIDBase = confine.IDBase
	idRange    = confine.IDSize
)

// shiftID maps a template owner into the sandbox's host id range; an owner
// the sandbox cannot represent becomes its nobody.
func shiftID(id uint32) int {
	if id >= idRange {
		id = 65534
	}
	return hostIDBase + int(id)
}

var digestRE = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,200}$`)

// rootfsName turns a template digest into a directory name that is also
// safe inside an overlay mount option (no ':' or ',').
func rootfsName(digest string) (string, error) {
	if !digestRE.MatchString(digest) || strings.Contains(digest, "..") {
		return "", fmt.Errorf("template digest %q is not a valid name", digest)
	}
	return strings.ReplaceAll(digest, ":", "-"), nil
}

func (r *Runtime) rootfsBase() string { return filepath.Join(r.cfg.DataDir, "rootfs") }

// ensureShiftedRootfs returns DataDir/rootfs/<digest>, a copy of src whose
// owners are shifted into the sandbox id range, building it once. The copy
// is built in a temporary directory and renamed into place, under a file
// lock so concurrent creates (in this process or another) build it once.
func (r *Runtime) ensureShiftedRootfs(ctx context.Context, src, digest string) (string, error) {
	name, err := rootfsName(digest)
	if err != nil {
		return "", err
	}
	base := r.rootfsBase()
	dst := filepath.Join(base, name)
	if _, err := os.Stat(dst); err == nil {
		return dst, nil
	}
	unlock, err := r.lockRootfs(ctx, name, unix.LOCK_EX)
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(dst); err == nil {
		return dst, nil
	}
	tmp, err := os.MkdirTemp(base, ".tmp-"+name+"-")
	if err != nil {
		return "", err
	}
	reuse := r.newReuser(name)
	defer reuse.close()
	if err := copyShifted(ctx, src, tmp, reuse); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("shift template %s: %w", digest, err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		os.RemoveAll(tmp)
		return "", err
	}
	// Remember the source, so later copies of trees that share its inodes
	// can link rather than copy (reuser). Best effort.
	_ = os.WriteFile(srcRecord(base, name), []byte(src), 0o600)
	if r.log != nil {
		r.log.Debug("template shifted", "digest", digest, "linked_files", reuse.linked)
	}
	return dst, nil
}

// acquireRootfs is ensureShiftedRootfs for a sandbox that is about to use
// the copy: it also returns a shared hold on it that keeps ForgetTemplate
// from removing it until release, i.e. until the sandbox's overlay holds
// the layer.
func (r *Runtime) acquireRootfs(ctx context.Context, src, digest string) (path string, release func(), err error) {
	name, err := rootfsName(digest)
	if err != nil {
		return "", nil, err
	}
	for attempt := 0; attempt < 3; attempt++ {
		dst, err := r.ensureShiftedRootfs(ctx, src, digest)
		if err != nil {
			return "", nil, err
		}
		unlock, err := r.lockRootfs(ctx, name, unix.LOCK_SH)
		if err != nil {
			return "", nil, err
		}
		if _, err := os.Stat(dst); err == nil {
			return dst, unlock, nil
		}
		unlock() // forgotten between the build and the hold: build again
	}
	return "", nil, fmt.Errorf("template %s was removed three times while a sandbox was starting on it: %w", digest, errdefs.ErrConflict)
}

// lockRootfs flocks the lock file of the copy name: LOCK_EX to build or
// remove the copy, LOCK_SH to keep it while a sandbox starts on it. The
// lock file goes away with the copy (ForgetTemplate), so after locking it
// checks that the file it holds is still the one at the path.
func (r *Runtime) lockRootfs(ctx context.Context, name string, how int) (unlock func(), err error) {
	base := r.rootfsBase()
	if err := os.MkdirAll(base, 0o700); err != nil {
		return nil, err
	}
	path := filepath.Join(base, "."+name+".lock")
	for {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, err
		}
		if err := flockContext(ctx, f, how); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock rootfs %s: %w", name, err)
		}
		var held, cur unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Lstat(path, &cur) == nil && held.Dev == cur.Dev && held.Ino == cur.Ino {
			return func() {
				unix.Flock(int(f.Fd()), unix.LOCK_UN)
				f.Close()
			}, nil
		}
		f.Close() // removed or replaced while we waited: lock the current one
	}
}

// flockContext takes a flock, waiting at most as long as ctx allows (a
// blocking flock cannot be interrupted).
func flockContext(ctx context.Context, f *os.File, how int) error {
	delay := time.Millisecond
	for {
		err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
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

// copyShifted copies the tree at src into the existing directory dst,
// preserving modes, times, symlinks and hard links, shifting owners, and
// skipping device nodes and sockets (a sandbox gets its devices from /dev).
// A file src shares with a tree reuse knows is linked, not copied.
func copyShifted(ctx context.Context, src, dst string, reuse *reuser) error {
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	type dirTimes struct {
		path string
		st   *unix.Stat_t
	}
	var dirs []dirTimes

	n := 0
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if n++; n%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			return err
		}
		uid, gid := shiftID(st.Uid), shiftID(st.Gid)
		perm := uint32(st.Mode & 0o7777)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			if rel != "." {
				if err := os.Mkdir(target, 0o700); err != nil {
					return err
				}
			}
			if err := os.Lchown(target, uid, gid); err != nil {
				return err
			}
			// chmod after chown: chown clears set-id bits.
			if err := unix.Chmod(target, perm); err != nil {
				return err
			}
			dirs = append(dirs, dirTimes{target, &st})
			return nil
		case unix.S_IFREG:
			key := inode{st.Dev, st.Ino}
			if st.Nlink > 1 {
				if first, ok := links[key]; ok {
					return os.Link(first, target)
				}
				links[key] = target
				// Shared with another tree (a derived template shares
				// its unchanged files with its parent): link the copy
				// made of it for that tree, times and all.
				if reuse.link(rel, &st, target, uid, gid, perm) {
					return nil
				}
			}
			if err := copyFile(path, target, uid, gid, perm); err != nil {
				return err
			}
		case unix.S_IFLNK:
			dest, err := os.Readlink(path)
			if err != nil {
				return err
			}
			if err := os.Symlink(dest, target); err != nil {
				return err
			}
			if err := os.Lchown(target, uid, gid); err != nil {
				return err
			}
		case unix.S_IFIFO:
			if err := unix.Mkfifo(target, perm); err != nil {
				return err
			}
			if err := os.Lchown(target, uid, gid); err != nil {
				return err
			}
			if err := unix.Chmod(target, perm); err != nil {
				return err
			}
		default:
			return nil // devices, sockets
		}
		return setTimes(target, &st)
	})
	if err != nil {
		return err
	}
	// Directory times last: creating entries changed them.
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := setTimes(dirs[i].path, dirs[i].st); err != nil {
			return err
		}
	}
	return nil
}

func setTimes(path string, st *unix.Stat_t) error {
	ts := []unix.Timespec{st.Atim, st.Mtim}
	return unix.UtimesNanoAt(unix.AT_FDCWD, path, ts, unix.AT_SYMLINK_NOFOLLOW)
}

func copyFile(src, dst string, uid, gid int, perm uint32) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	// io.Copy between files uses copy_file_range: a reflink where the
	// filesystem can, an in-kernel copy otherwise.
	_, err = io.Copy(out, in)
	if err == nil {
		err = out.Chown(uid, gid)
	}
	if err == nil {
		err = out.Chmod(fs.FileMode(perm&0o777) | modeBits(perm))
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return errors.Join(err, os.Remove(dst))
	}
	return nil
}

// modeBits converts set-id/sticky bits to fs.FileMode flags.
func modeBits(perm uint32) fs.FileMode {
	var m fs.FileMode
	if perm&unix.S_ISUID != 0 {
		m |= fs.ModeSetuid
	}
	if perm&unix.S_ISGID != 0 {
		m |= fs.ModeSetgid
	}
	if perm&unix.S_ISVTX != 0 {
		m |= fs.ModeSticky
	}
	return m
}
