package server

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"
)

// ndjsonWriter is the one writer of streamed NDJSON responses
// (application/x-ndjson): one JSON value per line, flushed as it is
// written, safe for concurrent senders. The first failed write sticks:
// every later Send returns it without writing.
type ndjsonWriter struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	err     error
}

// newNDJSON sends the response head (200, application/x-ndjson) at once.
// A non-zero writeTimeout bounds each line's write, so a client that stops
// reading fails the stream instead of holding it; call Close when done
// to clear the deadline, which would otherwise outlive the response on a
// kept-alive connection (the server sets none of its own).
func newNDJSON(w http.ResponseWriter, writeTimeout time.Duration) *ndjsonWriter {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	n := &ndjsonWriter{w: w, rc: http.NewResponseController(w), timeout: writeTimeout}
	n.rc.Flush()
	return n
}

// Send writes v as one line and flushes it.
func (n *ndjsonWriter) Send(v any) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.err != nil {
		return n.err
	}
	line, err := json.Marshal(v)
	if err == nil {
		if n.timeout > 0 {
			_ = n.rc.SetWriteDeadline(time.Now().Add(n.timeout))
		}
		if _, err = n.w.Write(append(line, '\n')); err == nil {
			err = n.rc.Flush()
		}
	}
	n.err = err
	return err
}

// Close clears the write deadline Send may have set.
func (n *ndjsonWriter) Close() {
	if n.timeout > 0 {
		_ = n.rc.SetWriteDeadline(time.Time{})
	}
}
