package server

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

// fileOp runs fn in a file session (sandbox.FileSession: every front
// door's one way to a sandbox's files, decided by the policy) on the
// sandbox of the route, as the query's user (root when absent), with the
// path from the query. fn writes the success response; any error is
// written here.
func (part filesAPI) fileOp(w http.ResponseWriter, r *http.Request, fn func(fs *sandbox.FileSession, path string) error) {
	s := part.s
	(filesAPI{s}).fileSession(w, r, r.URL.Query().Get("user"), func(fs *sandbox.FileSession) error {
		return fn(fs, r.URL.Query().Get("path"))
	})
}

// fileSession runs fn in a file session of the route's sandbox as user.
func (part filesAPI) fileSession(w http.ResponseWriter, r *http.Request, user string, fn func(fs *sandbox.FileSession) error) {
	s := part.s
	fs, err := s.mgr.Files().OpenFiles(r.Context(), r.PathValue("id"), user)
	if err != nil {
		writeError(w, r, err)
		return
	}
	defer fs.Close()
	if err := fn(fs); err != nil {
		writeError(w, r, err)
	}
}

// streamOut copies an agent stream to the client, bounded: the agent is
// hostile and could stream forever.
func (part filesAPI) streamOut(w http.ResponseWriter, rc io.ReadCloser, contentType string) {
	s := part.s
	defer rc.Close()
	w.Header().Set("Content-Type", contentType)
	n, _ := io.Copy(w, io.LimitReader(rc, s.cfg.MaxFileBytes+1))
	if n > s.cfg.MaxFileBytes {
		// Headers are gone; abort so the client sees an error, not a silently cut file.
		panic(http.ErrAbortHandler)
	}
}

func (part filesAPI) readFile(w http.ResponseWriter, r *http.Request) {
	s := part.s
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		rc, err := fs.Read(r.Context(), p)
		if err != nil {
			return err
		}
		(filesAPI{s}).streamOut(w, rc, "application/octet-stream")
		return nil
	})
}

func (part filesAPI) tarGet(w http.ResponseWriter, r *http.Request) {
	s := part.s
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		rc, err := fs.TarGet(r.Context(), p)
		if err != nil {
			return err
		}
		(filesAPI{s}).streamOut(w, rc, "application/x-tar")
		return nil
	})
}

// limitedBody fails reads past its limit and remembers that it did, so the
// handler can answer 413 however the downstream (the agent client) wrapped
// the read error.
type limitedBody struct {
	r        io.Reader
	left     int64
	limit    int64
	exceeded bool
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// Probe one byte: a body of exactly limit bytes is fine.
		var one [1]byte
		if n, _ := b.r.Read(one[:]); n > 0 {
			b.exceeded = true
			return 0, fmt.Errorf("body is more than the limit of %d bytes: %w", b.limit, errdefs.ErrTooLarge)
		}
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}

// check turns any error into a 413 when the body went over its limit.
func (b *limitedBody) check(err error) error {
	if err != nil && b.exceeded {
		return fmt.Errorf("body is more than the limit of %d bytes: %w", b.limit, errdefs.ErrTooLarge)
	}
	return err
}

func uploadBody(r *http.Request, limit int64) (*limitedBody, error) {
	if r.ContentLength > limit {
		return nil, fmt.Errorf("body is %d bytes, more than the limit of %d: %w", r.ContentLength, limit, errdefs.ErrTooLarge)
	}
	return &limitedBody{r: r.Body, left: limit, limit: limit}, nil
}

func (part filesAPI) writeFile(w http.ResponseWriter, r *http.Request) {
	s := part.s
	mode := os.FileMode(0o644)
	if ms := r.URL.Query().Get("mode"); ms != "" {
		v, err := strconv.ParseUint(ms, 8, 32)
		if err != nil || v > 0o7777 {
			writeError(w, r, fmt.Errorf("mode must be octal permission bits like 0644, got %q: %w", ms, errdefs.ErrInvalidArgument))
			return
		}
		mode = os.FileMode(v)
	}
	body, err := uploadBody(r, s.cfg.MaxFileBytes)
	if err != nil {
		writeError(w, r, err)
		return
	}
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		fi, err := fs.Write(r.Context(), p, mode, body)
		if err != nil {
			return body.check(err)
		}
		writeJSON(w, 200, fi)
		return nil
	})
}

