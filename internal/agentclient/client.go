// Package agentclient is the host side of the agentproto protocol: it talks
// to a space-agent over the one byte stream a runtime provides.
//
// The agent runs inside the sandbox and is therefore hostile: every size
// and time this package reads is bounded. Response JSON bodies are capped
// (agentproto.MaxJSONBody, larger only for exec output), response headers
// are capped, non-streaming calls have a deadline, and anything malformed
// becomes an error wrapping errdefs.ErrUnavailable — never a panic or a
// hang. Errors the agent reports are rebuilt as errdefs sentinels from
// their code, with the agent's message truncated.
package agentclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/coder/websocket"
	"github.com/hashicorp/yamux"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

const (
	// DefaultCallTimeout bounds a non-streaming call (and the wait for the
	// response headers of a streaming one).
	DefaultCallTimeout = 30 * time.Second
	// execGrace is added to an exec's own timeout for the agent to answer.
	execGrace = 30 * time.Second
	// maxHeaderBytes caps the response headers the agent may send.
	maxHeaderBytes = 64 << 10
	// maxErrorBody caps an error response body we read.
	maxErrorBody = 64 << 10
	// maxMessage caps the agent's error message we pass on.
	maxMessage = 1 << 10
)

// Client talks to one agent over one yamux session. It is safe for
// concurrent use.
type Client struct {
	sess    *yamux.Session
	hc      *http.Client // response headers bounded by timeout
	timeout time.Duration
	execs   execPool // kept streams of the synchronous exec (exec.go)
}

// New starts a yamux client session over conn (which the Client owns).
func New(conn net.Conn) (*Client, error) {
	return newClient(conn, DefaultCallTimeout)
}

func newClient(conn net.Conn, timeout time.Duration) (*Client, error) {
	cfg := yamux.DefaultConfig()
	// The protocol has no streams opened by the agent and nothing here
	// accepts any: with a backlog of one, a hostile agent can park at most
	// one stream (one bounded window); yamux resets every other.
	cfg.AcceptBacklog = 1
	cfg.MaxStreamWindowSize = 256 << 10
	cfg.KeepAliveInterval = 10 * time.Second
	cfg.ConnectionWriteTimeout = 10 * time.Second
	cfg.StreamOpenTimeout = 10 * time.Second
	cfg.StreamCloseTimeout = time.Minute
	cfg.LogOutput = nil
	cfg.Logger = log.New(io.Discard, "", 0)
	sess, err := yamux.Client(conn, cfg)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("agent session: %w: %w", err, errdefs.ErrUnavailable)
	}
	c := &Client{sess: sess, timeout: timeout}
	newTransport := func(headerTimeout time.Duration) *http.Transport {
		return &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return sess.Open()
			},
			MaxResponseHeaderBytes: maxHeaderBytes,
			ResponseHeaderTimeout:  headerTimeout,
			DisableCompression:     true,
			MaxIdleConns:           16,
			MaxIdleConnsPerHost:    16,
			// Below the agent's own idle timeout (5 s; it closes idle
			// streams to free their buffers), so an idle stream is always
			// dropped here first and a request never races the agent's
			// close (a streamed body, as in WriteFile, cannot be retried).
			IdleConnTimeout: 3 * time.Second,
		}
	}
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	c.hc = &http.Client{Transport: newTransport(c.timeout), CheckRedirect: noRedirect}
	return c, nil
}

// Close ends the session and every call on it.
func (c *Client) Close() error {
	c.closeExecStreams()
	c.hc.CloseIdleConnections()
	return c.sess.Close()
}

// Done is closed when the session dies (agent gone, stream broken, Close).
func (c *Client) Done() <-chan struct{} { return c.sess.CloseChan() }

// call is one request to the agent.
type call struct {
	method, path string
	query        url.Values
	body         io.Reader
	contentType  string
	deadline     time.Duration // whole-call bound; 0 = c.timeout
}

// errCallTimeout is the cancellation cause when a bound of this package
// (not the caller's context) ends a call.
var errCallTimeout = errors.New("agent did not answer in time")

// callCtl controls one call's context.
type callCtl struct {
	ctx      context.Context
	cancel   context.CancelCauseFunc
	deadline *time.Timer // of a bounded call
}

