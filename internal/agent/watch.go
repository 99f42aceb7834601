package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Directory watches (agentproto.PathFilesWatch) with inotify.
//
// inotify_add_watch takes a path, not a descriptor, so every directory is
// first opened through the confined resolution of fsroot.go (as the
// requesting user: that open is the permission check inotify would make,
// read access to the directory) and the watch is added on
// /proc/self/fd/N, which names exactly the opened directory whatever
// happens to its path meanwhile. Subdirectories of a recursive watch are
// opened beneath the watched directory without following any symlink.

// watchMask is what a watch reports, in fsnotify's terms.
const watchMask = unix.IN_CREATE | unix.IN_MOVED_TO | unix.IN_MOVED_FROM | unix.IN_MODIFY |
	unix.IN_DELETE | unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR

// errWatchEnded ends a watch whose directory went away (reported already).
var errWatchEnded = errors.New("watched directory is gone")

type watch struct {
	a         *Agent
	id        *identity
	ino       *os.File // the inotify descriptor, non-blocking (runtime poller)
	inofd     int
	rel       string // the watched directory, relative to the agent's root
	recursive bool
	paths     map[int]string // watch descriptor → path relative to dir ("." for dir)
	wds       map[string]int // the inverse
	capped    bool           // the last directory that needed a watch did not get one
	armed     bool           // the "watching" line is sent
	lost      bool           // an overflow to report once armed
	send      func(api.FileEvent) error
	// movedFrom is a directory whose IN_MOVED_FROM awaits its IN_MOVED_TO
	// (the kernel queues the pair back to back): a move within the tree
	// keeps its watches under the new name, a move out drops them.
	movedFrom       string
	movedFromCookie uint32
}

func (a *Agent) handleWatch(w http.ResponseWriter, r *http.Request) {
	rel, err := queryPath(r, "path")
	if err != nil {
		writeError(w, err)
		return
	}
	recursive := false
	switch r.URL.Query().Get("recursive") {
	case "", "0", "false":
	case "1", "true":
		recursive = true
	default:
		writeError(w, fmt.Errorf("recursive must be 0 or 1: %w", errdefs.ErrInvalidArgument))
		return
	}
	id, err := a.userIdentity(r)
	if err != nil {
		writeError(w, err)
		return
	}
	var dir int
	err = runAs(id, func() (err error) {
		// O_NONBLOCK: a FIFO at the path must not hang the open.
		dir, err = a.rootFor(r).open(rel, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY)
		return err
	})
	if err != nil {
		writeError(w, fsError("watch", apiPath(rel), err))
		return
	}
	// No descriptor of the directory stays open: the kernel reports a
	// directory's own removal (IN_DELETE_SELF) only once nothing holds it.
	defer func() {
		if dir >= 0 {
			unix.Close(dir)
		}
	}()
	var st unix.Stat_t
	if err := unix.Fstat(dir, &st); err != nil {
		writeError(w, fsError("watch", apiPath(rel), err))
		return
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		writeError(w, fmt.Errorf("watch %s: not a directory: %w", apiPath(rel), errdefs.ErrInvalidArgument))
		return
	}
	inofd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		writeError(w, fsError("watch", apiPath(rel), err))
		return
	}
	ino := os.NewFile(uintptr(inofd), "inotify")
	defer ino.Close()
	wt := &watch{a: a, id: id, ino: ino, inofd: inofd, rel: rel, recursive: recursive,
		paths: map[int]string{}, wds: map[string]int{}}
	if err := wt.add(".", dir); err != nil {
		writeError(w, fsError("watch", apiPath(rel), err))
		return
	}
	unix.Close(dir)
	dir = -1

	a.watches.Add(1)
	defer a.watches.Add(-1)
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	wt.send = func(ev api.FileEvent) error {
		ev.Time = time.Now().UTC()
		b, _ := json.Marshal(ev)
		if _, err := w.Write(append(b, '\n')); err != nil {
			return err
		}
		return rc.Flush()
	}
	if recursive {
		// Subdirectories that exist now; what appears later is added as
		// its creation is reported.
		if err := wt.addTree(".", false); err != nil {
			return
		}
	}
	if wt.send(api.FileEvent{Type: api.FileEventWatching}) != nil {
		return
	}
	wt.armed = true
	if wt.lost && wt.send(api.FileEvent{Type: api.FileEventOverflow}) != nil {
		return
	}
	// The host going away cancels the request; closing the descriptor
	// wakes the read below.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-r.Context().Done():
			ino.SetReadDeadline(time.Now())
		case <-stop:
		}
	}()
	err = wt.run()
	a.log.Debug("watch ended", "path", apiPath(rel), "err", err)
}

