package e2b

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

// The envd filesystem service (filesystem.Filesystem, Connect) and envd's
// REST /files, on the sandbox agent's file operations. Every operation is
// performed as the call's E2B user (fsCall.opts is the one place that user
// reaches the agent), and relative paths resolve against that user's home,
// as envd resolves them. Entry owners are names from the sandbox's own
// /etc/passwd and /etc/group, as envd reports them.

// Messages of filesystem.proto, in protobuf's JSON mapping.
type (
	entryInfo struct {
		Name          string  `json:"name"`
		Type          string  `json:"type"`
		Path          string  `json:"path"`
		Size          int64   `json:"size,string"`
		Mode          uint32  `json:"mode"`
		Permissions   string  `json:"permissions"`
		Owner         string  `json:"owner"`
		Group         string  `json:"group"`
		ModifiedTime  string  `json:"modifiedTime,omitempty"`
		SymlinkTarget *string `json:"symlinkTarget,omitempty"`
	}
	pathRequest struct {
		Path string `json:"path"`
	}
	entryResponse struct {
		Entry *entryInfo `json:"entry"`
	}
	moveRequest struct {
		Source      string `json:"source"`
		Destination string `json:"destination"`
	}
	listDirRequest struct {
		Path  string `json:"path"`
		Depth uint32 `json:"depth"`
	}
	listDirResponse struct {
		Entries []entryInfo `json:"entries"`
	}
)

// FileType names of filesystem.proto.
const (
	fileTypeUnspecified = "FILE_TYPE_UNSPECIFIED"
	fileTypeFile        = "FILE_TYPE_FILE"
	fileTypeDirectory   = "FILE_TYPE_DIRECTORY"
	fileTypeSymlink     = "FILE_TYPE_SYMLINK"
)

const (
	// SignedFilesPath is where E2B's SDK points upload and download URLs:
	// it builds them with new URL("/files", E2B_SANDBOX_URL), which drops
	// the URL's path and names no sandbox, so the server routes this root
	// path here and the signature itself identifies the sandbox.
	SignedFilesPath = "/files"
	// maxListEntries bounds one ListDir answer (all depths together).
	maxListEntries = 50000
	// maxUploadParts bounds the files of one multipart upload.
	maxUploadParts = 1000
	// maxIDFile bounds the /etc/passwd and /etc/group read for owner names.
	maxIDFile = 1 << 20
	// smallFile is what a download buffers before answering, so a small
	// file gets an exact Content-Length (E2B's SDK reads an empty file by
	// its Content-Length: 0).
	smallFile = 64 << 10
)

func (part filesystemAPI) filesystemRoutes() {
	h := part.h
	a := func(f http.HandlerFunc) http.HandlerFunc { return h.authEnvd(false, f) }
	p := EnvdPrefix + "/filesystem.Filesystem/"
	h.route("POST "+p+"Stat", a(unary((filesystemAPI{h}).stat)))
	h.route("POST "+p+"MakeDir", a(unary((filesystemAPI{h}).makeDir)))
	h.route("POST "+p+"Move", a(unary((filesystemAPI{h}).move)))
	h.route("POST "+p+"ListDir", a(unary((filesystemAPI{h}).listDir)))
	h.route("POST "+p+"Remove", a(unary((filesystemAPI{h}).remove)))
	h.watchRoutes(p)
	// envd's REST file transfer: with the SDK's headers under
	// E2B_SANDBOX_URL, and signed URLs (no headers) at the root.
	h.route("GET "+EnvdPrefix+"/files", h.authEnvd(true, (filesystemAPI{h}).getFiles))
	h.route("POST "+EnvdPrefix+"/files", h.authEnvd(true, (filesystemAPI{h}).postFiles))
	h.route("GET "+SignedFilesPath, (filesystemAPI{h}).signedFiles((filesystemAPI{h}).getFiles))
	h.route("POST "+SignedFilesPath, (filesystemAPI{h}).signedFiles((filesystemAPI{h}).postFiles))
	h.route(SignedFilesPath, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusMethodNotAllowed, apiError{Code: http.StatusMethodNotAllowed, Message: r.Method + " is not allowed on /files: GET downloads, POST uploads"})
	})
}