// done releases the call.
func (cc *callCtl) done() {
	if cc.deadline != nil {
		cc.deadline.Stop()
	}
	cc.cancel(context.Canceled)
}

// expireAfter ends the call as timed out after d unless stopped.
func (cc *callCtl) expireAfter(d time.Duration) *time.Timer {
	return time.AfterFunc(d, func() { cc.cancel(errCallTimeout) })
}

// roundTrip sends the request and returns the response once its status is
// 2xx; an error response is decoded into a sentinel error. A bounded call
// must finish within its deadline. The caller must call done after
// consuming the body.
func (c *Client) roundTrip(ctx context.Context, cl call, bounded bool) (*http.Response, *callCtl, error) {
	cctx, cancel := context.WithCancelCause(ctx)
	cc := &callCtl{ctx: cctx, cancel: cancel}
	if bounded {
		d := cl.deadline
		if d == 0 {
			d = c.timeout
		}
		cc.deadline = cc.expireAfter(d)
	}
	u := "http://agent" + cl.path
	if len(cl.query) > 0 {
		u += "?" + cl.query.Encode()
	}
	req, err := http.NewRequestWithContext(cctx, cl.method, u, cl.body)
	if err != nil {
		cc.done()
		return nil, nil, fmt.Errorf("agent %s %s: %w: %w", cl.method, cl.path, err, errdefs.ErrInvalidArgument)
	}
	if cl.contentType != "" {
		req.Header.Set("Content-Type", cl.contentType)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		err = transportError(cctx, cl, err)
		cc.done()
		return nil, nil, err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		// Even for unbounded (streaming) calls, an error body must come
		// promptly.
		t := cc.expireAfter(c.timeout)
		err := decodeError(cctx, cl, resp)
		t.Stop()
		resp.Body.Close()
		cc.done()
		return nil, nil, err
	}
	return resp, cc, nil
}

// transportError classifies a failure to talk to the agent; ctx is the
// call's own context.
func transportError(ctx context.Context, cl call, err error) error {
	if ctx.Err() == nil && errors.Is(err, context.Canceled) {
		ctx = context.Background() // not ours: treat as a broken stream
	}
	if ctx.Err() != nil {
		cause := context.Cause(ctx)
		switch {
		case errors.Is(cause, errCallTimeout):
			return fmt.Errorf("agent %s %s: %w: %w", cl.method, cl.path, errCallTimeout, errdefs.ErrTimeout)
		case errors.Is(cause, context.DeadlineExceeded):
			return fmt.Errorf("agent %s %s: no answer in time: %w: %w", cl.method, cl.path, errdefs.ErrTimeout, context.DeadlineExceeded)
		default:
			return fmt.Errorf("agent %s %s: %w", cl.method, cl.path, context.Canceled)
		}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("agent %s %s: no answer in time: %w", cl.method, cl.path, errdefs.ErrTimeout)
	}
	return fmt.Errorf("agent %s %s: %s: %w", cl.method, cl.path, sanitize(err.Error()), errdefs.ErrUnavailable)
}

// decodeError turns a non-2xx response into a sentinel error.
func decodeError(ctx context.Context, cl call, resp *http.Response) error {
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	if err != nil {
		return transportError(ctx, cl, err)
	}
	return errorFromBody(cl.method+" "+cl.path, resp.StatusCode, b)
}

func errorFromBody(what string, status int, b []byte) error {
	var e api.Error
	if json.Unmarshal(b, &e) != nil || e.Error.Code == "" {
		return fmt.Errorf("agent %s: unexpected status %d: %w", what, status, errdefs.ErrUnavailable)
	}
	sentinel := errdefs.FromCode(e.Error.Code)
	if sentinel == nil {
		// "internal" or an invented code: the agent failed, the caller did
		// nothing wrong.
		sentinel = errdefs.ErrUnavailable
	}
	return fmt.Errorf("agent: %s: %w", sanitize(e.Error.Message), sentinel)
}

// sanitize truncates an untrusted message and removes control characters.
func sanitize(s string) string {
	cut := len(s) > maxMessage
	if cut {
		s = s[:maxMessage]
	}
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || r == utf8.RuneError {
			return -1
		}
		return r
	}, s)
	if cut {
		s += "…"
	}
	return s
}

