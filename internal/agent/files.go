package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// maxSizelessRead bounds a read of a file that reports size 0.
const maxSizelessRead = 64 << 20

func queryPath(r *http.Request, name string) (string, error) {
	q := r.URL.Query()
	if _, ok := q[name]; !ok {
		return "", fmt.Errorf("missing query parameter %q: %w", name, errdefs.ErrInvalidArgument)
	}
	return cleanPath(q.Get(name))
}

func (a *Agent) handleReadFile(w http.ResponseWriter, r *http.Request) {
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
	// Only the open needs the user's credentials: the kernel checks
	// permissions there, not on later reads.
	var fd int
	err = runAs(id, func() (err error) {
		// O_NONBLOCK so a FIFO planted at the path cannot hang the open.
		fd, err = a.rootFor(r).open(rel, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY)
		return err
	})
	if err != nil {
		writeError(w, fsError("read", apiPath(rel), err))
		return
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		writeError(w, fsError("read", apiPath(rel), err))
		return
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFDIR:
		writeError(w, fmt.Errorf("read %s: is a directory: %w", apiPath(rel), errdefs.ErrConflict))
		return
	default:
		writeError(w, fmt.Errorf("read %s: not a regular file: %w", apiPath(rel), errdefs.ErrUnprocessable))
		return
	}
	// Clear O_NONBLOCK for ordinary blocking reads from here on.
	if err := unix.SetNonblock(fd, false); err != nil {
		writeError(w, fsError("read", apiPath(rel), err))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	if st.Size == 0 {
		// procfs and sysfs report size 0 but have content: stream what is
		// there (bounded, since such files are generated).
		w.WriteHeader(http.StatusOK)
		io.Copy(w, io.LimitReader(f, maxSizelessRead))
		return
	}
	w.Header().Set("Content-Length", strconv.FormatInt(st.Size, 10))
	w.WriteHeader(http.StatusOK)
	n, _ := io.CopyN(w, f, st.Size)
	if n != st.Size {
		// The file shrank while being sent: abort the stream so the client
		// sees an error instead of a silently short file.
		panic(http.ErrAbortHandler)
	}
}

func (a *Agent) handleWriteFile(w http.ResponseWriter, r *http.Request) {
	rel, err := queryPath(r, "path")
	if err != nil {
		writeError(w, err)
		return
	}
	mode := int64(-1)
	if s := r.URL.Query().Get("mode"); s != "" {
		m, err := strconv.ParseUint(s, 8, 32)
		if err != nil || m > 0o7777 {
			writeError(w, fmt.Errorf("mode %q is not an octal permission (0..7777): %w", truncate(s, 16), errdefs.ErrInvalidArgument))
			return
		}
		mode = int64(m)
	}
	id, err := a.userIdentity(r)
	if err != nil {
		writeError(w, err)
		return
	}
	var fi api.FileInfo
	err = runAs(id, func() (err error) {
		fi, err = a.rootFor(r).writeFile(rel, mode, r.Body)
		return err
	})
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, fi)
}

func (a *Agent) handleRemove(w http.ResponseWriter, r *http.Request) {
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
	if err := runAs(id, func() error { return a.rootFor(r).remove(rel, recursive) }); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (a *Agent) handleStat(w http.ResponseWriter, r *http.Request) {
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
	var fi api.FileInfo
	err = runAs(id, func() (err error) {
		fi, err = a.rootFor(r).stat(rel)
		return err
	})
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, fi)
}

func (a *Agent) handleList(w http.ResponseWriter, r *http.Request) {
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
	var entries []api.FileInfo
	err = runAs(id, func() (err error) {
		entries, err = a.rootFor(r).list(rel)
		return err
	})
	if err != nil {
		writeError(w, err)
		return
	}
	b, _ := json.Marshal(api.FileList{Entries: entries})
	if len(b) > agentproto.MaxJSONBody {
		writeError(w, fmt.Errorf("listing %s has %d entries, more than fit in one response; use tar: %w", apiPath(rel), len(entries), errdefs.ErrTooLarge))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Write(b)
}

func (a *Agent) handleMkdir(w http.ResponseWriter, r *http.Request) {
	var req api.MkdirRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, err)
		return
	}
	rel, err := cleanPath(req.Path)
	if err != nil {
		writeError(w, err)
		return
	}
	mode := req.Mode
	if mode == 0 {
		mode = 0o755
	}
	if mode > 0o7777 {
		writeError(w, fmt.Errorf("mode %o is not a permission: %w", mode, errdefs.ErrInvalidArgument))
		return
	}
	id, err := a.userIdentity(r)
	if err != nil {
		writeError(w, err)
		return
	}
	var fi api.FileInfo
	err = runAs(id, func() error {
		if err := a.rootFor(r).mkdirAll(rel, mode); err != nil {
			return err
		}
		fi, err = a.rootFor(r).stat(rel)
		return err
	})
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, fi)
}

func (a *Agent) handleRename(w http.ResponseWriter, r *http.Request) {
	var req api.RenameRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, err)
		return
	}
	from, err := cleanPath(req.From)
	if err != nil {
		writeError(w, err)
		return
	}
	to, err := cleanPath(req.To)
	if err != nil {
		writeError(w, err)
		return
	}
	id, err := a.userIdentity(r)
	if err != nil {
		writeError(w, err)
		return
	}
	if err := runAs(id, func() error { return a.rootFor(r).rename(from, to) }); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// rootFor is the root a files request acts in: exact (no symlink followed
// on the way) when the host asks, see agentproto.QueryExact.
func (a *Agent) rootFor(r *http.Request) *fsRoot {
	if r.URL.Query().Get(agentproto.QueryExact) != "" {
		return a.root.exact()
	}
	return a.root
}

// handleResolve answers PathFilesResolve. It resolves as root: the answer
// is a path, never content, and the operation that follows runs with the
// caller's credentials.
func (a *Agent) handleResolve(w http.ResponseWriter, r *http.Request) {
	rel, err := queryPath(r, "path")
	if err != nil {
		writeError(w, err)
		return
	}
	var follow bool
	switch leaf := r.URL.Query().Get("leaf"); leaf {
	case "follow":
		follow = true
	case "name", "":
	default:
		writeError(w, fmt.Errorf("leaf must be follow or name, got %q: %w", truncate(leaf, 16), errdefs.ErrInvalidArgument))
		return
	}
	p, err := a.root.resolvePath(rel, follow)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, agentproto.Resolved{Path: p})
}
