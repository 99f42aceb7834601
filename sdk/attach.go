package sdk

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// AttachOptions says where a session's output goes and where it resumes.
type AttachOptions struct {
	Stdout io.Writer // nil discards
	Stderr io.Writer // nil discards; also receives "[space: …]" notes
	// StdoutOffset and StderrOffset resume the streams at these absolute
	// offsets (0 = from the start of what the server still buffers).
	StdoutOffset, StderrOffset int64
	// ReattachTimeout bounds how long Wait keeps trying to re-attach after
	// a drop while the server cannot be reached or answers "unavailable"
	// (a restart, a network blip); 0 means DefaultReattachTimeout, a
	// negative value one attempt only.
	ReattachTimeout time.Duration
	// OnDropped, when set, is told of output that was lost (overwritten in
	// the server's bounded buffer before it was delivered): n bytes of
	// stream ("stdout" or "stderr"), in order with the writes. Set, it
	// replaces the "[space: …]" note on Stderr, so a caller that pages
	// output by offset (the MCP server) keeps Stderr the process's own.
	OnDropped func(stream string, n int64)
}

// DefaultReattachTimeout is how long Wait tries to re-attach by default:
// long enough for a server to restart under a running command.
const DefaultReattachTimeout = 60 * time.Second

// Backoff between re-attach attempts: doubling from the first to the last.
const (
	reattachBackoffMin = 100 * time.Millisecond
	reattachBackoffMax = 2 * time.Second
)

// ErrSessionClosed is returned by writes to a session that has ended.
var ErrSessionClosed = errors.New("command session closed")

// Session is one attachment to a command session (see Client.Attach).
//
// Stdin forwards bytes to the process; closing it sends EOF. Wait must be
// called to receive output; it returns when the process exits. If the
// connection drops before that, Wait re-attaches, resuming at the offsets it
// has already delivered, so no output is duplicated or skipped. While the
// server cannot be reached or answers "unavailable" (it is restarting) the
// re-attach is retried with backoff for up to AttachOptions.ReattachTimeout;
// a re-attached connection that drops before delivering a frame is final.
// The process runs on meanwhile; stdin written while no connection is up
// fails.
type Session struct {
	// Stdin writes to the process's stdin; Close sends EOF.
	Stdin io.WriteCloser

	client    *Client
	ctx       context.Context
	sandboxID string
	cmdID     string
	path      string // attach path on the server
	stdout    io.Writer
	stderr    io.Writer
	onDropped func(stream string, n int64)

	mu      sync.Mutex
	conn    *websocket.Conn
	token   string
	closed  bool
	pid     int
	offsets [2]int64 // next expected offset of stdout, stderr

	reattachTimeout time.Duration

	// stream is an ExecStream's response body while its frames are read
	// (conn is nil until a re-attach replaces it).
	stream io.ReadCloser

	// until, when hasUntil, ends Wait once both streams are delivered up
	// to these offsets (ReadOutput: the output so far, not followed).
	until    [2]int64
	hasUntil bool

	waitOnce sync.Once
	status   api.ExitStatus
	waitErr  error
}