// run reads and reports events until the host goes away or the watched
// directory does.
func (wt *watch) run() error {
	buf := make([]byte, 64<<10)
	for {
		n, err := wt.ino.Read(buf)
		if err != nil {
			return err
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			end := off + unix.SizeofInotifyEvent + int(ev.Len)
			if end > n {
				break
			}
			name := string(bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:end], "\x00"))
			off = end
			if err := wt.handle(int(ev.Wd), ev.Mask, name, ev.Cookie); err != nil {
				return err
			}
		}
	}
}

// handle reports one inotify event and keeps a recursive watch's set of
// directories up to date.
func (wt *watch) handle(wd int, mask uint32, name string, cookie uint32) error {
	if wt.movedFrom != "" {
		from := wt.movedFrom
		wt.movedFrom = ""
		if mask&unix.IN_MOVED_TO != 0 && cookie == wt.movedFromCookie {
			if dirRel, ok := wt.paths[wd]; ok {
				wt.rename(from, path.Join(dirRel, name))
			}
		} else {
			wt.drop(from)
		}
	}
	if mask&unix.IN_Q_OVERFLOW != 0 {
		return wt.send(api.FileEvent{Type: api.FileEventOverflow})
	}
	dirRel, known := wt.paths[wd]
	if !known {
		return nil // a watch removed meanwhile
	}
	if mask&unix.IN_IGNORED != 0 {
		wt.forget(wd)
		if dirRel == "." {
			// Removed without DELETE_SELF first (unmounted, say).
			wt.send(api.FileEvent{Name: ".", Type: api.FileEventRemove})
			return errWatchEnded
		}
		return nil
	}
	if mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 {
		if dirRel != "." {
			return nil // the parent's watch reports it
		}
		typ := api.FileEventRemove
		if mask&unix.IN_MOVE_SELF != 0 {
			typ = api.FileEventRename
		}
		wt.send(api.FileEvent{Name: ".", Type: typ})
		return errWatchEnded
	}
	rel := path.Join(dirRel, name)
	isDir := mask&unix.IN_ISDIR != 0
	var typ string
	switch {
	case mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		typ = api.FileEventCreate
	case mask&unix.IN_MOVED_FROM != 0:
		typ = api.FileEventRename
	case mask&unix.IN_DELETE != 0:
		typ = api.FileEventRemove
	case mask&unix.IN_MODIFY != 0:
		typ = api.FileEventWrite
	case mask&unix.IN_ATTRIB != 0:
		typ = api.FileEventChmod
	default:
		return nil
	}
	if err := wt.send(api.FileEvent{Name: rel, Type: typ}); err != nil {
		return err
	}
	if !wt.recursive || !isDir {
		return nil
	}
	switch {
	case mask&unix.IN_CREATE != 0:
		// Whatever was made inside before its watch existed is reported
		// as created (possibly twice, if it raced the watch).
		return wt.addTree(rel, true)
	case mask&unix.IN_MOVED_TO != 0:
		if _, watched := wt.wds[rel]; !watched { // moved in from outside
			return wt.addTree(rel, false)
		}
	case mask&unix.IN_MOVED_FROM != 0:
		if _, watched := wt.wds[rel]; watched {
			wt.movedFrom, wt.movedFromCookie = rel, cookie
		}
	}
	return nil
}

