package agentclient

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// The synchronous exec is the one call made per command, so it skips
// net/http's client: a kept yamux stream carries the HTTP/1.1 exchange,
// written and read by the calling goroutine. http.Transport would pass the
// request to its write goroutine and the response back from its read
// goroutine, two hand-offs between goroutines per call, which on a loaded
// machine cost more than the rest of the protocol. The bounds are the same:
// response headers (maxHeaderBytes), the body (the call's limit), the time
// to the headers (the call's deadline or ctx) and, once they are here, to
// the whole body (c.timeout).

// execIdleTimeout drops a kept exec stream before the agent's own idle
// timeout (5 s) closes it, so a request never races that close (an exec
// cannot be retried: it may have run).
const execIdleTimeout = 3 * time.Second

// maxIdleExecStreams is how many kept exec streams wait for reuse.
const maxIdleExecStreams = 8

// execStream is a kept yamux stream and what was read ahead on it.
type execStream struct {
	conn   net.Conn
	budget budgetReader // bounds every byte read from conn
	br     *bufio.Reader
	idle   time.Time // when it was put back
}

// budgetReader reads from r until n bytes have been read, then fails: a
// hostile agent cannot make the client read more than it allowed.
type budgetReader struct {
	r io.Reader
	n int64
}

var errOverBudget = errors.New("response exceeds its size limit")

func (b *budgetReader) Read(p []byte) (int, error) {
	if b.n <= 0 {
		return 0, errOverBudget
	}
	if int64(len(p)) > b.n {
		p = p[:b.n]
	}
	n, err := b.r.Read(p)
	b.n -= int64(n)
	return n, err
}

// execPool holds the kept exec streams of a Client.
type execPool struct {
	mu   sync.Mutex
	idle []*execStream
}

// execStream returns a kept stream or opens a new one.
func (c *Client) execStream() (*execStream, error) {
	now := time.Now()
	c.execs.mu.Lock()
	for len(c.execs.idle) > 0 {
		n := len(c.execs.idle) - 1
		s := c.execs.idle[n]
		c.execs.idle = c.execs.idle[:n]
		if now.Sub(s.idle) < execIdleTimeout {
			c.execs.mu.Unlock()
			return s, nil
		}
		s.conn.Close()
	}
	c.execs.mu.Unlock()
	conn, err := c.sess.Open()
	if err != nil {
		return nil, err
	}
	s := &execStream{conn: conn}
	s.budget.r = conn
	s.br = bufio.NewReaderSize(&s.budget, 4096)
	return s, nil
}

// putExecStream keeps s for the next exec.
func (c *Client) putExecStream(s *execStream) {
	s.conn.SetDeadline(time.Time{})
	s.idle = time.Now()
	c.execs.mu.Lock()
	if len(c.execs.idle) < maxIdleExecStreams {
		c.execs.idle = append(c.execs.idle, s)
		s = nil
	}
	c.execs.mu.Unlock()
	if s != nil {
		s.conn.Close()
	}
}

// closeExecStreams closes the kept streams (Close).
func (c *Client) closeExecStreams() {
	c.execs.mu.Lock()
	idle := c.execs.idle
	c.execs.idle = nil
	c.execs.mu.Unlock()
	for _, s := range idle {
		s.conn.Close()
	}
}

