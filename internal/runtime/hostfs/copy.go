package hostfs

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// CopySparse copies the file src to a new file dst (mode 0600, which must
// not exist) without materialising holes: a clone where the filesystem
// shares extents (FICLONE on btrfs/xfs), else only the data extents
// (SEEK_DATA/SEEK_HOLE) through copy_file_range, with a plain copy where
// that is not supported. dst is fsync'd. src must be a regular file: a
// symlink is not followed and a FIFO is not waited on (disks live where a
// sandbox's QEMU or sentry, which the sandbox may control, writes). Disks
// are mostly holes: a fresh 1 GiB ext4 image holds a few MiB of data. On
// error dst is removed.
func CopySparse(src, dst string) (err error) {
	ifd, err := unix.Open(src, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: src, Err: err}
	}
	in := os.NewFile(uintptr(ifd), src)
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("copy %s: not a regular file: %w", src, errdefs.ErrInvalidArgument)
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(dst)
		}
	}()
	if err := unix.IoctlFileClone(int(out.Fd()), ifd); err == nil {
		return out.Sync()
	}
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	ofd := int(out.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(ifd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole remains
		}
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		hole, err := unix.Seek(ifd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		for data < hole {
			roff, woff := data, data
			n, err := unix.CopyFileRange(ifd, &roff, ofd, &woff, int(hole-data), 0)
			if err != nil || n == 0 {
				// Not supported between these files: a plain copy.
				if _, err := io.Copy(io.NewOffsetWriter(out, data), io.NewSectionReader(in, data, hole-data)); err != nil {
					return fmt.Errorf("copy %s: %w", src, err)
				}
				break
			}
			data += int64(n)
		}
		off = hole
	}
	return out.Sync()
}
