package agent

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// handleTarGet streams a tar of a directory (entries relative to it) or of
// a single file or symlink (one entry named by its base name). Symlinks are
// stored as symlinks and never followed; devices, FIFOs and sockets are
// skipped.
func (a *Agent) handleTarGet(w http.ResponseWriter, r *http.Request) {
	rel, err := queryPath(r, "path")
	if err != nil {
		writeError(w, err)
		return
	}
	id, err := a.userIdentity(r)
	if err != nil {
		writeError(w, err)
		return
	}
	// An error here is a failed switch of credentials (fn did not run) or
	// of the restore after it (fn answered; the error is only logged).
	if err := runAs(id, func() error { a.tarGet(w, a.rootFor(r), rel); return nil }); err != nil {
		a.log.Warn("tar as user", "err", err)
		writeError(w, err)
	}
}

// tarGet is handleTarGet after the request is parsed, with the credentials
// it acts with.
func (a *Agent) tarGet(w http.ResponseWriter, root *fsRoot, rel string) {
	var err error
	// Resolve the top without following a final symlink, like stat does.
	var dfd int
	var base string
	if rel == "." {
		dfd, base = root.fd, "."
	} else {
		if dfd, base, err = root.parent(rel); err != nil {
			writeError(w, err)
			return
		}
		defer unix.Close(dfd)
	}
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		writeError(w, fsError("tar", apiPath(rel), err))
		return
	}
	w.Header().Set("Content-Type", "application/x-tar")
	tw := tar.NewWriter(w)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		fd, err := unix.Openat(dfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			writeError(w, fsError("tar", apiPath(rel), err))
			return
		}
		w.WriteHeader(http.StatusOK)
		err = tarDir(tw, fd, "", 0)
		unix.Close(fd)
		if err != nil {
			a.log.Info("tar get aborted", "path", apiPath(rel), "err", err)
			panic(http.ErrAbortHandler) // a truncated tar must not look complete
		}
	} else {
		w.WriteHeader(http.StatusOK)
		if err := tarEntry(tw, dfd, base, path.Base(apiPath(rel)), 0); err != nil {
			a.log.Info("tar get aborted", "path", apiPath(rel), "err", err)
			panic(http.ErrAbortHandler)
		}
	}
	if err := tw.Close(); err != nil {
		panic(http.ErrAbortHandler)
	}
}

// tarDir writes the entries below the open directory fd, named under prefix.
func tarDir(tw *tar.Writer, fd int, prefix string, depth int) error {
	if depth > maxTreeDepth {
		return fmt.Errorf("directory tree deeper than %d", maxTreeDepth)
	}
	names, err := readDirNames(fd)
	if err != nil {
		return err
	}
	for _, n := range names {
		if err := tarEntry(tw, fd, n, prefix+n, depth); err != nil {
			return err
		}
	}
	return nil
}

// tarEntry writes name (in dirfd, not followed) as entry, recursing into
// directories.
func tarEntry(tw *tar.Writer, dirfd int, name, entry string, depth int) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return nil // removed meanwhile
		}
		return err
	}
	hdr := &tar.Header{
		Name:    entry,
		Mode:    int64(st.Mode & 0o7777),
		Uid:     int(st.Uid),
		Gid:     int(st.Gid),
		ModTime: time.Unix(st.Mtim.Unix()),
		Format:  tar.FormatPAX,
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr.Typeflag, hdr.Name = tar.TypeDir, entry+"/"
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		return tarDir(tw, fd, hdr.Name, depth+1)
	case unix.S_IFLNK:
		target, err := readlinkAt(dirfd, name)
		if err != nil {
			return err
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		return tw.WriteHeader(hdr)
	case unix.S_IFREG:
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), name)
		defer f.Close()
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return nil // swapped for something else: skip
		}
		hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		n, err := io.CopyN(tw, f, st.Size)
		if err == io.EOF && n < st.Size {
			// Shrunk while archiving: pad to the size in the header.
			_, err = io.CopyN(tw, zeroReader{}, st.Size-n)
		}
		return err
	default:
		return nil // devices, FIFOs, sockets are not archived
	}
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// handleTarPut extracts a tar below path (created if missing). Every entry
// is created through a descriptor of the target directory with
// RESOLVE_IN_ROOT, so absolute symlinks, ".." and entries written through a
// symlink an earlier entry planted all stay inside the target directory.
// Device nodes and FIFOs are refused, set-id bits stripped.
func (a *Agent) handleTarPut(w http.ResponseWriter, r *http.Request) {
	rel, err := queryPath(r, "path")
	if err != nil {
		writeError(w, err)
		return
	}
	id, err := a.userIdentity(r)
	if err != nil {
		writeError(w, err)
		return
	}
	// An error here is a failed switch of credentials (fn did not run) or
	// of the restore after it (fn answered; the error is only logged).
	if err := runAs(id, func() error { a.tarPut(w, r, rel); return nil }); err != nil {
		a.log.Warn("tar as user", "err", err)
		writeError(w, err)
	}
}

