package server

import (
	"errors"
	"io"
	"net/http"
	"os"
	"time"
)

// Time limits on a client connection. The http.Server has no ReadTimeout or
// WriteTimeout: those would cut long-polls, long execs, downloads, builds and
// attach WebSockets, and a ReadTimeout passing while a handler still runs
// cancels that request's context. Instead each request's body gets its own
// read deadline (guardBody): a stalled body cannot hold a connection, and a
// handler that has read its body to the end runs without one.
var (
	// headerTimeout bounds the arrival of a request's headers.
	headerTimeout = 10 * time.Second
	// bodyTimeout bounds the arrival of a whole small (JSON) body.
	bodyTimeout = 30 * time.Second
	// bodyIdleTimeout bounds the wait for each next piece of an upload
	// (files, tar, template import, build context), however long it is.
	bodyIdleTimeout = 60 * time.Second
	// idleTimeout bounds how long a kept-alive connection waits for its
	// next request.
	idleTimeout = 2 * time.Minute
)

// HTTPServer is an http.Server for s's handler with the timeouts above.
func (s *Server) HTTPServer() *http.Server {
	return &http.Server{Handler: s.handler, ReadHeaderTimeout: headerTimeout, IdleTimeout: idleTimeout}
}

// guardBody puts a read deadline on r's body: bodyTimeout for the whole of a
// small body, bodyIdleTimeout between reads of a stream. The deadline is
// lifted when the body has been read to its end, so what the handler does
// after that (a long exec, a long-poll) is not cut.
func guardBody(w http.ResponseWriter, r *http.Request, kind bodyKind) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return
	}
	rc := http.NewResponseController(w)
	b := &deadlineBody{ReadCloser: r.Body, rc: rc, timeout: bodyTimeout}
	if kind == bodyStream {
		b.timeout, b.idle = bodyIdleTimeout, true
	}
	if err := rc.SetReadDeadline(time.Now().Add(b.timeout)); err != nil {
		return // not a real connection (tests' recorders): nothing to guard
	}
	r.Body = b
}

// deadlineBody is a request body whose connection has a read deadline.
type deadlineBody struct {
	io.ReadCloser
	rc      *http.ResponseController
	timeout time.Duration
	idle    bool // each read that returns data moves the deadline on
	done    bool
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case b.done:
	case err == io.EOF:
		b.done = true
		_ = b.rc.SetReadDeadline(time.Time{})
	case errors.Is(err, os.ErrDeadlineExceeded):
		return n, &bodyTimeoutError{b.timeout, err}
	case n > 0 && b.idle:
		_ = b.rc.SetReadDeadline(time.Now().Add(b.timeout))
	}
	return n, err
}

// bodyTimeoutError is a body read that hit its deadline.
type bodyTimeoutError struct {
	d   time.Duration
	err error
}

func (e *bodyTimeoutError) Error() string {
	return "request body did not arrive in time (limit " + e.d.String() + ")"
}
func (e *bodyTimeoutError) Unwrap() error { return e.err }
