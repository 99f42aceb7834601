package sdk

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// ExecStream is POST /v1/sandboxes/{id}/exec/stream: req runs as a command
// session (no TTY) started and attached in one request, req.Stdin written
// and closed. It returns once the command has started; the Session's Wait
// writes the output to opts.Stdout and opts.Stderr as it is produced and
// returns the exit status, re-attaching at the offsets received if the
// stream breaks (as Attach's sessions do). Signal goes through POST
// …/signal; the session has no stdin and no resize.
//
// A server without the route answers ErrNotFound, as for a missing
// sandbox: a caller that must work with older servers falls back to
// CreateCommand and Attach, which then says which it was.
func (c *Client) ExecStream(ctx context.Context, sandboxID string, req api.ExecRequest, opts AttachOptions) (*Session, error) {
	if err := checkID("sandbox", sandboxID); err != nil {
		return nil, err
	}
	if len(req.Cmd) == 0 {
		return nil, fmt.Errorf("exec: empty command: %w", errdefs.ErrInvalidArgument)
	}
	resp, err := c.send(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + seg(sandboxID) + "/exec/stream", json: req})
	if err != nil {
		return nil, err
	}
	cmdID := resp.Header.Get("Space-Command-Id")
	if err := checkID("command", cmdID); err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("exec stream: the server named no valid command (%q): %w", cmdID, errdefs.ErrUnprocessable)
	}
	s := &Session{
		client:          c,
		ctx:             ctx,
		sandboxID:       sandboxID,
		cmdID:           cmdID,
		stdout:          orDiscard(opts.Stdout),
		stderr:          orDiscard(opts.Stderr),
		onDropped:       opts.OnDropped,
		reattachTimeout: opts.ReattachTimeout,
		stream:          resp.Body,
	}
	if s.reattachTimeout == 0 {
		s.reattachTimeout = DefaultReattachTimeout
	}
	s.path, _ = commandPath(sandboxID, cmdID)
	s.path += "/attach"
	s.Stdin = &stdinWriter{s: s}
	return s, nil
}

// waitStream reads an ExecStream's frames. done: the exit frame came (or
// a final error); otherwise the stream broke and s.conn is a re-attach at
// the offsets delivered, for wait's loop to go on with.
func (s *Session) waitStream() (st api.ExitStatus, done bool, err error) {
	body := s.stream
	br := bufio.NewReaderSize(body, 64<<10)
	frame := make([]byte, api.MaxFrame)
	var readErr error
	for {
		var n [4]byte
		if _, readErr = io.ReadFull(br, n[:]); readErr != nil {
			break
		}
		size := binary.BigEndian.Uint32(n[:])
		if size == 0 || size > api.MaxFrame {
			body.Close()
			s.markClosed()
			return st, true, protocolError(fmt.Sprintf("stream frame of %d bytes", size))
		}
		if _, readErr = io.ReadFull(br, frame[:size]); readErr != nil {
			break
		}
		if err := s.handle(frame[:size], &st); err != nil {
			body.Close()
			s.markClosed()
			if err == errExit {
				return st, true, nil
			}
			return st, true, err
		}
	}
	body.Close()
	if ctxErr := s.ctx.Err(); ctxErr != nil {
		s.markClosed()
		return st, true, ctxErr
	}
	s.mu.Lock()
	closed := s.closed
	s.stream = nil
	s.mu.Unlock()
	if closed {
		return st, true, fmt.Errorf("exec %s/%s: stream lost before exit: %w", s.sandboxID, s.cmdID, readErr)
	}
	nc, err := s.reattach(time.Now().Add(max(s.reattachTimeout, 0)))
	if err != nil {
		s.markClosed()
		return st, true, fmt.Errorf("exec %s/%s: stream lost (%w) and re-attach failed: %w", s.sandboxID, s.cmdID, readErr, err)
	}
	s.mu.Lock()
	s.conn = nc
	s.mu.Unlock()
	return st, false, nil
}

// errNoStdin is what an ExecStream session's stdin answers: the server
// wrote req.Stdin and closed it.
var errNoStdin = errors.New("an exec stream's stdin is closed (req.Stdin is sent with the request)")