// Attach opens the command's attach WebSocket. cmd is what CreateCommand or
// GetCommand returned; without an attach token a fresh one is requested. ctx
// bounds the whole session, Wait included.
func (c *Client) Attach(ctx context.Context, cmd *api.Command, opts AttachOptions) (*Session, error) {
	if cmd == nil {
		return nil, fmt.Errorf("attach: nil command: %w", errdefs.ErrInvalidArgument)
	}
	p, err := commandPath(cmd.SandboxID, cmd.ID)
	if err != nil {
		return nil, err
	}
	if opts.StdoutOffset < 0 || opts.StderrOffset < 0 {
		return nil, fmt.Errorf("attach: negative offset: %w", errdefs.ErrInvalidArgument)
	}
	s := &Session{
		client:    c,
		ctx:       ctx,
		sandboxID: cmd.SandboxID,
		cmdID:     cmd.ID,
		path:      p + "/attach",
		stdout:    orDiscard(opts.Stdout),
		stderr:    orDiscard(opts.Stderr),
		onDropped: opts.OnDropped,
		token:     cmd.AttachToken,
		offsets:   [2]int64{opts.StdoutOffset, opts.StderrOffset},

		reattachTimeout: opts.ReattachTimeout,
	}
	if s.reattachTimeout == 0 {
		s.reattachTimeout = DefaultReattachTimeout
	}
	// The server names the attach path; only a path on this same server is
	// honoured, so the token is never sent anywhere else.
	if strings.HasPrefix(cmd.AttachURL, "/v1/") {
		s.path = cmd.AttachURL
	}
	s.Stdin = &stdinWriter{s: s}
	if s.token == "" {
		if err := s.refreshToken(); err != nil {
			return nil, err
		}
	}
	conn, err := s.dial()
	if err != nil {
		return nil, err
	}
	s.conn = conn
	return s, nil
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

func (s *Session) refreshToken() error {
	cmd, err := s.client.RefreshAttachToken(s.ctx, s.sandboxID, s.cmdID)
	if err != nil {
		return fmt.Errorf("attach %s/%s: refreshing token: %w", s.sandboxID, s.cmdID, err)
	}
	if cmd.AttachToken == "" {
		return fmt.Errorf("attach %s/%s: server returned no token: %w", s.sandboxID, s.cmdID, errdefs.ErrUnavailable)
	}
	s.token = cmd.AttachToken
	return nil
}

// dial opens a connection resuming at the current offsets.
func (s *Session) dial() (*websocket.Conn, error) {
	q := url.Values{}
	s.mu.Lock()
	q.Set("stdout_offset", strconv.FormatInt(s.offsets[0], 10))
	q.Set("stderr_offset", strconv.FormatInt(s.offsets[1], 10))
	token := s.token
	s.mu.Unlock()
	h := http.Header{}
	h.Set("Authorization", "Bearer "+token)
	if s.client.UserAgent != "" {
		h.Set("User-Agent", s.client.UserAgent)
	}
	conn, resp, err := websocket.Dial(s.ctx, s.client.url(s.path, q), &websocket.DialOptions{
		HTTPClient: s.client.HTTP,
		HTTPHeader: h,
	})
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols && resp.StatusCode >= 300 {
			return nil, fmt.Errorf("attach %s/%s: %w", s.sandboxID, s.cmdID, decodeError(resp))
		}
		return nil, fmt.Errorf("attach %s/%s: %w", s.sandboxID, s.cmdID, err)
	}
	conn.SetReadLimit(api.MaxFrame)
	return conn, nil
}

// Pid is the process id inside the sandbox, once the server has said so.
func (s *Session) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pid
}

// Offsets are the stdout and stderr offsets delivered so far; pass them as
// AttachOptions to resume elsewhere without duplicates.
func (s *Session) Offsets() (stdout, stderr int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.offsets[0], s.offsets[1]
}

// send writes one frame on the current connection.
func (s *Session) send(frame []byte) error {
	s.mu.Lock()
	conn, closed, stream := s.conn, s.closed, s.stream
	s.mu.Unlock()
	if conn == nil && stream != nil && !closed {
		return errNoStdin
	}
	if closed || conn == nil {
		return ErrSessionClosed
	}
	if err := conn.Write(s.ctx, websocket.MessageBinary, frame); err != nil {
		return fmt.Errorf("attach %s/%s: sending frame: %w", s.sandboxID, s.cmdID, err)
	}
	return nil
}

func (s *Session) sendJSON(typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return s.send(append([]byte{typ}, b...))
}

// Resize tells a TTY session its new window size.
func (s *Session) Resize(rows, cols uint16) error {
	if rows == 0 || cols == 0 {
		return fmt.Errorf("resize to %dx%d: %w", rows, cols, errdefs.ErrInvalidArgument)
	}
	return s.sendJSON(api.FrameResize, api.Resize{Rows: rows, Cols: cols})
}

// Signal sends a signal ("INT", "TERM", "KILL", … or a number) to the process.
func (s *Session) Signal(sig string) error {
	if sig == "" {
		return fmt.Errorf("signal: empty: %w", errdefs.ErrInvalidArgument)
	}
	s.mu.Lock()
	streaming := s.conn == nil && s.stream != nil
	s.mu.Unlock()
	if streaming { // an ExecStream's frames only come from the server
		return s.client.SignalCommand(s.ctx, s.sandboxID, s.cmdID, sig)
	}
	return s.sendJSON(api.FrameSignal, api.SignalRequest{Signal: sig})
}

// Close detaches without waiting for the process, which keeps running on the
// server; its output stays buffered for a later Attach.
func (s *Session) Close() error {
	s.mu.Lock()
	conn, stream := s.conn, s.stream
	s.closed = true
	s.mu.Unlock()
	if stream != nil {
		stream.Close()
	}
	if conn == nil {
		return nil
	}
	return conn.Close(websocket.StatusNormalClosure, "detach")
}

type stdinWriter struct {
	s         *Session
	closeOnce sync.Once
}

func (w *stdinWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), api.MaxFrame-1)]
		frame := make([]byte, 1+len(chunk))
		frame[0] = api.FrameStdin
		copy(frame[1:], chunk)
		if err := w.s.send(frame); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

func (w *stdinWriter) Close() error {
	var err error
	w.closeOnce.Do(func() { err = w.s.send([]byte{api.FrameCloseStdin}) })
	return err
}