// doJSON performs a bounded call and decodes a JSON response of at most
// limit bytes into out (nil: discard a small body).
func (c *Client) doJSON(ctx context.Context, cl call, in, out any, limit int64) error {
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("encoding request: %w: %w", err, errdefs.ErrInvalidArgument)
		}
		if len(b) > agentproto.MaxJSONBody {
			return fmt.Errorf("request body exceeds %d bytes: %w", agentproto.MaxJSONBody, errdefs.ErrTooLarge)
		}
		cl.body, cl.contentType = bytes.NewReader(b), "application/json"
	}
	resp, cc, err := c.roundTrip(ctx, cl, true)
	if err != nil {
		return err
	}
	defer cc.done()
	defer resp.Body.Close()
	// The agent writes a JSON answer in one piece once it has it: once the
	// headers are here the body must follow promptly (this matters for an
	// exec without timeout, whose call deadline is far away).
	t := cc.expireAfter(c.timeout)
	defer t.Stop()
	if out == nil {
		limit = maxErrorBody
	}
	return readJSON(cc.ctx, cl, resp, out, limit)
}

// readJSON reads a bounded JSON body; ctx is the call's own context.
func readJSON(ctx context.Context, cl call, resp *http.Response, out any, limit int64) error {
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err == nil && ctx.Err() != nil {
		err = ctx.Err() // a cut-off body may read as a clean EOF
	}
	if err != nil {
		return transportError(ctx, cl, err)
	}
	if int64(len(b)) > limit {
		return fmt.Errorf("agent %s %s: response exceeds %d bytes: %w", cl.method, cl.path, limit, errdefs.ErrUnavailable)
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("agent %s %s: malformed response: %s: %w", cl.method, cl.path, sanitize(err.Error()), errdefs.ErrUnavailable)
	}
	return nil
}

// Health asks the agent for its version and pid.
func (c *Client) Health(ctx context.Context) (agentproto.Health, error) {
	var h agentproto.Health
	err := c.doJSON(ctx, call{method: http.MethodGet, path: agentproto.PathHealth}, nil, &h, agentproto.MaxJSONBody)
	return h, err
}

// StartProc starts a long-lived process whose output the agent buffers.
func (c *Client) StartProc(ctx context.Context, req agentproto.ProcStart) (agentproto.ProcInfo, error) {
	var pi agentproto.ProcInfo
	err := c.doJSON(ctx, call{method: http.MethodPost, path: agentproto.PathProcs}, req, &pi, agentproto.MaxJSONBody)
	return pi, err
}

// Procs lists the processes the agent tracks.
func (c *Client) Procs(ctx context.Context) ([]agentproto.ProcInfo, error) {
	var out []agentproto.ProcInfo
	err := c.doJSON(ctx, call{method: http.MethodGet, path: agentproto.PathProcs}, nil, &out, 8*agentproto.MaxJSONBody)
	return out, err
}

func procPath(id string, suffix string) string {
	return agentproto.PathProcs + "/" + url.PathEscape(id) + suffix
}

// Proc describes one process.
func (c *Client) Proc(ctx context.Context, id string) (agentproto.ProcInfo, error) {
	var pi agentproto.ProcInfo
	err := c.doJSON(ctx, call{method: http.MethodGet, path: procPath(id, "")}, nil, &pi, agentproto.MaxJSONBody)
	return pi, err
}

// ForgetProc kills the process if it still runs and drops its buffers.
func (c *Client) ForgetProc(ctx context.Context, id string) error {
	return c.doJSON(ctx, call{method: http.MethodDelete, path: procPath(id, "")}, nil, nil, 0)
}

// Signal sends sig ("TERM", "KILL", a number…) to the process's group.
func (c *Client) Signal(ctx context.Context, id, sig string) error {
	return c.doJSON(ctx, call{method: http.MethodPost, path: procPath(id, "/signal")}, api.SignalRequest{Signal: sig}, nil, 0)
}

