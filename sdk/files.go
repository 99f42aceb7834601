package sdk

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func filesPath(sandboxID, suffix string) (string, error) {
	if err := checkID("sandbox", sandboxID); err != nil {
		return "", err
	}
	return "/v1/sandboxes/" + seg(sandboxID) + "/files" + suffix, nil
}

func pathQuery(p string, opts []FileOption) (url.Values, error) {
	if p == "" {
		return nil, fmt.Errorf("empty path: %w", errdefs.ErrInvalidArgument)
	}
	q := url.Values{"path": {p}}
	if u := fileOpts(opts).user; u != "" {
		q.Set("user", u)
	}
	return q, nil
}

// FileOption changes how a file operation is performed.
type FileOption func(*fileOptions)

type fileOptions struct{ user string }

func fileOpts(opts []FileOption) fileOptions {
	var o fileOptions
	for _, f := range opts {
		f(&o)
	}
	return o
}

// AsUser performs a file operation as this sandbox user ("name" or "uid",
// optionally ":group"), e.g. sdk.AsUser("user"): the sandbox's kernel
// checks that user's permissions (a refusal is ErrUnprocessable, "permission
// denied") and the files it creates are its own. Without it: root.
func AsUser(user string) FileOption { return func(o *fileOptions) { o.user = user } }

// ReadFile is GET /v1/sandboxes/{id}/files?path=P. The caller closes the
// returned reader.
func (c *Client) ReadFile(ctx context.Context, sandboxID, path string, opts ...FileOption) (io.ReadCloser, error) {
	return c.getStream(ctx, sandboxID, "", path, opts)
}