// Wait delivers output until the process exits and returns how it ended.
// Calling it again returns the same result.
func (s *Session) Wait() (api.ExitStatus, error) {
	s.waitOnce.Do(func() { s.status, s.waitErr = s.wait() })
	return s.status, s.waitErr
}

// errExit ends the read loop after the exit frame.
var errExit = errors.New("exit")

// errUntil ends the read loop of a ReadOutput session at its offsets.
var errUntil = errors.New("read up to the requested offsets")

// reachedUntil reports whether a ReadOutput session has delivered what it
// was asked for.
func (s *Session) reachedUntil() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hasUntil && s.offsets[0] >= s.until[0] && s.offsets[1] >= s.until[1]
}

func (s *Session) wait() (api.ExitStatus, error) {
	var st api.ExitStatus
	s.mu.Lock()
	streaming := s.stream != nil
	s.mu.Unlock()
	if streaming {
		var done bool
		var err error
		if st, done, err = s.waitStream(); done {
			return st, err
		}
	}
	progressed := true // the first connection may be replaced at least once
	for {
		s.mu.Lock()
		conn := s.conn
		s.mu.Unlock()
		typ, data, err := conn.Read(s.ctx)
		if err == nil {
			if typ != websocket.MessageBinary {
				err = protocolError("text message")
			} else {
				err = s.handle(data, &st)
			}
			if err == nil && s.reachedUntil() {
				err = errUntil
			}
			if err == errExit || err == errUntil {
				conn.Close(websocket.StatusNormalClosure, "")
				s.markClosed()
				if err == errUntil {
					return st, errUntil
				}
				return st, nil
			}
			if err != nil {
				conn.Close(websocket.StatusProtocolError, "bad frame")
				s.markClosed()
				return st, err
			}
			progressed = true
			continue
		}
		if ctxErr := s.ctx.Err(); ctxErr != nil {
			s.markClosed()
			return st, ctxErr
		}
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		if closed || !progressed {
			// A connection that the server accepted and dropped before a
			// single frame is not retried: that server is up and will not
			// serve this session.
			return st, fmt.Errorf("attach %s/%s: connection lost before exit: %w", s.sandboxID, s.cmdID, err)
		}
		// Re-attach for this drop, retrying while the server is unreachable.
		progressed = false
		conn.CloseNow()
		nc, derr := s.reattach(time.Now().Add(max(s.reattachTimeout, 0)))
		if derr != nil {
			s.markClosed()
			return st, fmt.Errorf("attach %s/%s: connection lost (%w) and re-attach failed: %w", s.sandboxID, s.cmdID, err, derr)
		}
		s.mu.Lock()
		s.conn = nc
		s.mu.Unlock()
	}
}

// reattach dials the session again, resuming at the delivered offsets. A
// fresh token is asked for first because attach tokens are short-lived; if
// that is impossible (no API key) the old one may still be valid. Attempts
// that fail because the server cannot be reached or is unavailable (a
// restart) are repeated with backoff until giveUp; any other answer is
// final.
func (s *Session) reattach(giveUp time.Time) (*websocket.Conn, error) {
	var backoff time.Duration
	for {
		if backoff > 0 {
			if err := sleepCtx(s.ctx, min(backoff, max(time.Until(giveUp), 0))); err != nil {
				return nil, err
			}
		}
		backoff = min(max(2*backoff, reattachBackoffMin), reattachBackoffMax)
		var err error
		if s.client.APIKey != "" {
			if err = s.refreshToken(); err != nil && !transient(err) {
				err = nil // the dial below says whether the session is gone
			}
		}
		if err == nil {
			var nc *websocket.Conn
			if nc, err = s.dial(); err == nil {
				return nc, nil
			}
		}
		if !transient(err) || s.ctx.Err() != nil || !time.Now().Before(giveUp) {
			return nil, err
		}
	}
}

// transient reports whether a failed attach is worth repeating: the server
// could not be reached at all, or said it is unavailable for now.
func transient(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ae *APIError
	if errors.As(err, &ae) {
		return retryable(err)
	}
	return true
}

func (s *Session) markClosed() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
}

func protocolError(what string) error {
	return fmt.Errorf("attach protocol: %s: %w", what, errdefs.ErrUnprocessable)
}