// Attach opens the process's attach WebSocket (frames of package api),
// replaying output from the given offsets. ctx bounds only the handshake.
// The connection's read limit is api.MaxFrame.
func (c *Client) Attach(ctx context.Context, id string, stdoutOff, stderrOff int64) (*websocket.Conn, error) {
	q := url.Values{}
	q.Set("stdout_offset", strconv.FormatInt(stdoutOff, 10))
	q.Set("stderr_offset", strconv.FormatInt(stderrOff, 10))
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	path := procPath(id, "/attach")
	conn, resp, err := websocket.Dial(ctx, "ws://agent"+path+"?"+q.Encode(), &websocket.DialOptions{
		HTTPClient:      c.hc,
		CompressionMode: websocket.CompressionDisabled,
	})
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols && resp.Body != nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
			return nil, errorFromBody("GET "+path, resp.StatusCode, b)
		}
		return nil, transportError(ctx, call{method: http.MethodGet, path: path}, err)
	}
	conn.SetReadLimit(api.MaxFrame)
	return conn, nil
}

// streamBody wraps a streaming response so Close releases the call.
type streamBody struct {
	io.ReadCloser
	done func()
}

func (s *streamBody) Close() error {
	err := s.ReadCloser.Close()
	s.done()
	return err
}

func (c *Client) stream(ctx context.Context, cl call) (io.ReadCloser, error) {
	resp, cc, err := c.roundTrip(ctx, cl, false)
	if err != nil {
		return nil, err
	}
	return &streamBody{ReadCloser: resp.Body, done: cc.done}, nil
}

// FileOption changes how a file operation is performed.
type FileOption func(*fileOptions)

type fileOptions struct {
	user  string
	exact bool
}

// Exact has the agent refuse every symlink on the way to the path: the
// path is one Resolve returned and a policy decided on (see
// agentproto.QueryExact).
func Exact() FileOption { return func(o *fileOptions) { o.exact = true } }

// AsUser performs a file operation as this sandbox user ("name", "uid" or
// "uid:gid", resolved by the agent like an exec's user): the sandbox's
// kernel checks its permissions and new files belong to it. "" is root.
func AsUser(user string) FileOption { return func(o *fileOptions) { o.user = user } }

// fileQuery is the query of a file operation on p (no path when p is "").
func fileQuery(p string, opts []FileOption) url.Values {
	var o fileOptions
	for _, f := range opts {
		f(&o)
	}
	q := url.Values{}
	if p != "" {
		q.Set("path", p)
	}
	if o.user != "" {
		q.Set(agentproto.QueryUser, o.user)
	}
	if o.exact {
		q.Set(agentproto.QueryExact, "1")
	}
	return q
}

// Resolve returns the path the sandbox's kernel reaches for path, its
// symlinks resolved inside the sandbox's root; the final component too
// when followLeaf (see agentproto.PathFilesResolve).
func (c *Client) Resolve(ctx context.Context, path string, followLeaf bool) (string, error) {
	q := url.Values{"path": {path}, "leaf": {"name"}}
	if followLeaf {
		q.Set("leaf", "follow")
	}
	var out agentproto.Resolved
	if err := c.doJSON(ctx, call{method: http.MethodGet, path: agentproto.PathFilesResolve, query: q}, nil, &out, agentproto.MaxJSONBody); err != nil {
		return "", err
	}
	if !strings.HasPrefix(out.Path, "/") || len(out.Path) > agentproto.MaxPathLen || strings.IndexByte(out.Path, 0) >= 0 {
		return "", fmt.Errorf("agent resolved %q to an invalid path", path)
	}
	return out.Path, nil
}

// ReadFile streams a regular file. Reading is bounded by ctx only; the
// caller must Close the reader.
func (c *Client) ReadFile(ctx context.Context, path string, opts ...FileOption) (io.ReadCloser, error) {
	return c.stream(ctx, call{method: http.MethodGet, path: agentproto.PathFiles, query: fileQuery(path, opts)})
}

// upload sends a streaming body and reads a bounded JSON answer.
func (c *Client) upload(ctx context.Context, cl call, out any) error {
	resp, cc, err := c.roundTrip(ctx, cl, false)
	if err != nil {
		return err
	}
	defer cc.done()
	defer resp.Body.Close()
	// The upload may take long; the answer after it may not.
	t := cc.expireAfter(c.timeout)
	defer t.Stop()
	limit := int64(agentproto.MaxJSONBody)
	if out == nil {
		limit = maxErrorBody
	}
	return readJSON(cc.ctx, cl, resp, out, limit)
}