// fsCall is one filesystem call: its sandbox, E2B user and file session
// (sandbox.FileSession decides every operation by the policy, as for
// every other front door).
type fsCall struct {
	sb   api.Sandbox
	user string
	fs   *sandbox.FileSession
}

// openFS resolves the caller's user and opens a file session on the
// sandbox (which wakes it on the first operation the policy allows). The
// caller must close the call.
func (part filesystemAPI) openFS(ctx context.Context) (*fsCall, error) {
	h := part.h
	cl := caller(ctx)
	user := defaultUser(cl.sb, cl.user)
	if err := checkUser(user); err != nil {
		return nil, err
	}
	fs, err := h.cfg.Manager.Files().OpenFiles(ctx, cl.sb.ID, user)
	if err != nil {
		return nil, err
	}
	return &fsCall{sb: cl.sb, user: user, fs: fs}, nil
}

func (f *fsCall) close() { f.fs.Close() }

func (f *fsCall) stat(ctx context.Context, p string) (api.FileInfo, error) {
	return f.fs.Stat(ctx, p)
}

func (f *fsCall) list(ctx context.Context, p string) ([]api.FileInfo, error) {
	return f.fs.List(ctx, p)
}

func (f *fsCall) mkdir(ctx context.Context, p string) (api.FileInfo, error) {
	return f.fs.Mkdir(ctx, p, 0o755)
}

func (f *fsCall) rename(ctx context.Context, from, to string) error {
	return f.fs.Rename(ctx, from, to)
}

func (f *fsCall) removeAll(ctx context.Context, p string) error {
	return f.fs.Remove(ctx, p, true)
}

func (f *fsCall) readFile(ctx context.Context, p string) (io.ReadCloser, error) {
	return f.fs.Read(ctx, p)
}

func (f *fsCall) writeFile(ctx context.Context, p string, r io.Reader) error {
	_, err := f.fs.Write(ctx, p, 0, r)
	return err
}

// checkUser validates an E2B user name before it reaches the agent: a
// POSIX-portable login name or a numeric uid.
func checkUser(u string) error {
	ok := len(u) > 0 && len(u) <= 32
	for i, c := range u {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_':
		case (c == '-' || c == '.') && i > 0:
		default:
			ok = false
		}
	}
	if !ok {
		return fmt.Errorf("user %q is not a valid user name: %w", truncate(u, 40), errdefs.ErrInvalidArgument)
	}
	return nil
}

// resolve turns an E2B path into an absolute sandbox path, as envd does:
// "" is the sandbox's working directory (else the user's home), "~" and
// "~/…" the user's home, a relative path is relative to the home.
func (f *fsCall) resolve(p string) (string, error) {
	switch {
	case strings.IndexByte(p, 0) >= 0:
		return "", fmt.Errorf("path contains a NUL byte: %w", errdefs.ErrInvalidArgument)
	case len(p) > 4096:
		return "", fmt.Errorf("path is %d bytes, longer than 4096: %w", len(p), errdefs.ErrInvalidArgument)
	}
	hd := home(f.user)
	if p == "" {
		if f.sb.Workdir != "" {
			return path.Clean(f.sb.Workdir), nil
		}
		return hd, nil
	}
	if p[0] == '~' {
		if len(p) > 1 && p[1] != '/' {
			return "", fmt.Errorf("path %q: only the caller's own home (~ or ~/…) can be expanded: %w", truncate(p, 64), errdefs.ErrInvalidArgument)
		}
		p = hd + p[1:]
	}
	if !path.IsAbs(p) {
		p = path.Join(hd, p)
	}
	return path.Clean(p), nil
}

// isPermission reports whether err is the kernel refusing the user.
func isPermission(err error) bool {
	if !errors.Is(err, errdefs.ErrUnprocessable) {
		return false
	}
	m := err.Error()
	return strings.Contains(m, "permission denied") || strings.Contains(m, "operation not permitted")
}

// rpcFSError gives an agent error the Connect code envd would answer with.
func rpcFSError(err error) error {
	if isPermission(err) {
		return rpcErrorf(codePermissionDenied, "%s", err.Error())
	}
	return err
}

