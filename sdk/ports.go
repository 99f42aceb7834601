package sdk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func portPath(id string, port int) string {
	return "/v1/sandboxes/" + seg(id) + "/ports/" + strconv.Itoa(port)
}

func checkPort(port int) error {
	if port < 1 || port > 65535 {
		return fmt.Errorf("port must be 1..65535, got %d: %w", port, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Port is GET /v1/sandboxes/{id}/ports/{port}: the host-routed and
// path-routed URLs of a service listening on port inside the sandbox, the
// sandbox's access token and whether the port is public.
func (c *Client) Port(ctx context.Context, id string, port int) (*api.PortInfo, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	if err := checkPort(port); err != nil {
		return nil, err
	}
	var out api.PortInfo
	if err := c.do(ctx, request{method: http.MethodGet, path: portPath(id, port)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SetPortPublic is PUT /v1/sandboxes/{id}/ports/{port}: a public port is
// reached without the access token.
func (c *Client) SetPortPublic(ctx context.Context, id string, port int, public bool) (*api.PortInfo, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	if err := checkPort(port); err != nil {
		return nil, err
	}
	var out api.PortInfo
	if err := c.do(ctx, request{method: http.MethodPut, path: portPath(id, port), json: api.PortSettings{Public: public}}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// DialPort opens a raw TCP connection to port of sandbox id, tunnelled over
// a WebSocket (GET /v1/sandboxes/{id}/ports/{port}/tcp, authorized by the
// client's API key). It wakes the sandbox. The conn supports CloseWrite.
func (c *Client) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	if err := checkPort(port); err != nil {
		return nil, err
	}
	h := http.Header{}
	if c.APIKey != "" {
		h.Set("Authorization", "Bearer "+c.APIKey)
	}
	if c.UserAgent != "" {
		h.Set("User-Agent", c.UserAgent)
	}
	ws, resp, err := websocket.Dial(ctx, c.url(portPath(id, port)+"/tcp", nil), &websocket.DialOptions{HTTPClient: c.HTTP, HTTPHeader: h})
	if err != nil {
		if resp != nil && resp.StatusCode >= 300 && resp.StatusCode != http.StatusSwitchingProtocols {
			return nil, fmt.Errorf("port %d of %s: %w", port, id, decodeError(resp))
		}
		return nil, fmt.Errorf("port %d of %s: %w", port, id, err)
	}
	ws.SetReadLimit(64 << 10)
	tc := &tunnelConn{ws: ws, laddr: tunnelAddr("local"), raddr: tunnelAddr(fmt.Sprintf("%s:%d", id, port))}
	tc.ctx, tc.cancel = context.WithCancel(context.Background())
	return tc, nil
}

// tunnelChunk bounds one message this side sends.
const tunnelChunk = 32 << 10

// tunnelConn is a TCP connection carried over a WebSocket: binary messages
// of data; an empty message ends the direction it travels in. A read or
// write deadline that passes ends the whole connection (the WebSocket
// cannot resume an interrupted operation).
type tunnelConn struct {
	ws           *websocket.Conn
	ctx          context.Context
	cancel       context.CancelFunc
	laddr, raddr net.Addr

	rmu  sync.Mutex
	buf  []byte
	eof  bool
	wmu  sync.Mutex
	dmu  sync.Mutex
	rdl  time.Time
	wdl  time.Time
	once sync.Once
}

func (t *tunnelConn) opCtx(deadline time.Time) (context.Context, context.CancelFunc) {
	if deadline.IsZero() {
		return context.WithCancel(t.ctx)
	}
	return context.WithDeadline(t.ctx, deadline)
}

func (t *tunnelConn) Read(p []byte) (int, error) {
	t.rmu.Lock()
	defer t.rmu.Unlock()
	for len(t.buf) == 0 {
		if t.eof {
			return 0, io.EOF
		}
		t.dmu.Lock()
		ctx, cancel := t.opCtx(t.rdl)
		t.dmu.Unlock()
		typ, b, err := t.ws.Read(ctx)
		cancel()
		if err != nil {
			if websocket.CloseStatus(err) == websocket.StatusNormalClosure {
				t.eof = true
				return 0, io.EOF
			}
			if errors.Is(err, context.DeadlineExceeded) {
				return 0, os.ErrDeadlineExceeded
			}
			return 0, err
		}
		if typ != websocket.MessageBinary {
			return 0, errors.New("tunnel: a non-binary message")
		}
		if len(b) == 0 {
			t.eof = true
			return 0, io.EOF
		}
		t.buf = b
	}
	n := copy(p, t.buf)
	t.buf = t.buf[n:]
	return n, nil
}

func (t *tunnelConn) Write(p []byte) (int, error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	n := 0
	for len(p) > 0 {
		k := min(len(p), tunnelChunk)
		t.dmu.Lock()
		ctx, cancel := t.opCtx(t.wdl)
		t.dmu.Unlock()
		err := t.ws.Write(ctx, websocket.MessageBinary, p[:k])
		cancel()
		if err != nil {
			return n, err
		}
		n += k
		p = p[k:]
	}
	return n, nil
}

// CloseWrite tells the sandbox's side that no more bytes come (it reads
// EOF); the other direction stays open.
func (t *tunnelConn) CloseWrite() error {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	return t.ws.Write(t.ctx, websocket.MessageBinary, nil)
}

func (t *tunnelConn) Close() error {
	var err error
	t.once.Do(func() {
		t.cancel()
		err = t.ws.CloseNow()
	})
	return err
}

func (t *tunnelConn) LocalAddr() net.Addr  { return t.laddr }
func (t *tunnelConn) RemoteAddr() net.Addr { return t.raddr }
func (t *tunnelConn) SetDeadline(d time.Time) error {
	t.dmu.Lock()
	defer t.dmu.Unlock()
	t.rdl, t.wdl = d, d
	return nil
}
func (t *tunnelConn) SetReadDeadline(d time.Time) error {
	t.dmu.Lock()
	defer t.dmu.Unlock()
	t.rdl = d
	return nil
}
func (t *tunnelConn) SetWriteDeadline(d time.Time) error {
	t.dmu.Lock()
	defer t.dmu.Unlock()
	t.wdl = d
	return nil
}

type tunnelAddr string

func (a tunnelAddr) Network() string { return "space-tunnel" }
func (a tunnelAddr) String() string  { return string(a) }
