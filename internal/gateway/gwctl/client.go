package gwctl

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

// Client talks to the gateway's control socket. It is the API server's
// sandbox.Network.
type Client struct {
	Path string
}

var _ sandbox.Network = (*Client)(nil)

// roundTrip sends req (with nic, if any) and calls each for every reply line
// until the final one, whose error it returns.
func (c *Client) roundTrip(ctx context.Context, req request, nic *os.File, each func(response) error) (response, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", c.Path)
	if err != nil {
		return response{}, fmt.Errorf("%w: %w: %v", errdefs.ErrUnavailable, errNoGateway, err)
	}
	defer conn.Close()
	uc := conn.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	var oob []byte
	if nic != nil {
		oob = unix.UnixRights(int(nic.Fd()))
	}
	if _, _, err := uc.WriteMsgUnix(marshalLine(req), oob, nil); err != nil {
		return response{}, fmt.Errorf("%w: gateway: %v", errdefs.ErrUnavailable, err)
	}
	r := bufio.NewReaderSize(uc, 64<<10)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			if ctx.Err() != nil {
				return response{}, ctx.Err()
			}
			return response{}, fmt.Errorf("%w: gateway: %v", errdefs.ErrUnavailable, err)
		}
		var resp response
		if err := json.Unmarshal(line, &resp); err != nil {
			return response{}, fmt.Errorf("%w: gateway reply: %v", errdefs.ErrUnavailable, err)
		}
		if resp.Done {
			return resp, asError(resp.Error)
		}
		if each != nil {
			if err := each(resp); err != nil {
				return resp, err
			}
		}
	}
}

func (c *Client) call(ctx context.Context, req request, nic *os.File) (response, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return c.roundTrip(ctx, req, nic, nil)
}

// Ping reports the gateway's pid if it answers.
func (c *Client) Ping(ctx context.Context) (int, error) {
	resp, err := c.call(ctx, request{Op: opPing}, nil)
	return resp.Pid, err
}

func (c *Client) Attach(ctx context.Context, id string, nic *os.File, p api.NetworkPolicy) error {
	_, err := c.call(ctx, request{Op: opAttach, ID: id, Policy: &p}, nic)
	return err
}

// AttachDecide is Attach saying whether the gateway asks the server's
// policy about the sandbox (Attach leaves it to the gateway, which asks).
func (c *Client) AttachDecide(ctx context.Context, id string, nic *os.File, p api.NetworkPolicy, decide bool) error {
	_, err := c.call(ctx, request{Op: opAttach, ID: id, Policy: &p, Decide: &decide}, nic)
	return err
}

// SetDecide turns asking the server's policy on or off for an attached
// sandbox (its rules changed).
func (c *Client) SetDecide(ctx context.Context, id string, decide bool) error {
	_, err := c.call(ctx, request{Op: opSetDecide, ID: id, Decide: &decide}, nil)
	return err
}

func (c *Client) SetPolicy(ctx context.Context, id string, p api.NetworkPolicy) error {
	_, err := c.call(ctx, request{Op: opSetPolicy, ID: id, Policy: &p}, nil)
	return err
}

// SetBroker replaces the credential-brokering config of the attached
// sandbox id (gateway.SetBroker): its CA and granted secrets, values
// included. An id with no link is errdefs.ErrNotFound; push it again after
// every attach.
func (c *Client) SetBroker(ctx context.Context, id string, b brokerconf.Config) error {
	_, err := c.call(ctx, request{Op: opBroker, ID: id, Broker: &b}, nil)
	return err
}

func (c *Client) Detach(ctx context.Context, id string) error {
	_, err := c.call(ctx, request{Op: opDetach, ID: id}, nil)
	return err
}

func (c *Client) Info(ctx context.Context, id string) (api.NetworkInfo, error) {
	resp, err := c.call(ctx, request{Op: opInfo, ID: id}, nil)
	if err != nil {
		return api.NetworkInfo{}, err
	}
	if resp.Info == nil {
		return api.NetworkInfo{}, fmt.Errorf("%w: gateway sent no info", errdefs.ErrUnavailable)
	}
	return *resp.Info, nil
}

func (c *Client) Attached(ctx context.Context) ([]string, error) {
	resp, err := c.call(ctx, request{Op: opAttached}, nil)
	return resp.IDs, err
}

func (c *Client) Events(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	if !follow {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
	}
	_, err := c.roundTrip(ctx, request{Op: opEvents, ID: id, After: after, Follow: follow}, nil, func(r response) error {
		if r.Event == nil {
			return nil
		}
		return fn(*r.Event)
	})
	if err != nil && follow && ctx.Err() != nil {
		return nil
	}
	return err
}

// Counters returns the gateway's event counters by "protocol/verdict" (since
// it started) and how many links it serves.
func (c *Client) Counters(ctx context.Context) (map[string]int64, int, error) {
	resp, err := c.call(ctx, request{Op: opCounters}, nil)
	return resp.Counters, len(resp.IDs), err
}

// DialSandbox opens a TCP connection through the gateway to port on the
// sandbox's own address. The returned conn is the control connection
// itself, turned into the raw stream after the gateway's success reply; it
// supports CloseWrite.
func (c *Client) DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", c.Path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w: %v", errdefs.ErrUnavailable, errNoGateway, err)
	}
	uc := conn.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	fail := func(err error) (net.Conn, error) {
		stop()
		uc.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	if _, err := uc.Write(marshalLine(request{Op: opDial, ID: id, Port: port})); err != nil {
		return fail(fmt.Errorf("%w: gateway: %v", errdefs.ErrUnavailable, err))
	}
	// The reply line is read a byte at a time: what follows it is the
	// sandbox's stream and must stay in the socket for the caller.
	var line []byte
	var b [1]byte
	for {
		if _, err := uc.Read(b[:]); err != nil {
			return fail(fmt.Errorf("%w: gateway: %v", errdefs.ErrUnavailable, err))
		}
		if b[0] == '\n' {
			break
		}
		if line = append(line, b[0]); len(line) > 64<<10 {
			return fail(fmt.Errorf("%w: gateway reply too long", errdefs.ErrUnavailable))
		}
	}
	var resp response
	if err := json.Unmarshal(line, &resp); err != nil {
		return fail(fmt.Errorf("%w: gateway reply: %v", errdefs.ErrUnavailable, err))
	}
	if !resp.Done {
		return fail(fmt.Errorf("%w: gateway reply is not final", errdefs.ErrUnavailable))
	}
	if err := asError(resp.Error); err != nil {
		return fail(err)
	}
	if !stop() {
		uc.Close()
		return nil, ctx.Err()
	}
	return uc, nil
}

// Probe has the gateway try what its confinement must refuse; it returns
// what each attempt got ("" = it worked).
func (c *Client) Probe(ctx context.Context) (map[string]string, error) {
	resp, err := c.call(ctx, request{Op: opProbe}, nil)
	return resp.Probe, err
}