// names maps the sandbox's uids and gids to names, read from its own
// /etc/passwd and /etc/group (bounded; the sandbox controls both files, so
// they are only ever names to show). A missing file maps nothing: owners
// are then shown as numbers, as envd shows an unknown id.
type names struct{ users, groups map[uint32]string }

func (f *fsCall) names(ctx context.Context) names {
	return names{users: f.idFile(ctx, "/etc/passwd"), groups: f.idFile(ctx, "/etc/group")}
}

func (f *fsCall) idFile(ctx context.Context, p string) map[uint32]string {
	m := map[uint32]string{}
	b, err := f.fs.ReadIDFile(ctx, p, maxIDFile)
	if err != nil {
		return m
	}
	for _, line := range strings.Split(string(b), "\n") {
		// name:password:id:…, the same for both files.
		fields := strings.SplitN(line, ":", 4)
		if len(fields) < 3 || fields[0] == "" || len(fields[0]) > 64 || strings.ContainsFunc(fields[0], func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			continue
		}
		id, err := strconv.ParseUint(fields[2], 10, 32)
		if err != nil {
			continue
		}
		if _, dup := m[uint32(id)]; !dup {
			m[uint32(id)] = fields[0]
		}
	}
	return m
}

func (n names) name(m map[uint32]string, id uint32) string {
	if s, ok := m[id]; ok {
		return s
	}
	return strconv.FormatUint(uint64(id), 10)
}

// entry is the envd EntryInfo of fi.
func (n names) entry(fi api.FileInfo) entryInfo {
	e := entryInfo{
		Name:        fi.Name,
		Path:        fi.Path,
		Size:        fi.Size,
		Mode:        fi.Mode & 0o777,
		Permissions: goMode(fi).String(),
		Owner:       n.name(n.users, fi.UID),
		Group:       n.name(n.groups, fi.GID),
	}
	switch fi.Type {
	case "file":
		e.Type = fileTypeFile
	case "dir":
		e.Type = fileTypeDirectory
	case "symlink":
		e.Type = fileTypeSymlink
		t := fi.Target
		e.SymlinkTarget = &t
	default:
		e.Type = fileTypeUnspecified
	}
	if !fi.ModTime.IsZero() {
		// protobuf's JSON Timestamp: UTC, "Z", 0, 3, 6 or 9 fraction digits.
		e.ModifiedTime = fi.ModTime.UTC().Format("2006-01-02T15:04:05.000000000Z")
	}
	return e
}

// goMode is fi's mode as Go's os.FileMode, whose String() is envd's
// permissions text ("-rw-r--r--", "drwxr-xr-x").
func goMode(fi api.FileInfo) os.FileMode {
	m := os.FileMode(fi.Mode & 0o777)
	switch fi.Type {
	case "dir":
		m |= os.ModeDir
	case "symlink":
		m |= os.ModeSymlink
	case "file":
	default:
		m |= os.ModeIrregular
	}
	if fi.Mode&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if fi.Mode&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if fi.Mode&0o1000 != 0 {
		m |= os.ModeSticky
	}
	return m
}

// withFS runs fn with the call's filesystem and maps its agent errors.
func withFS[In, Out any](h *Handler, fn func(ctx context.Context, f *fsCall, in *In) (*Out, error)) func(ctx context.Context, r *http.Request, in *In) (*Out, error) {
	return func(ctx context.Context, r *http.Request, in *In) (*Out, error) {
		f, err := (filesystemAPI{h}).openFS(ctx)
		if err != nil {
			return nil, err
		}
		defer f.close()
		out, err := fn(ctx, f, in)
		if err != nil {
			return nil, rpcFSError(err)
		}
		return out, nil
	}
}

func (part filesystemAPI) stat(ctx context.Context, r *http.Request, in *pathRequest) (*entryResponse, error) {
	h := part.h
	return withFS(h, func(ctx context.Context, f *fsCall, in *pathRequest) (*entryResponse, error) {
		p, err := f.resolve(in.Path)
		if err != nil {
			return nil, err
		}
		fi, err := f.stat(ctx, p)
		if err != nil {
			return nil, err
		}
		e := f.names(ctx).entry(fi)
		return &entryResponse{Entry: &e}, nil
	})(ctx, r, in)
}