// WriteFile is PUT /v1/sandboxes/{id}/files?path=P&mode=M. A zero mode
// leaves the choice to the server (0644 for a new file).
func (c *Client) WriteFile(ctx context.Context, sandboxID, path string, r io.Reader, mode fs.FileMode, opts ...FileOption) (*api.FileInfo, error) {
	p, err := filesPath(sandboxID, "")
	if err != nil {
		return nil, err
	}
	q, err := pathQuery(path, opts)
	if err != nil {
		return nil, err
	}
	if mode != 0 {
		q.Set("mode", fmt.Sprintf("%04o", mode.Perm()))
	}
	var out api.FileInfo
	if err := c.do(ctx, request{method: http.MethodPut, path: p, query: q, body: r, contentType: "application/octet-stream"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RemoveFile is DELETE /v1/sandboxes/{id}/files?path=P[&recursive=true].
func (c *Client) RemoveFile(ctx context.Context, sandboxID, path string, recursive bool, opts ...FileOption) error {
	p, err := filesPath(sandboxID, "")
	if err != nil {
		return err
	}
	q, err := pathQuery(path, opts)
	if err != nil {
		return err
	}
	if recursive {
		q.Set("recursive", "true")
	}
	return c.do(ctx, request{method: http.MethodDelete, path: p, query: q}, nil)
}

// StatFile is GET /v1/sandboxes/{id}/files/stat?path=P.
func (c *Client) StatFile(ctx context.Context, sandboxID, path string, opts ...FileOption) (*api.FileInfo, error) {
	p, err := filesPath(sandboxID, "/stat")
	if err != nil {
		return nil, err
	}
	q, err := pathQuery(path, opts)
	if err != nil {
		return nil, err
	}
	var out api.FileInfo
	if err := c.do(ctx, request{method: http.MethodGet, path: p, query: q}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListDir is GET /v1/sandboxes/{id}/files/list?path=P.
func (c *Client) ListDir(ctx context.Context, sandboxID, path string, opts ...FileOption) ([]api.FileInfo, error) {
	p, err := filesPath(sandboxID, "/list")
	if err != nil {
		return nil, err
	}
	q, err := pathQuery(path, opts)
	if err != nil {
		return nil, err
	}
	var out api.FileList
	if err := c.do(ctx, request{method: http.MethodGet, path: p, query: q}, &out); err != nil {
		return nil, err
	}
	return out.Entries, nil
}

// Mkdir is POST /v1/sandboxes/{id}/files/mkdir (parents are created too).
func (c *Client) Mkdir(ctx context.Context, sandboxID, path string, mode fs.FileMode, opts ...FileOption) (*api.FileInfo, error) {
	p, err := filesPath(sandboxID, "/mkdir")
	if err != nil {
		return nil, err
	}
	if path == "" {
		return nil, fmt.Errorf("mkdir: empty path: %w", errdefs.ErrInvalidArgument)
	}
	var out api.FileInfo
	req := api.MkdirRequest{Path: path, Mode: uint32(mode.Perm()), User: fileOpts(opts).user}
	if err := c.do(ctx, request{method: http.MethodPost, path: p, json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Rename is POST /v1/sandboxes/{id}/files/rename.
func (c *Client) Rename(ctx context.Context, sandboxID, from, to string, opts ...FileOption) error {
	p, err := filesPath(sandboxID, "/rename")
	if err != nil {
		return err
	}
	if from == "" || to == "" {
		return fmt.Errorf("rename %q to %q: empty path: %w", from, to, errdefs.ErrInvalidArgument)
	}
	return c.do(ctx, request{method: http.MethodPost, path: p, json: api.RenameRequest{From: from, To: to, User: fileOpts(opts).user}}, nil)
}

// DownloadTar is GET /v1/sandboxes/{id}/files/tar?path=P: a tar archive of
// a directory's contents (entry names relative to P), or of a single file
// (one entry named by its base name). The caller closes the reader.
func (c *Client) DownloadTar(ctx context.Context, sandboxID, path string, opts ...FileOption) (io.ReadCloser, error) {
	return c.getStream(ctx, sandboxID, "/tar", path, opts)
}

// UploadTar is PUT /v1/sandboxes/{id}/files/tar?path=P: the archive is
// extracted into the directory P (created if missing).
func (c *Client) UploadTar(ctx context.Context, sandboxID, path string, tar io.Reader, opts ...FileOption) error {
	p, err := filesPath(sandboxID, "/tar")
	if err != nil {
		return err
	}
	q, err := pathQuery(path, opts)
	if err != nil {
		return err
	}
	return c.do(ctx, request{method: http.MethodPut, path: p, query: q, body: tar, contentType: "application/x-tar"}, nil)
}

func (c *Client) getStream(ctx context.Context, sandboxID, suffix, path string, opts []FileOption) (io.ReadCloser, error) {
	p, err := filesPath(sandboxID, suffix)
	if err != nil {
		return nil, err
	}
	q, err := pathQuery(path, opts)
	if err != nil {
		return nil, err
	}
	resp, err := c.send(ctx, request{method: http.MethodGet, path: p, query: q})
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// ParseMode parses an octal permission string such as "0644" or "755".
func ParseMode(s string) (fs.FileMode, error) {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o7777 {
		return 0, fmt.Errorf("mode %q: want octal permission bits like 0644: %w", s, errdefs.ErrInvalidArgument)
	}
	return fs.FileMode(v), nil
}

// maxFileEvent bounds one line of a watch stream.
const maxFileEvent = 64 << 10

// WatchDir is GET /v1/sandboxes/{id}/files/watch: it calls fn with every
// change under directory req.Path, the first call being the
// api.FileEventWatching event once the watch is armed. It returns nil when
// ctx ends, fn's error when fn fails, an error matching ErrNotFound when
// the directory is missing or went away (after fn got its "remove" or
// "rename" event of "."), ErrInvalidArgument when it is not a directory, and
// one matching ErrUnavailable when the stream ends otherwise (the sandbox
// stopped or suspended).
func (c *Client) WatchDir(ctx context.Context, id string, req api.WatchRequest, fn func(api.FileEvent) error) error {
	p, err := filesPath(id, "/watch")
	if err != nil {
		return err
	}
	var opts []FileOption
	if req.User != "" {
		opts = append(opts, AsUser(req.User))
	}
	q, err := pathQuery(req.Path, opts)
	if err != nil {
		return err
	}
	if req.Recursive {
		q.Set("recursive", "true")
	}
	resp, err := c.send(ctx, request{method: http.MethodGet, path: p, query: q})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	what := fmt.Sprintf("watch %s in %s", req.Path, id)
	gone := false
	err = readNDJSON(ctx, resp.Body, ndjsonStream{what: what, item: "event", maxLine: maxFileEvent, broken: errdefs.ErrUnavailable}, func(ev api.FileEvent) error {
		gone = ev.Name == "." && (ev.Type == api.FileEventRemove || ev.Type == api.FileEventRename)
		return fn(ev)
	})
	if err != nil || ctx.Err() != nil {
		return err
	}
	if gone {
		return fmt.Errorf("watch %s in %s: the directory was removed or moved: %w", req.Path, id, errdefs.ErrNotFound)
	}
	return fmt.Errorf("watch %s in %s: the stream ended (the sandbox stopped?): %w", req.Path, id, errdefs.ErrUnavailable)
}