func (part filesAPI) tarPut(w http.ResponseWriter, r *http.Request) {
	s := part.s
	body, err := uploadBody(r, s.cfg.MaxFileBytes)
	if err != nil {
		writeError(w, r, err)
		return
	}
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		err := fs.TarPut(r.Context(), p, body)
		if err != nil {
			return body.check(err)
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (part filesAPI) removeFile(w http.ResponseWriter, r *http.Request) {
	s := part.s
	rec, err := parseBool(r.URL.Query().Get("recursive"), "recursive")
	if err != nil {
		writeError(w, r, err)
		return
	}
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		if err := fs.Remove(r.Context(), p, rec); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (part filesAPI) statFile(w http.ResponseWriter, r *http.Request) {
	s := part.s
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		fi, err := fs.Stat(r.Context(), p)
		if err != nil {
			return err
		}
		writeJSON(w, 200, fi)
		return nil
	})
}

func (part filesAPI) listFiles(w http.ResponseWriter, r *http.Request) {
	s := part.s
	(filesAPI{s}).fileOp(w, r, func(fs *sandbox.FileSession, p string) error {
		list, err := fs.List(r.Context(), p)
		if err != nil {
			return err
		}
		if list == nil {
			list = []api.FileInfo{}
		}
		writeJSON(w, 200, api.FileList{Entries: list})
		return nil
	})
}

func (part filesAPI) mkdir(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var req api.MkdirRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if req.Mode > 0o7777 {
		writeError(w, r, fmt.Errorf("mode must be permission bits ≤ 07777: %w", errdefs.ErrInvalidArgument))
		return
	}
	mode := os.FileMode(req.Mode)
	if mode == 0 {
		mode = 0o755
	}
	(filesAPI{s}).fileSession(w, r, req.User, func(fs *sandbox.FileSession) error {
		fi, err := fs.Mkdir(r.Context(), req.Path, mode)
		if err != nil {
			return err
		}
		writeJSON(w, 200, fi)
		return nil
	})
}

func (part filesAPI) rename(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var req api.RenameRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	(filesAPI{s}).fileSession(w, r, req.User, func(fs *sandbox.FileSession) error {
		if err := fs.Rename(r.Context(), req.From, req.To); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// watchWriteTimeout bounds the write of one event line: a client that stops
// reading fails its watch instead of holding it.
const watchWriteTimeout = 30 * time.Second

// watchDir streams api.FileEvent lines. Errors known before the watch is
// armed (an unknown sandbox, a path that is missing or not a directory)
// are plain JSON errors; the stream starts with the "watching" event and
// simply ends otherwise (see sandbox.Files.WatchDir for why).
func (part filesAPI) watchDir(w http.ResponseWriter, r *http.Request) {
	s := part.s
	q := r.URL.Query()
	rec, err := parseBool(q.Get("recursive"), "recursive")
	if err != nil {
		writeError(w, r, err)
		return
	}
	// WatchDir decides the read, as a file session does.
	req := api.WatchRequest{Path: q.Get("path"), Recursive: rec, User: q.Get("user")}
	id := r.PathValue("id")
	var nd *ndjsonWriter
	err = s.mgr.Files().WatchDir(r.Context(), id, req, func(ev api.FileEvent) error {
		if nd == nil {
			nd = newNDJSON(w, watchWriteTimeout)
		}
		return nd.Send(ev)
	})
	if nd == nil {
		if err != nil {
			writeError(w, r, err)
		}
		return
	}
	nd.Close()
	if err != nil && r.Context().Err() == nil {
		slog.Debug("watch stream ended", "sandbox", id, "path", req.Path, "err", err)
	}
}