func (part filesystemAPI) makeDir(ctx context.Context, r *http.Request, in *pathRequest) (*entryResponse, error) {
	h := part.h
	return withFS(h, func(ctx context.Context, f *fsCall, in *pathRequest) (*entryResponse, error) {
		p, err := f.resolve(in.Path)
		if err != nil {
			return nil, err
		}
		// envd answers already_exists for an existing directory (the SDK's
		// makeDir then returns false) and invalid_argument for a file.
		if fi, err := f.stat(ctx, p); err == nil {
			if fi.Type == "dir" {
				return nil, rpcErrorf(codeAlreadyExists, "directory already exists: %s", p)
			}
			return nil, rpcErrorf(codeInvalidArgument, "path already exists but it is not a directory: %s", p)
		} else if !errors.Is(err, errdefs.ErrNotFound) {
			return nil, err
		}
		fi, err := f.mkdir(ctx, p)
		if err != nil {
			if errors.Is(err, errdefs.ErrConflict) {
				return nil, rpcErrorf(codeInvalidArgument, "cannot create %s: a parent is not a directory", p)
			}
			return nil, err
		}
		e := f.names(ctx).entry(fi)
		return &entryResponse{Entry: &e}, nil
	})(ctx, r, in)
}

func (part filesystemAPI) move(ctx context.Context, r *http.Request, in *moveRequest) (*entryResponse, error) {
	h := part.h
	return withFS(h, func(ctx context.Context, f *fsCall, in *moveRequest) (*entryResponse, error) {
		if in.Source == "" || in.Destination == "" {
			return nil, rpcErrorf(codeInvalidArgument, "source and destination are required")
		}
		src, err := f.resolve(in.Source)
		if err != nil {
			return nil, err
		}
		dst, err := f.resolve(in.Destination)
		if err != nil {
			return nil, err
		}
		if _, err := f.stat(ctx, src); err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				return nil, rpcErrorf(codeNotFound, "source %s not found", src)
			}
			return nil, err
		}
		// envd creates the destination's missing parents.
		if err := f.mkdirParent(ctx, dst); err != nil {
			return nil, err
		}
		if err := f.rename(ctx, src, dst); err != nil {
			return nil, err
		}
		fi, err := f.stat(ctx, dst)
		if err != nil {
			return nil, err
		}
		e := f.names(ctx).entry(fi)
		return &entryResponse{Entry: &e}, nil
	})(ctx, r, in)
}

// mkdirParent creates p's missing parent directories.
func (f *fsCall) mkdirParent(ctx context.Context, p string) error {
	dir := path.Dir(p)
	if dir == "/" {
		return nil
	}
	// Only when it is missing: a mkdir is a write of its own for the
	// policy, which must see (and record) the file's path, not its parent's.
	// A symlink there is taken as the directory it names (the write
	// resolves it, and fails if it names none).
	if fi, err := f.stat(ctx, dir); err == nil && (fi.Type == "dir" || fi.Type == "symlink") {
		return nil
	}
	if _, err := f.mkdir(ctx, dir); err != nil {
		if errors.Is(err, errdefs.ErrConflict) {
			return fmt.Errorf("cannot create %s: a parent of it is not a directory: %w", dir, errdefs.ErrInvalidArgument)
		}
		return err
	}
	return nil
}

func (part filesystemAPI) remove(ctx context.Context, r *http.Request, in *pathRequest) (*empty, error) {
	h := part.h
	return withFS(h, func(ctx context.Context, f *fsCall, in *pathRequest) (*empty, error) {
		if in.Path == "" {
			return nil, rpcErrorf(codeInvalidArgument, "path is required")
		}
		p, err := f.resolve(in.Path)
		if err != nil {
			return nil, err
		}
		if p == "/" {
			return nil, rpcErrorf(codeInvalidArgument, "the root directory cannot be removed")
		}
		if err := f.removeAll(ctx, p); err != nil {
			return nil, err
		}
		return &empty{}, nil
	})(ctx, r, in)
}