// tarPut is handleTarPut after the request is parsed, with the credentials
// it acts with.
func (a *Agent) tarPut(w http.ResponseWriter, r *http.Request, rel string) {
	root := a.rootFor(r)
	if err := root.mkdirAll(rel, 0o755); err != nil {
		writeError(w, err)
		return
	}
	tfd, err := root.open(rel, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		writeError(w, fsError("tar extract into", apiPath(rel), err))
		return
	}
	defer unix.Close(tfd)
	if err := root.sub(tfd).extractTar(r.Body); err != nil {
		writeError(w, fmt.Errorf("tar extract into %s: %w", apiPath(rel), err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// tarName validates an entry name: relative, no "..", no NUL.
func tarName(name string) (string, error) {
	if name == "" || len(name) > agentproto.MaxPathLen || strings.IndexByte(name, 0) >= 0 {
		return "", fmt.Errorf("invalid entry name %q: %w", truncate(name, 128), errdefs.ErrInvalidArgument)
	}
	if strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("entry %q has an absolute name: %w", truncate(name, 128), errdefs.ErrInvalidArgument)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", fmt.Errorf("entry %q has a '..' component: %w", truncate(name, 128), errdefs.ErrInvalidArgument)
		}
	}
	return path.Clean(name), nil
}

// extractTar extracts body into the root (the target directory).
func (r *fsRoot) extractTar(body io.Reader) error {
	tr := tar.NewReader(body)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading tar: %w: %w", err, errdefs.ErrInvalidArgument)
		}
		name, err := tarName(hdr.Name)
		if err != nil {
			return err
		}
		perm := uint32(hdr.Mode) & 0o777 // no set-id, no sticky on files
		switch hdr.Typeflag {
		case tar.TypeDir:
			if name == "." {
				continue
			}
			if err := r.mkdirAll(name, uint32(hdr.Mode)&0o1777|0o700); err != nil {
				return err
			}
			continue
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			return fmt.Errorf("entry %q is a device node or FIFO: %w", truncate(name, 128), errdefs.ErrInvalidArgument)
		case tar.TypeReg, tar.TypeSymlink, tar.TypeLink: // tar.Reader turns legacy TypeRegA into TypeReg (or TypeDir)
		default:
			return fmt.Errorf("entry %q has unsupported type %q: %w", truncate(name, 128), hdr.Typeflag, errdefs.ErrInvalidArgument)
		}
		if name == "." {
			return fmt.Errorf("a non-directory entry names the target itself: %w", errdefs.ErrInvalidArgument)
		}
		dir, base := path.Split(name)
		if dir == "" {
			dir = "."
		}
		if err := r.mkdirAll(path.Clean(dir), 0o755); err != nil {
			return err
		}
		pfd, err := r.at(r.fd, dir, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			return fsError("extract", name, err)
		}
		err = r.extractEntry(pfd, base, name, hdr, perm, tr)
		unix.Close(pfd)
		if err != nil {
			return err
		}
	}
}

// extractEntry creates one non-directory entry as base in pfd, replacing a
// file or symlink already there (never writing through it).
func (r *fsRoot) extractEntry(pfd int, base, name string, hdr *tar.Header, perm uint32, data io.Reader) error {
	if err := unix.Unlinkat(pfd, base, 0); err != nil && err != unix.ENOENT {
		return fsError("extract", name, err) // EISDIR: a directory is in the way
	}
	switch hdr.Typeflag {
	case tar.TypeSymlink:
		if hdr.Linkname == "" || len(hdr.Linkname) > agentproto.MaxPathLen || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return fmt.Errorf("symlink %q has an invalid target: %w", truncate(name, 128), errdefs.ErrInvalidArgument)
		}
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return fsError("extract", name, err)
		}
	case tar.TypeLink:
		target, err := tarName(hdr.Linkname)
		if err != nil || target == "." {
			return fmt.Errorf("hard link %q points outside the archive: %w", truncate(name, 128), errdefs.ErrInvalidArgument)
		}
		tdir, tbase := path.Split(target)
		if tdir == "" {
			tdir = "."
		}
		tfd, err := r.at(r.fd, tdir, unix.O_PATH|unix.O_DIRECTORY)
		if err != nil {
			return fsError("extract hard link", name, err)
		}
		err = unix.Linkat(tfd, tbase, pfd, base, 0)
		unix.Close(tfd)
		if err != nil {
			return fsError("extract hard link", name, err)
		}
		return nil
	default:
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return fsError("extract", name, err)
		}
		f := os.NewFile(uintptr(fd), base)
		_, err = io.Copy(f, data)
		if err == nil {
			err = unix.Fchmod(fd, perm)
		}
		f.Close()
		if err != nil {
			var errno unix.Errno
			if errors.As(err, &errno) {
				return fsError("extract", name, err)
			}
			return fmt.Errorf("reading tar entry %q: %w: %w", truncate(name, 128), err, errdefs.ErrInvalidArgument)
		}
	}
	mt := unix.NsecToTimespec(hdr.ModTime.UnixNano())
	unix.UtimesNanoAt(pfd, base, []unix.Timespec{mt, mt}, unix.AT_SYMLINK_NOFOLLOW)
	return nil
}