// Exec runs a process to completion. The call is bounded by the request's
// own timeout plus a grace period; without a timeout only ctx bounds it.
func (c *Client) Exec(ctx context.Context, req agentproto.ExecRequest) (api.ExecResult, error) {
	var res api.ExecResult
	maxOut := req.MaxOutputBytes
	if maxOut <= 0 || maxOut > agentproto.MaxSyncOut {
		maxOut = max(agentproto.DefaultSyncOut, min(maxOut, agentproto.MaxSyncOut))
	}
	// Two streams of output, each at most 6 bytes of JSON per byte ("\u0000").
	limit := int64(agentproto.MaxJSONBody) + 12*maxOut
	cl := call{method: http.MethodPost, path: agentproto.PathExec, deadline: 365 * 24 * time.Hour}
	if req.TimeoutSeconds > 0 && req.TimeoutSeconds < 365*24*3600 {
		cl.deadline = time.Duration(req.TimeoutSeconds*float64(time.Second)) + execGrace
	}
	body, err := json.Marshal(req)
	if err != nil {
		return res, fmt.Errorf("encoding request: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(body) > agentproto.MaxJSONBody {
		return res, fmt.Errorf("request body exceeds %d bytes: %w", agentproto.MaxJSONBody, errdefs.ErrTooLarge)
	}
	b, err := c.exchange(ctx, cl, body, limit)
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal(b, &res); err != nil {
		return res, fmt.Errorf("agent %s %s: malformed response: %s: %w", cl.method, cl.path, sanitize(err.Error()), errdefs.ErrUnavailable)
	}
	return res, nil
}

// exchange sends one JSON POST on a kept stream and returns the 2xx
// response's body (at most limit bytes); an error response becomes its
// sentinel error. The stream is kept only after a whole, well-formed
// exchange.
func (c *Client) exchange(ctx context.Context, cl call, body []byte, limit int64) ([]byte, error) {
	s, err := c.execStream()
	if err != nil {
		return nil, fmt.Errorf("agent %s %s: %s: %w", cl.method, cl.path, sanitize(err.Error()), errdefs.ErrUnavailable)
	}
	cctx, cancel := context.WithCancelCause(ctx)
	cc := &callCtl{ctx: cctx, cancel: cancel}
	cc.deadline = cc.expireAfter(cl.deadline)
	// The call's context ends the stream's reads and writes at once.
	stop := context.AfterFunc(cctx, func() { s.conn.SetDeadline(time.Unix(1, 0)) })
	keep := false
	defer func() {
		// A stream whose deadline the call's end may be setting is not
		// kept.
		if !stop() {
			keep = false
		}
		cc.done()
		if keep {
			c.putExecStream(s)
		} else {
			// Closing the stream is how the agent learns the caller
			// went away: it kills the process.
			s.conn.Close()
		}
	}()

	// One write: the request line, headers and body in one frame.
	msg := make([]byte, 0, 128+len(body))
	msg = append(msg, cl.method...)
	msg = append(msg, ' ')
	msg = append(msg, cl.path...)
	msg = append(msg, " HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: "...)
	msg = strconv.AppendInt(msg, int64(len(body)), 10)
	msg = append(msg, "\r\n\r\n"...)
	msg = append(msg, body...)
	if _, err := s.conn.Write(msg); err != nil {
		return nil, transportError(cctx, cl, err)
	}

	s.budget.n = maxHeaderBytes
	resp, err := http.ReadResponse(s.br, nil)
	if err != nil {
		if errors.Is(err, errOverBudget) {
			return nil, fmt.Errorf("agent %s %s: response headers exceed %d bytes: %w", cl.method, cl.path, maxHeaderBytes, errdefs.ErrUnavailable)
		}
		return nil, transportError(cctx, cl, err)
	}
	// The headers are here: the body must follow promptly (an exec
	// without a timeout has its call deadline far away).
	if cc.deadline.Stop() {
		cc.deadline = cc.expireAfter(c.timeout)
	}
	ok := resp.StatusCode >= 200 && resp.StatusCode <= 299
	bodyLimit := limit
	if !ok {
		bodyLimit = maxErrorBody
	}
	s.budget.n = bodyLimit + 1 // what the reader has buffered ahead is already counted
	b, err := io.ReadAll(io.LimitReader(resp.Body, bodyLimit+1))
	if err == nil && cctx.Err() != nil {
		err = cctx.Err() // a cut-off body may read as a clean EOF
	}
	if err != nil && !errors.Is(err, errOverBudget) {
		return nil, transportError(cctx, cl, err)
	}
	if err != nil || int64(len(b)) > bodyLimit {
		return nil, fmt.Errorf("agent %s %s: response exceeds %d bytes: %w", cl.method, cl.path, bodyLimit, errdefs.ErrUnavailable)
	}
	// Kept only when the body ended where its length said, nothing more
	// came, and the agent did not ask to close.
	keep = !resp.Close && resp.ContentLength == int64(len(b)) && s.br.Buffered() == 0
	if !ok {
		return nil, errorFromBody(cl.method+" "+cl.path, resp.StatusCode, b)
	}
	return b, nil
}