func (part filesystemAPI) listDir(ctx context.Context, r *http.Request, in *listDirRequest) (*listDirResponse, error) {
	h := part.h
	return withFS(h, func(ctx context.Context, f *fsCall, in *listDirRequest) (*listDirResponse, error) {
		p, err := f.resolve(in.Path)
		if err != nil {
			return nil, err
		}
		depth := int(min(in.Depth, 4096))
		if depth == 0 {
			depth = 1
		}
		var all []api.FileInfo
		if err := f.walk(ctx, p, depth, true, &all); err != nil {
			return nil, err
		}
		n := f.names(ctx)
		out := &listDirResponse{Entries: make([]entryInfo, 0, len(all))}
		for _, fi := range all {
			out.Entries = append(out.Entries, n.entry(fi))
		}
		return out, nil
	})(ctx, r, in)
}

// walk lists dir and, depth-first in name order, its subdirectories down
// to depth levels (symlinks are listed, not followed). A subdirectory that
// vanished or that the user may not read is listed but not entered.
func (f *fsCall) walk(ctx context.Context, dir string, depth int, top bool, out *[]api.FileInfo) error {
	list, err := f.list(ctx, dir)
	if err != nil {
		switch {
		case top && errors.Is(err, errdefs.ErrNotFound):
			return rpcErrorf(codeNotFound, "directory %s not found", dir)
		case top && errors.Is(err, errdefs.ErrConflict):
			return rpcErrorf(codeInvalidArgument, "path is not a directory: %s", dir)
		case !top && (errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrConflict) || isPermission(err)):
			return nil
		}
		return err
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Name < list[j].Name })
	for _, fi := range list {
		if len(*out) >= maxListEntries {
			return rpcErrorf(codeResourceExhausted, "listing %s has more than %d entries: list with a smaller depth", dir, maxListEntries)
		}
		*out = append(*out, fi)
		if fi.Type == "dir" && depth > 1 {
			if err := f.walk(ctx, path.Join(dir, fi.Name), depth-1, false, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// --- envd REST: GET and POST /files ---

// writeFileError answers a /files call in envd's REST error shape with the
// status envd gives each failure.
func (part filesystemAPI) writeFileError(w http.ResponseWriter, r *http.Request, err error) {
	h := part.h
	status := errdefs.HTTPStatus(err)
	switch {
	case isPermission(err):
		status = http.StatusForbidden
	case errors.Is(err, errdefs.ErrConflict) || errors.Is(err, errdefs.ErrUnprocessable):
		// A directory or a special file where a file was meant.
		status = http.StatusBadRequest
	case status == http.StatusRequestEntityTooLarge && !errors.Is(err, errBodyTooLarge):
		// The agent's ENOSPC/EDQUOT: envd's 507.
		status = http.StatusInsufficientStorage
	}
	if status >= 500 && status != http.StatusInsufficientStorage && !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrTimeout) {
		h.cfg.Logger.Error("internal error", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, apiError{Code: status, Message: err.Error()})
}

func (part filesystemAPI) getFiles(w http.ResponseWriter, r *http.Request) {
	h := part.h
	ctx := r.Context()
	f, err := (filesystemAPI{h}).openFS(ctx)
	if err != nil {
		(filesystemAPI{h}).writeFileError(w, r, err)
		return
	}
	defer f.close()
	p, err := f.resolve(r.URL.Query().Get("path"))
	if err != nil {
		(filesystemAPI{h}).writeFileError(w, r, err)
		return
	}
	rc, err := f.readFile(ctx, p)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			err = fmt.Errorf("path '%s' does not exist: %w", p, errdefs.ErrNotFound)
		}
		(filesystemAPI{h}).writeFileError(w, r, err)
		return
	}
	defer rc.Close()
	limit := (filesystemAPI{h}).maxFileBytes()
	body := io.LimitReader(rc, limit+1)
	head := make([]byte, smallFile)
	n, err := io.ReadFull(body, head)
	head = head[:n]
	whole := errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
	if err != nil && !whole {
		(filesystemAPI{h}).writeFileError(w, r, fmt.Errorf("reading %s: %w: %w", p, err, errdefs.ErrUnavailable))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Vary", "Accept-Encoding")
	var out io.Writer = w
	if acceptsGzip(r) {
		w.Header().Set("Content-Encoding", "gzip")
		gz := gzipWriter(w)
		defer gz.Close()
		out = gz
	} else if whole {
		w.Header().Set("Content-Length", strconv.Itoa(n))
	}
	w.WriteHeader(http.StatusOK)
	out.Write(head)
	if whole {
		return
	}
	m, err := io.Copy(out, body)
	if err != nil || int64(n)+m > limit {
		// Headers are gone: abort, so the client sees an error rather
		// than a silently cut file (the agent went away, or the file is
		// over the limit).
		panic(http.ErrAbortHandler)
	}
}

// errBodyTooLarge marks an upload over the server's file size limit.
var errBodyTooLarge = errors.New("upload larger than the server's file size limit")

func (part filesystemAPI) maxFileBytes() int64 {
	h := part.h
	if h.cfg.MaxFileBytes > 0 {
		return h.cfg.MaxFileBytes
	}
	return 1 << 30
}

// writeInfo is one entry of POST /files' answer (the SDK's WriteInfo).
type writeInfo struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

func (part filesystemAPI) postFiles(w http.ResponseWriter, r *http.Request) {
	h := part.h
	ctx := r.Context()
	limit := (filesystemAPI{h}).maxFileBytes()
	if r.ContentLength > limit {
		(filesystemAPI{h}).writeFileError(w, r, fmt.Errorf("body of %d bytes: %w (%d bytes): %w", r.ContentLength, errBodyTooLarge, limit, errdefs.ErrTooLarge))
		return
	}
	f, err := (filesystemAPI{h}).openFS(ctx)
	if err != nil {
		(filesystemAPI{h}).writeFileError(w, r, err)
		return
	}
	defer f.close()
	body, err := uploadReader(r, limit)
	if err != nil {
		(filesystemAPI{h}).writeFileError(w, r, err)
		return
	}
	defer body.Close()
	var written []writeInfo
	q := r.URL.Query()
	_, hasPath := q["path"]
	switch ct := mediaType(r); {
	case ct == "application/octet-stream":
		if !hasPath {
			(filesystemAPI{h}).writeFileError(w, r, fmt.Errorf("path query parameter is required for an application/octet-stream upload: %w", errdefs.ErrInvalidArgument))
			return
		}
		p, err := f.resolve(q.Get("path"))
		if err == nil {
			err = f.write(ctx, p, body)
		}
		if err != nil {
			(filesystemAPI{h}).writeFileError(w, r, body.check(err))
			return
		}
		written = append(written, writeInfo{Name: path.Base(p), Type: "file", Path: p})
	case strings.HasPrefix(ct, "multipart/"):
		written, err = f.writeParts(ctx, r, body, hasPath, q.Get("path"))
		if err != nil {
			(filesystemAPI{h}).writeFileError(w, r, body.check(err))
			return
		}
	default:
		(filesystemAPI{h}).writeFileError(w, r, fmt.Errorf("unsupported content type %q: expected multipart/form-data or application/octet-stream: %w", truncate(ct, 64), errdefs.ErrInvalidArgument))
		return
	}
	if written == nil {
		written = []writeInfo{}
	}
	writeJSON(w, http.StatusOK, written)
}

// write stores r at p, creating missing parent directories.
func (f *fsCall) write(ctx context.Context, p string, r io.Reader) error {
	if p == "/" {
		return fmt.Errorf("path '/' is a directory: %w", errdefs.ErrInvalidArgument)
	}
	if err := f.mkdirParent(ctx, p); err != nil {
		return err
	}
	if err := f.writeFile(ctx, p, r); err != nil {
		if errors.Is(err, errdefs.ErrConflict) {
			return fmt.Errorf("path '%s' is a directory: %w", p, errdefs.ErrInvalidArgument)
		}
		return err
	}
	return nil
}

// signature is envd's v1 signature of a file URL: SHA-256 over
// path:operation:user:token[:expiration], base64 without padding.
func signature(p, op, user, token, expiration string) string {
	raw := p + ":" + op + ":" + user + ":" + token
	if expiration != "" {
		raw += ":" + expiration
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// signatureFor is the signature r must carry for sandbox sb, with the
// expiration it names ("" for none) normalised as envd normalises it.
func (part filesystemAPI) signatureFor(r *http.Request, sb api.Sandbox) (sig string, exp int64, hasExp bool, err error) {
	h := part.h
	q := r.URL.Query()
	var op string
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		return "", 0, false, fmt.Errorf("signed URLs are for GET (read) and POST (write), not %s: %w", r.Method, errdefs.ErrUnauthorized)
	}
	expStr := ""
	if _, ok := q["signature_expiration"]; ok {
		exp, err = strconv.ParseInt(q.Get("signature_expiration"), 10, 64)
		if err != nil {
			return "", 0, false, fmt.Errorf("signature_expiration must be a Unix time in seconds: %w", errdefs.ErrUnauthorized)
		}
		expStr, hasExp = strconv.FormatInt(exp, 10), true
	}
	return signature(q.Get("path"), op, q.Get("username"), h.envdToken(sb), expStr), exp, hasExp, nil
}

// checkSignature accepts a signed file URL of sandbox sb: the signature
// must match (compared in constant time) the operation of the method (GET
// reads, POST writes), the path and the user of the URL, and its expiry,
// if it has one, must not have passed.
func (part filesystemAPI) checkSignature(r *http.Request, sb api.Sandbox) error {
	h := part.h
	want, exp, hasExp, err := (filesystemAPI{h}).signatureFor(r, sb)
	if err != nil {
		return err
	}
	if subtle.ConstantTimeCompare([]byte(want), []byte(r.URL.Query().Get("signature"))) != 1 {
		return fmt.Errorf("invalid signature for this sandbox, path, user and operation: %w", errdefs.ErrUnauthorized)
	}
	if hasExp && exp < time.Now().Unix() {
		return fmt.Errorf("signature expired at %s: %w", time.Unix(exp, 0).UTC().Format(time.RFC3339), errdefs.ErrUnauthorized)
	}
	return nil
}

// signedFiles serves the root /files of E2B's upload and download URLs.
// They carry no sandbox id, so the sandbox is the one whose access token
// makes the URL's signature; with an E2b-Sandbox-Id header (or a
// sandbox_id parameter) the call is an ordinary envd one.
func (part filesystemAPI) signedFiles(next http.HandlerFunc) http.HandlerFunc {
	h := part.h
	auth := h.authEnvd(true, next)
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("E2b-Sandbox-Id") != "" || r.URL.Query().Get("sandbox_id") != "" {
			auth(w, r)
			return
		}
		sig := r.URL.Query().Get("signature")
		if !strings.HasPrefix(sig, "v1_") || len(sig) != len("v1_")+43 {
			h.writeAPIError(w, r, fmt.Errorf("this URL names no sandbox and carries no valid signature: use the sandbox's uploadUrl/downloadUrl, or send E2b-Sandbox-Id and X-Access-Token: %w", errdefs.ErrUnauthorized))
			return
		}
		sbs, err := h.cfg.Manager.List(r.Context(), "", nil)
		if err != nil {
			h.writeAPIError(w, r, err)
			return
		}
		for _, sb := range sbs {
			want, _, _, err := (filesystemAPI{h}).signatureFor(r, sb)
			if err != nil {
				h.writeAPIError(w, r, err)
				return
			}
			if subtle.ConstantTimeCompare([]byte(want), []byte(sig)) == 1 {
				r2 := r.Clone(r.Context())
				r2.Header.Set("E2b-Sandbox-Id", sb.ID)
				auth(w, r2)
				return
			}
		}
		h.writeAPIError(w, r, fmt.Errorf("invalid signature: it matches no sandbox, path, user and operation: %w", errdefs.ErrUnauthorized))
	}
}

// acceptsGzip reports whether the client accepts a gzip response.
func acceptsGzip(r *http.Request) bool {
	for _, v := range r.Header.Values("Accept-Encoding") {
		for _, part := range strings.Split(v, ",") {
			name, params, _ := strings.Cut(strings.TrimSpace(part), ";")
			if !strings.EqualFold(strings.TrimSpace(name), "gzip") {
				continue
			}
			q := strings.ReplaceAll(strings.TrimSpace(params), " ", "")
			if q == "q=0" || q == "q=0.0" || q == "q=0.00" || q == "q=0.000" {
				return false
			}
			return true
		}
	}
	return false
}
