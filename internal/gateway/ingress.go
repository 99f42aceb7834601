package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Ingress: the host reaching a service inside a sandbox. The gateway holds
// the far end of the sandbox's NIC, so it dials the sandbox's own address
// (198.18.0.2) from its side of the link, exactly as a peer on the same
// wire would: the same path for every runtime, nothing asked of the agent.
// A service must listen on 0.0.0.0 or on eth0's address; one bound to
// 127.0.0.1 only is not on the wire and cannot be reached.

// ingressDialTimeout bounds the handshake with the sandbox. A port nothing
// listens on answers at once with a reset; a sandbox that does not answer
// at all (frozen, or its firewall drops) costs this long.
const ingressDialTimeout = 10 * time.Second

// ErrNoListener is the cause of a dial to a port nothing in the sandbox
// listens on (wrapped with errdefs.ErrUnavailable).
var ErrNoListener = errors.New("nothing listens on that port in the sandbox")

// DialSandbox opens a TCP connection from the gateway to port on sandbox
// id's own address. The connection counts towards the link's open
// connections and ends with an "ingress" event (bytes each way: out is
// what the sandbox sent, in what it received). ErrNotFound if id is not
// attached; ErrUnavailable (wrapping ErrNoListener) if nothing listens.
func (g *Gateway) DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error) {
	if port == 0 {
		return nil, fmt.Errorf("%w: port 0", errdefs.ErrInvalidArgument)
	}
	l, err := g.link(id)
	if err != nil {
		return nil, err
	}
	return l.dialIngress(ctx, port)
}

func (l *link) dialIngress(ctx context.Context, port uint16) (net.Conn, error) {
	ev := api.NetworkEvent{Protocol: "ingress", IP: sandboxAddr.String(), Port: int(port)}
	l.mu.Lock()
	full := int(l.open.Load())+len(l.ingress) >= l.g.opts.Limits.MaxConns
	l.mu.Unlock()
	if full {
		ev.Verdict, ev.Reason = api.VerdictLimit, fmt.Sprintf("more than %d open connections", l.g.opts.Limits.MaxConns)
		l.events.add(ev)
		return nil, fmt.Errorf("%w: sandbox has more than %d open connections", errdefs.ErrUnavailable, l.g.opts.Limits.MaxConns)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, ingressDialTimeout)
	defer cancel()
	c, err := gonet.DialContextTCP(ctx, l.stack, tcpip.FullAddress{NIC: nicID, Addr: tcpip.AddrFrom4(sandboxAddr.As4()), Port: port}, ipv4.ProtocolNumber)
	if err != nil {
		ev.Verdict = api.VerdictError
		ev.DurationMS = float64(time.Since(start).Microseconds()) / 1000
		var out error
		switch {
		case isRefused(err):
			ev.Reason = fmt.Sprintf("nothing listens on port %d in the sandbox", port)
			out = fmt.Errorf("%w: %w: nothing listens on port %d in the sandbox (a service must listen on 0.0.0.0, not 127.0.0.1 only)", errdefs.ErrUnavailable, ErrNoListener, port)
		case ctx.Err() != nil:
			ev.Reason = "the sandbox did not answer in time"
			out = fmt.Errorf("%w: port %d of the sandbox did not answer within %s", errdefs.ErrUnavailable, port, ingressDialTimeout)
		default:
			ev.Reason = err.Error()
			out = fmt.Errorf("%w: dialling port %d of the sandbox: %v", errdefs.ErrUnavailable, port, err)
		}
		l.events.add(ev)
		return nil, out
	}
	ic := &ingressConn{TCPConn: c, l: l, ev: ev, start: start}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		c.Close()
		return nil, fmt.Errorf("%w: the sandbox's link was detached", errdefs.ErrUnavailable)
	}
	l.ingress[ic] = struct{}{}
	l.mu.Unlock()
	return ic, nil
}

func isRefused(err error) bool {
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Err != nil {
		return oe.Err.Error() == (&tcpip.ErrConnectionRefused{}).String()
	}
	return false
}

// ingressConn is one connection into the sandbox; closing it records its
// event.
type ingressConn struct {
	*gonet.TCPConn
	l     *link
	ev    api.NetworkEvent
	start time.Time
	in    atomic.Int64 // bytes the sandbox sent (read here)
	out   atomic.Int64 // bytes sent to the sandbox
	once  sync.Once
}

func (c *ingressConn) Read(p []byte) (int, error) {
	n, err := c.TCPConn.Read(p)
	c.in.Add(int64(n))
	c.l.bytesOut.Add(int64(n))
	return n, err
}

func (c *ingressConn) Write(p []byte) (int, error) {
	n, err := c.TCPConn.Write(p)
	c.out.Add(int64(n))
	c.l.bytesIn.Add(int64(n))
	return n, err
}

func (c *ingressConn) Close() error {
	return c.end("")
}

func (c *ingressConn) end(reason string) error {
	err := net.ErrClosed
	c.once.Do(func() {
		err = c.TCPConn.Close()
		c.l.mu.Lock()
		delete(c.l.ingress, c)
		c.l.mu.Unlock()
		ev := c.ev
		ev.Verdict, ev.Reason = api.VerdictAllow, "ingress"
		if reason != "" {
			ev.Reason += "; " + reason
		}
		// Out/in as the sandbox sees them, like its own connections.
		ev.BytesOut, ev.BytesIn = c.in.Load(), c.out.Load()
		ev.DurationMS = float64(time.Since(c.start).Microseconds()) / 1000
		c.l.events.add(ev)
	})
	return err
}