// handle processes one frame from the server, which is not trusted to be
// well-formed: sizes, offsets and JSON are all checked.
func (s *Session) handle(frame []byte, st *api.ExitStatus) error {
	f, err := api.DecodeFrame(frame)
	if err != nil {
		return protocolError(err.Error())
	}
	switch f.Type {
	case api.FrameStarted:
		s.mu.Lock()
		s.pid = f.Started.Pid
		s.mu.Unlock()
		return nil
	case api.FrameStdout, api.FrameStderr:
		return s.output(int(f.Type-api.FrameStdout), f.Offset, f.Data)
	case api.FrameDropped:
		d := f.Dropped
		i := 0 // DecodeFrame let through only stdout and stderr
		if d.Stream == "stderr" {
			i = 1
		}
		s.mu.Lock()
		n := d.To - max(d.From, s.offsets[i])
		if d.To > s.offsets[i] {
			s.offsets[i] = d.To
		}
		s.mu.Unlock()
		if n > 0 {
			s.droppedNote(d.Stream, n)
		}
		return nil
	case api.FrameExit:
		*st = f.Exit
		return errExit
	}
	return protocolError(fmt.Sprintf("unexpected frame type %d", f.Type))
}

// output writes the part of data that was not delivered yet. Bytes before
// the expected offset are duplicates (a replay after re-attach) and are
// skipped; a jump forward means output was lost and is reported as such.
func (s *Session) output(i int, off int64, data []byte) error {
	s.mu.Lock()
	next := s.offsets[i]
	end := off + int64(len(data))
	var gap int64
	switch {
	case end <= next:
		s.mu.Unlock()
		return nil
	case off < next:
		data = data[next-off:]
	case off > next:
		gap = off - next
	}
	s.offsets[i] = end
	s.mu.Unlock()
	name, w := "stdout", s.stdout
	if i == 1 {
		name, w = "stderr", s.stderr
	}
	if gap > 0 {
		s.droppedNote(name, gap)
	}
	if _, err := w.Write(data); err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// droppedNote tells the user, on stderr, that output was lost; the same
// words for both streams so scripts can grep for them. An OnDropped
// callback takes the note's place.
func (s *Session) droppedNote(stream string, n int64) {
	if s.onDropped != nil {
		s.onDropped(stream, n)
		return
	}
	fmt.Fprintf(s.stderr, "[space: %d bytes of output were dropped]\n", n)
}

// ReadOutput writes what a command has output so far to opts.Stdout and
// opts.Stderr — from opts' offsets, as much as the server still buffers
// (a lost part is a "[space: … dropped]" note on Stderr) — without
// following it. cmd should be fresh from GetCommand: for a running
// command the read stops at the end offsets the server reported then
// (StdoutBytes, StderrBytes) and the status is nil; for one that has
// exited it reads to the end and returns how it ended. A command that has
// not started has no output, and is not started by this (an attach
// would start it).
func (c *Client) ReadOutput(ctx context.Context, cmd *api.Command, opts AttachOptions) (*api.ExitStatus, error) {
	if cmd == nil {
		return nil, fmt.Errorf("read output: nil command: %w", errdefs.ErrInvalidArgument)
	}
	running := cmd.State == api.CommandRunning
	switch {
	case cmd.State == api.CommandCreated:
		return nil, nil
	case running && opts.StdoutOffset >= cmd.StdoutBytes && opts.StderrOffset >= cmd.StderrBytes:
		return nil, nil // nothing new: no need to attach
	}
	// The attach token is not wanted here: a fresh one is asked for.
	c2 := *cmd
	c2.AttachToken = ""
	sess, err := c.Attach(ctx, &c2, opts)
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	if running {
		sess.mu.Lock()
		sess.until, sess.hasUntil = [2]int64{cmd.StdoutBytes, cmd.StderrBytes}, true
		sess.mu.Unlock()
	}
	// Nothing is sent: closing Stdin would close the process's stdin.
	st, err := sess.Wait()
	switch {
	case err == errUntil:
		return nil, nil
	case err != nil:
		return nil, err
	}
	return &st, nil
}

// Run runs req in the sandbox as a command session, streams its output to
// stdout and stderr, and returns its exit status. req.Stdin, if set, is sent
// to the process, then stdin is closed.
func (c *Client) Run(ctx context.Context, sandboxID string, req api.ExecRequest, stdout, stderr io.Writer) (api.ExitStatus, error) {
	stdin := req.Stdin
	req.Stdin = "" // sessions take stdin over the socket
	cmd, err := c.CreateCommand(ctx, sandboxID, api.CreateCommandRequest{ExecRequest: req})
	if err != nil {
		return api.ExitStatus{}, err
	}
	sess, err := c.Attach(ctx, cmd, AttachOptions{Stdout: stdout, Stderr: stderr})
	if err != nil {
		return api.ExitStatus{}, err
	}
	defer sess.Close()
	// Stdin goes in its own goroutine so a process that writes a lot before
	// reading cannot deadlock against us.
	go func() {
		if stdin != "" {
			if _, err := io.WriteString(sess.Stdin, stdin); err != nil {
				return
			}
		}
		_ = sess.Stdin.Close()
	}()
	return sess.Wait()
}

var _ io.WriteCloser = (*stdinWriter)(nil)
