package gwctl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway"
)

// Serve answers control requests on ln until ctx ends. Every connection is
// one request; only the API server (root, the socket's directory is 0700)
// can connect.
func Serve(ctx context.Context, ln *net.UnixListener, g *gateway.Gateway, log *slog.Logger) error {
	go func() {
		<-ctx.Done()
		ln.Close()
	}()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			defer c.Close()
			if err := serveConn(ctx, c, g); err != nil {
				log.Debug("control request", "err", err)
			}
		}()
	}
}

func serveConn(ctx context.Context, c *net.UnixConn, g *gateway.Gateway) error {
	req, nic, err := readRequest(c)
	if nic != nil {
		defer nic.Close()
	}
	if err != nil {
		_, _ = c.Write(marshalLine(response{Error: errorBody(err), Done: true}))
		return err
	}
	reply := func(r response) error {
		r.Done = true
		if r.Error == nil {
			r.Pid = os.Getpid()
		}
		_, err := c.Write(marshalLine(r))
		return err
	}
	fail := func(err error) error { return reply(response{Error: errorBody(err)}) }
	switch req.Op {
	case opPing:
		return reply(response{})
	case opAttach:
		if nic == nil || req.Policy == nil {
			return fail(fmt.Errorf("%w: attach needs a descriptor and a policy", errdefs.ErrInvalidArgument))
		}
		o := gateway.LinkOptions{Decide: req.Decide == nil || *req.Decide}
		if err := g.AttachWith(req.ID, nic, *req.Policy, o); err != nil {
			return fail(err)
		}
		return reply(response{})
	case opSetDecide:
		if req.Decide == nil {
			return fail(fmt.Errorf("%w: set-decide needs decide", errdefs.ErrInvalidArgument))
		}
		if err := g.SetDecide(req.ID, *req.Decide); err != nil {
			return fail(err)
		}
		return reply(response{})
	case opDecisions:
		sd, ok := g.Decider().(*StreamDecider)
		if !ok {
			return fail(fmt.Errorf("%w: this gateway takes no decisions stream", errdefs.ErrInvalidArgument))
		}
		if err := reply(response{}); err != nil {
			return err
		}
		sd.serve(ctx, c)
		return nil
	case opSetPolicy:
		if req.Policy == nil {
			return fail(fmt.Errorf("%w: set-policy needs a policy", errdefs.ErrInvalidArgument))
		}
		if err := g.SetPolicy(req.ID, *req.Policy); err != nil {
			return fail(err)
		}
		return reply(response{})
	case opBroker:
		if req.Broker == nil {
			return fail(fmt.Errorf("%w: broker needs a config", errdefs.ErrInvalidArgument))
		}
		if err := g.SetBroker(req.ID, *req.Broker); err != nil {
			return fail(err)
		}
		return reply(response{})
	case opDetach:
		g.Detach(req.ID)
		return reply(response{})
	case opInfo:
		info, err := g.Info(req.ID)
		if err != nil {
			return fail(err)
		}
		return reply(response{Info: &info})
	case opDial:
		sc, err := g.DialSandbox(ctx, req.ID, req.Port)
		if err != nil {
			return fail(err)
		}
		if err := reply(response{}); err != nil {
			sc.Close()
			return err
		}
		splice(c, sc)
		return nil
	case opAttached:
		return reply(response{IDs: g.Attached()})
	case opProbe:
		p := probeConfinement()
		p["broker"] = "ok" // this gateway intercepts TLS for brokered secrets
		return reply(response{Probe: p})
	case opCounters:
		return reply(response{Counters: g.Counters(), IDs: g.Attached()})
	case opEvents:
		// The client ends a follow by closing: notice it.
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go func() {
			var b [1]byte
			_, _ = c.Read(b[:])
			cancel()
		}()
		err := g.Events(ctx, req.ID, req.After, req.Follow, func(ev api.NetworkEvent) error {
			_, err := c.Write(marshalLine(response{Event: &ev}))
			return err
		})
		if err != nil {
			return fail(err)
		}
		return reply(response{})
	default:
		return fail(fmt.Errorf("%w: unknown op %q", errdefs.ErrInvalidArgument, req.Op))
	}
}

// splice copies a and b into each other until both directions end; the end
// of one direction is passed on as a half-close, so a request/response
// protocol whose client closes its writing side still gets its answer.
func splice(a, b net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(b, a)
		closeWrite(b)
		close(done)
	}()
	_, _ = io.Copy(a, b)
	closeWrite(a)
	<-done
	a.Close()
	b.Close()
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// readRequest reads one JSON line and at most one passed descriptor.
func readRequest(c *net.UnixConn) (request, *os.File, error) {
	var req request
	var nic *os.File
	var buf bytes.Buffer
	chunk := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, _, _, err := c.ReadMsgUnix(chunk, oob)
		if oobn > 0 {
			f, ferr := takeFD(oob[:oobn])
			if ferr != nil || nic != nil {
				if f != nil {
					f.Close()
				}
				if nic != nil {
					nic.Close()
				}
				return req, nil, fmt.Errorf("%w: bad descriptor message", errdefs.ErrInvalidArgument)
			}
			nic = f
		}
		buf.Write(chunk[:n])
		if i := bytes.IndexByte(buf.Bytes(), '\n'); i >= 0 {
			if err := jsonStrict(buf.Bytes()[:i], &req); err != nil {
				return req, nic, fmt.Errorf("%w: %v", errdefs.ErrInvalidArgument, err)
			}
			return req, nic, nil
		}
		if buf.Len() > maxRequest {
			return req, nic, fmt.Errorf("%w: request over %d bytes", errdefs.ErrTooLarge, maxRequest)
		}
		if err != nil || n == 0 {
			return req, nic, errors.Join(errors.New("request ended early"), err)
		}
	}
}

// takeFD returns the one descriptor carried by oob (closing any extra).
func takeFD(oob []byte) (*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		fds = append(fds, got...)
	}
	if len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("%d descriptors", len(fds))
	}
	unix.CloseOnExec(fds[0])
	return os.NewFile(uintptr(fds[0]), "nic"), nil
}

// probeConfinement tries what the gateway's confinement must refuse.
func probeConfinement() map[string]string {
	res := map[string]string{}
	note := func(name string, err error) {
		if err == nil {
			res[name] = ""
			return
		}
		res[name] = err.Error()
	}
	fd, err := unix.Open("/etc/hostname", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err == nil {
		unix.Close(fd)
	}
	note("open", err)
	for name, family := range map[string]int{"socket_unix": unix.AF_UNIX, "socket_netlink": unix.AF_NETLINK, "socket_packet": unix.AF_PACKET} {
		fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err == nil {
			unix.Close(fd)
		}
		note(name, err)
	}
	note("execve", unix.Exec("/bin/true", []string{"true"}, nil))
	note("unshare", unix.Unshare(unix.CLONE_NEWUSER))
	note("ptrace", unix.PtraceAttach(1))
	note("kill", unix.Kill(1, 0))
	note("setuid", unix.Setuid(0))
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		note("bind", unix.Bind(s, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
		unix.Close(s)
	}
	return res
}