// WriteFile atomically replaces path with r's content. mode 0 keeps the
// mode of an existing file (0644 for a new one). The parent must exist.
func (c *Client) WriteFile(ctx context.Context, path string, mode os.FileMode, r io.Reader, opts ...FileOption) (api.FileInfo, error) {
	q := fileQuery(path, opts)
	if m := uint32(mode.Perm()) | modeExtra(mode); m != 0 {
		q.Set("mode", strconv.FormatUint(uint64(m), 8))
	}
	var fi api.FileInfo
	err := c.upload(ctx, call{method: http.MethodPut, path: agentproto.PathFiles, query: q, body: r, contentType: "application/octet-stream"}, &fi)
	return fi, err
}

// modeExtra converts Go's setuid/setgid/sticky bits to their Unix values.
func modeExtra(m os.FileMode) uint32 {
	var x uint32
	if m&os.ModeSetuid != 0 {
		x |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		x |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		x |= 0o1000
	}
	return x
}

// Stat describes path without following a final symlink.
func (c *Client) Stat(ctx context.Context, path string, opts ...FileOption) (api.FileInfo, error) {
	var fi api.FileInfo
	err := c.doJSON(ctx, call{method: http.MethodGet, path: agentproto.PathFilesStat, query: fileQuery(path, opts)}, nil, &fi, agentproto.MaxJSONBody)
	return fi, err
}

// List describes the entries of a directory.
func (c *Client) List(ctx context.Context, path string, opts ...FileOption) ([]api.FileInfo, error) {
	var fl api.FileList
	err := c.doJSON(ctx, call{method: http.MethodGet, path: agentproto.PathFilesList, query: fileQuery(path, opts)}, nil, &fl, agentproto.MaxJSONBody)
	return fl.Entries, err
}

// Mkdir creates path and its missing parents (mode 0 means 0755).
func (c *Client) Mkdir(ctx context.Context, path string, mode os.FileMode, opts ...FileOption) (api.FileInfo, error) {
	var fi api.FileInfo
	req := api.MkdirRequest{Path: path, Mode: uint32(mode.Perm()) | modeExtra(mode)}
	err := c.doJSON(ctx, call{method: http.MethodPost, path: agentproto.PathFilesMkdir, query: fileQuery("", opts)}, req, &fi, agentproto.MaxJSONBody)
	return fi, err
}

// Remove deletes path; a non-empty directory only when recursive.
func (c *Client) Remove(ctx context.Context, path string, recursive bool, opts ...FileOption) error {
	q := fileQuery(path, opts)
	if recursive {
		q.Set("recursive", "1")
	}
	return c.doJSON(ctx, call{method: http.MethodDelete, path: agentproto.PathFiles, query: q}, nil, nil, 0)
}

// Rename moves from to to.
func (c *Client) Rename(ctx context.Context, from, to string, opts ...FileOption) error {
	return c.doJSON(ctx, call{method: http.MethodPost, path: agentproto.PathFilesRename, query: fileQuery("", opts)}, api.RenameRequest{From: from, To: to}, nil, 0)
}

// TarGet streams a tar of path (a directory's entries relative to it, or
// one file). The caller must Close the reader.
func (c *Client) TarGet(ctx context.Context, path string, opts ...FileOption) (io.ReadCloser, error) {
	return c.stream(ctx, call{method: http.MethodGet, path: agentproto.PathFilesTar, query: fileQuery(path, opts)})
}

// TarPut extracts the tar stream r below directory path (created if missing).
func (c *Client) TarPut(ctx context.Context, path string, r io.Reader, opts ...FileOption) error {
	return c.upload(ctx, call{method: http.MethodPut, path: agentproto.PathFilesTar, query: fileQuery(path, opts), body: r, contentType: "application/x-tar"}, nil)
}

// Quiesce asks the agent to close its listener and every host connection,
// this client's session included, before a checkpoint (agentproto.PathQuiesce).
// The caller closes the client afterwards; the agent listens again when its
// runtime lets it.
func (c *Client) Quiesce(ctx context.Context) error {
	return c.doJSON(ctx, call{method: http.MethodPost, path: agentproto.PathQuiesce}, nil, nil, 0)
}

// Restored tells the agent it was restored or forked: it mixes r.Seed into
// the kernel's entropy pool and takes r.Hostname (agentproto.PathRestored).
func (c *Client) Restored(ctx context.Context, r agentproto.Restored) error {
	return c.doJSON(ctx, call{method: http.MethodPost, path: agentproto.PathRestored}, r, nil, 0)
}
