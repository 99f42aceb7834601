package native

import (
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// maxReuseSources bounds how many earlier copies a new one looks in.
const maxReuseSources = 8

// srcRecord is the file next to the copy name that records the template
// tree it was made from.
func srcRecord(base, name string) string { return filepath.Join(base, "."+name+".src") }

// reuser finds, for a file of a tree being shifted, an identical shifted
// file in an earlier copy, so the new copy can hard-link it. A derived
// template (a build step) shares every unchanged file with its parent by
// hard link; without this, each step's copy would cost the whole tree in
// time and disk.
//
// A candidate file is used only when the earlier copy's source tree has,
// at the same path, the very inode being copied (template trees are
// immutable and replace rather than rewrite files, so that copy was made
// from this inode), and when the candidate's owner, mode, size and mtime
// are what copying would produce. Both trees can be hostile images, so
// paths are resolved beneath their roots without following any symlink.
type reuser struct {
	sources []reuseSource // most recently matched first
	linked  int
}

type reuseSource struct {
	src, copy int // O_PATH directory descriptors
}

// newReuser opens the most recent finished copies other than except.
func (r *Runtime) newReuser(except string) *reuser {
	base := r.rootfsBase()
	ents, _ := os.ReadDir(base)
	type rec struct {
		name, src string
		mtime     int64
	}
	var recs []rec
	for _, e := range ents {
		name, ok := strings.CutSuffix(strings.TrimPrefix(e.Name(), "."), ".src")
		if !ok || !strings.HasPrefix(e.Name(), ".") || name == except {
			continue
		}
		b, err := os.ReadFile(filepath.Join(base, e.Name()))
		fi, ierr := e.Info()
		if err != nil || ierr != nil {
			continue
		}
		recs = append(recs, rec{name, string(b), fi.ModTime().UnixNano()})
	}
	sort.Slice(recs, func(i, j int) bool { return recs[i].mtime > recs[j].mtime })
	u := &reuser{}
	for _, rc := range recs {
		if len(u.sources) == maxReuseSources {
			break
		}
		src, err := unix.Open(rc.src, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue // its tree is gone
		}
		cp, err := unix.Open(filepath.Join(base, rc.name), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			unix.Close(src)
			continue
		}
		u.sources = append(u.sources, reuseSource{src, cp})
	}
	return u
}

func (u *reuser) close() {
	for _, s := range u.sources {
		unix.Close(s.src)
		unix.Close(s.copy)
	}
	u.sources = nil
}

// openIn opens rel beneath root as O_PATH, following no symlink.
func openIn(root int, rel string) (int, error) {
	return unix.Openat2(root, rel, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
}

// link hard-links at target a shifted copy of the source file st (at rel
// in its tree), if an earlier copy has one; it reports whether it did.
func (u *reuser) link(rel string, st *unix.Stat_t, target string, uid, gid int, perm uint32) bool {
	if u == nil {
		return false
	}
	for i, s := range u.sources {
		if !sameInode(s.src, rel, st) {
			continue
		}
		fd, err := openIn(s.copy, rel)
		if err != nil {
			continue
		}
		var cst unix.Stat_t
		ok := unix.Fstat(fd, &cst) == nil && cst.Mode&unix.S_IFMT == unix.S_IFREG &&
			int(cst.Uid) == uid && int(cst.Gid) == gid && cst.Mode&0o7777 == perm &&
			cst.Size == st.Size && cst.Mtim == st.Mtim
		// AT_EMPTY_PATH links the inode the descriptor names, not
		// whatever the path names by now.
		if ok && unix.Linkat(fd, "", unix.AT_FDCWD, target, unix.AT_EMPTY_PATH) == nil {
			unix.Close(fd)
			u.linked++
			if i > 0 { // the next file most likely comes from the same tree
				u.sources[0], u.sources[i] = u.sources[i], u.sources[0]
			}
			return true
		}
		unix.Close(fd)
	}
	return false
}

func sameInode(root int, rel string, st *unix.Stat_t) bool {
	fd, err := openIn(root, rel)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var o unix.Stat_t
	return unix.Fstat(fd, &o) == nil && o.Dev == st.Dev && o.Ino == st.Ino
}