// below reports whether p is dir or inside it.
func below(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }

// rename moves the watches at and below from to the name to.
func (wt *watch) rename(from, to string) {
	for d, p := range wt.paths {
		if below(p, from) {
			np := to + p[len(from):]
			delete(wt.wds, p)
			wt.paths[d] = np
			wt.wds[np] = d
		}
	}
}

// drop removes the watches at and below dir (moved out of the tree).
func (wt *watch) drop(dir string) {
	for p, d := range wt.wds {
		if below(p, dir) {
			unix.InotifyRmWatch(wt.inofd, uint32(d))
			wt.forget(d)
		}
	}
}

func (wt *watch) forget(wd int) {
	if p, ok := wt.paths[wd]; ok {
		delete(wt.paths, wd)
		if wt.wds[p] == wd {
			delete(wt.wds, p)
		}
	}
}

// add watches the directory open as fd under the name rel.
func (wt *watch) add(rel string, fd int) error {
	if len(wt.paths) >= wt.a.cfg.MaxWatches {
		return unix.ENOSPC
	}
	wd, err := unix.InotifyAddWatch(wt.inofd, "/proc/self/fd/"+strconv.Itoa(fd), watchMask)
	if err != nil {
		return err
	}
	if old, ok := wt.wds[rel]; ok && old != wd {
		wt.forget(old)
	}
	wt.paths[wd] = rel
	wt.wds[rel] = wd
	wt.capped = false
	return nil
}

// addTree watches the directories at and below rel (not rel itself when it
// is "."), depth first, reporting what it finds as created when synth.
// Directories it cannot open (removed meanwhile, not readable by the user)
// are skipped; the watch cap is reported once as an overflow.
func (wt *watch) addTree(rel string, synth bool) error {
	type item struct {
		rel   string
		depth int
	}
	stack := []item{{rel, 0}}
	for len(stack) > 0 {
		it := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		fd, err := wt.openSub(it.rel)
		if err != nil {
			continue
		}
		if it.rel != "." {
			if err := wt.add(it.rel, fd); err != nil {
				unix.Close(fd)
				if err == unix.ENOSPC { // our cap or the kernel's max_user_watches
					if !wt.capped {
						wt.capped = true
						if !wt.armed {
							wt.lost = true
						} else if err := wt.send(api.FileEvent{Type: api.FileEventOverflow}); err != nil {
							return err
						}
					}
					return nil
				}
				continue
			}
		}
		names, err := readDirNames(fd)
		if err != nil {
			unix.Close(fd)
			continue
		}
		for _, n := range names {
			child := path.Join(it.rel, n)
			var st unix.Stat_t
			if unix.Fstatat(fd, n, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
				continue
			}
			if synth {
				if err := wt.send(api.FileEvent{Name: child, Type: api.FileEventCreate}); err != nil {
					unix.Close(fd)
					return err
				}
			}
			if st.Mode&unix.S_IFMT == unix.S_IFDIR && it.depth < maxTreeDepth {
				stack = append(stack, item{child, it.depth + 1})
			}
		}
		unix.Close(fd)
	}
	return nil
}

// openSub opens directory rel below the watched directory as the watch's
// user, following no symlink below the watched directory.
func (wt *watch) openSub(rel string) (int, error) {
	var fd int
	err := runAs(wt.id, func() error {
		top, err := wt.a.root.open(wt.rel, unix.O_PATH|unix.O_DIRECTORY)
		if err != nil {
			return err
		}
		defer unix.Close(top)
		how := &unix.OpenHow{
			Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
		}
		for i := 0; ; i++ {
			fd, err = unix.Openat2(top, rel, how)
			if (err == unix.EAGAIN || err == unix.EINTR) && i < 64 {
				continue
			}
			return err
		}
	})
	return fd, err
}
