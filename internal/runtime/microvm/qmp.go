package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// QMP is a client of QEMU's machine protocol on a unix socket (-qmp
// unix:PATH,server=on,wait=off). QEMU is confined but runs a guest that
// may own it, so replies are bounded and treated as untrusted data.
//
// Commands are serialized. Asynchronous events are kept (the last
// maxEvents) for Events; a command's reply is the first non-event message
// after it is sent.
type QMP struct {
	mu     sync.Mutex
	conn   *net.UnixConn
	r      *bufio.Reader
	events []QMPEvent
	err    error
}

// QMPEvent is one asynchronous message from QEMU.
type QMPEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data,omitempty"`
}

const (
	qmpMaxLine = 1 << 20
	maxEvents  = 64
)

// DialQMP connects to the QMP socket at path and negotiates capabilities.
// It retries until ctx ends while the socket is not there yet.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	var d net.Dialer
	var conn net.Conn
	for {
		var err error
		conn, err = d.DialContext(ctx, "unix", path)
		if err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("dialling QMP %s: %w: %w", path, err, errdefs.ErrUnavailable)
		case <-time.After(5 * time.Millisecond):
		}
	}
	q := &QMP{conn: conn.(*net.UnixConn), r: bufio.NewReaderSize(conn, 64<<10)}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	// The greeting: {"QMP": {...}}.
	if _, err := q.readMessage(); err != nil {
		conn.Close()
		return nil, fmt.Errorf("QMP greeting: %w: %w", err, errdefs.ErrUnavailable)
	}
	if _, err := q.execute(ctx, "qmp_capabilities", nil, -1); err != nil {
		conn.Close()
		return nil, err
	}
	return q, nil
}

// Close closes the connection (QEMU keeps running).
func (q *QMP) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.err == nil {
		q.err = errors.New("QMP connection closed")
	}
	return q.conn.Close()
}

// Execute runs cmd with args (nil for none) and returns its "return" value.
func (q *QMP) Execute(ctx context.Context, cmd string, args any) (json.RawMessage, error) {
	return q.execute(ctx, cmd, args, -1)
}

// ExecuteWithFD runs cmd passing fd to QEMU along with it (SCM_RIGHTS), as
// "getfd" and "add-fd" need.
func (q *QMP) ExecuteWithFD(ctx context.Context, cmd string, args any, fd *os.File) (json.RawMessage, error) {
	return q.execute(ctx, cmd, args, int(fd.Fd()))
}

// Events returns and forgets the events received so far.
func (q *QMP) Events() []QMPEvent {
	q.mu.Lock()
	defer q.mu.Unlock()
	ev := q.events
	q.events = nil
	return ev
}

func (q *QMP) execute(ctx context.Context, cmd string, args any, fd int) (json.RawMessage, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.err != nil {
		return nil, fmt.Errorf("QMP %s: %w: %w", cmd, q.err, errdefs.ErrUnavailable)
	}
	msg := map[string]any{"execute": cmd}
	if args != nil {
		msg["arguments"] = args
	}
	b, err := json.Marshal(msg)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = q.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	fail := func(err error) (json.RawMessage, error) {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		// The reply may still come and would be taken for the next one.
		q.err = err
		_ = q.conn.Close()
		return nil, fmt.Errorf("QMP %s: %w: %w", cmd, err, errdefs.ErrUnavailable)
	}
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if _, _, err := q.conn.WriteMsgUnix(b, oob, nil); err != nil {
		return fail(err)
	}
	for {
		m, err := q.readMessage()
		if err != nil {
			return fail(err)
		}
		var reply struct {
			Event  string          `json:"event"`
			Data   json.RawMessage `json:"data"`
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
		}
		if err := json.Unmarshal(m, &reply); err != nil {
			return fail(fmt.Errorf("decoding reply: %w", err))
		}
		switch {
		case reply.Event != "":
			if len(q.events) == maxEvents {
				q.events = q.events[1:]
			}
			q.events = append(q.events, QMPEvent{Event: reply.Event, Data: reply.Data})
		case reply.Error != nil:
			return nil, fmt.Errorf("QMP %s: %s: %s", cmd, reply.Error.Class, truncateString(reply.Error.Desc, 512))
		default:
			return reply.Return, nil
		}
	}
}

func (q *QMP) readMessage() ([]byte, error) {
	var buf []byte
	for {
		part, isPrefix, err := q.r.ReadLine()
		if err != nil {
			return nil, err
		}
		if len(buf)+len(part) > qmpMaxLine {
			return nil, fmt.Errorf("QMP message over %d bytes", qmpMaxLine)
		}
		buf = append(buf, part...)
		if !isPrefix {
			return buf, nil
		}
	}
}

// Status is QEMU's run state ("running", "paused", "postmigrate",
// "inmigrate", "shutdown", …).
func (q *QMP) Status(ctx context.Context) (string, error) {
	raw, err := q.Execute(ctx, "query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return "", fmt.Errorf("query-status: %w", err)
	}
	return st.Status, nil
}

func truncateString(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
