package microvm

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/microvm/vmctl"
)

// QEMU's socket chardevs and its QMP monitor serve one client at a time: a
// second connection waits in the listen backlog until the first closes.
// Within one server process two instance values may stand for the same VM
// (Open re-adopts a sandbox whose earlier instance value still exists), so
// connections are kept per socket path, process-wide:
//
//   - the agent's stream is handed to one caller at a time: a new DialAgent
//     closes the previous one (the guest's agent sees the port close and
//     serves the new session), as a restarted server's dial would find it;
//   - the QMP and vmctl clients are shared by every instance value of the
//     VM (both serialize their calls).

var conns = struct {
	mu    sync.Mutex
	agent map[string]*agentConn
	qmp   map[string]*QMP
	ctl   map[string]*vmctl.Client
}{
	agent: map[string]*agentConn{},
	qmp:   map[string]*QMP{},
	ctl:   map[string]*vmctl.Client{},
}

// agentConn is the agent stream of one caller; Close gives the port back.
type agentConn struct {
	net.Conn
	path string
	once sync.Once
}

func (c *agentConn) Close() error {
	var err error
	c.once.Do(func() {
		conns.mu.Lock()
		if conns.agent[c.path] == c {
			delete(conns.agent, c.path)
		}
		conns.mu.Unlock()
		err = c.Conn.Close()
	})
	return err
}

// dialAgentSocket connects to the agent's chardev socket at path, taking
// the port over from an earlier caller in this process.
func dialAgentSocket(ctx context.Context, path string) (net.Conn, error) {
	conns.mu.Lock()
	prev := conns.agent[path]
	conns.mu.Unlock()
	if prev != nil {
		prev.Close()
	}
	c, err := dialNoFollow(ctx, path)
	if err != nil {
		return nil, err
	}
	ac := &agentConn{Conn: c, path: path}
	conns.mu.Lock()
	old := conns.agent[path]
	conns.agent[path] = ac
	conns.mu.Unlock()
	if old != nil {
		old.Close() // a concurrent dial lost the race: last one wins
	}
	return ac, nil
}

// sharedQMP returns the process's QMP client of the VM whose monitor
// listens at path, dialling it when there is none.
func sharedQMP(ctx context.Context, path string) (*QMP, error) {
	conns.mu.Lock()
	q := conns.qmp[path]
	conns.mu.Unlock()
	if q != nil {
		return q, nil
	}
	q, err := dialQMPNoFollow(ctx, path)
	if err != nil {
		return nil, err
	}
	conns.mu.Lock()
	defer conns.mu.Unlock()
	if cur := conns.qmp[path]; cur != nil {
		q.Close()
		return cur, nil
	}
	conns.qmp[path] = q
	return q, nil
}

// dropQMP forgets (and closes) q when it is the shared client at path: a
// failed call leaves a QMP client unusable.
func dropQMP(path string, q *QMP) {
	conns.mu.Lock()
	if q == nil || conns.qmp[path] == q {
		q = conns.qmp[path]
		delete(conns.qmp, path)
	}
	conns.mu.Unlock()
	if q != nil {
		q.Close()
	}
}

// sharedCtl returns the process's vmctl client of the VM whose control
// port's chardev listens at path.
func sharedCtl(ctx context.Context, path string) (*vmctl.Client, error) {
	conns.mu.Lock()
	c := conns.ctl[path]
	conns.mu.Unlock()
	if c != nil {
		return c, nil
	}
	conn, err := dialNoFollow(ctx, path)
	if err != nil {
		return nil, err
	}
	c = vmctl.NewClient(conn)
	conns.mu.Lock()
	defer conns.mu.Unlock()
	if cur := conns.ctl[path]; cur != nil {
		c.Close()
		return cur, nil
	}
	conns.ctl[path] = c
	return c, nil
}

// dropCtl forgets (and closes) c when it is the shared client at path (nil:
// whichever is).
func dropCtl(path string, c *vmctl.Client) {
	conns.mu.Lock()
	if c == nil || conns.ctl[path] == c {
		c = conns.ctl[path]
		delete(conns.ctl, path)
	}
	conns.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// releaseConns closes every connection of the VM with these sockets (it
// stopped).
func releaseConns(agent, qmp, ctl string) {
	conns.mu.Lock()
	a := conns.agent[agent]
	conns.mu.Unlock()
	if a != nil {
		a.Close()
	}
	dropQMP(qmp, nil)
	dropCtl(ctl, nil)
}

// The sockets live in the directory QEMU may write, and QEMU runs a guest
// that may own it: the host never follows a symlink there (it could point
// the server at another sandbox's or a host service's socket) and only
// dials a socket. Dialling through /proc/self/fd/N of an O_PATH descriptor
// also lifts sockaddr_un's length limit from the host's side.

// openSocket opens path without following it and checks it is a socket.
func openSocket(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		unix.Close(fd)
		return -1, fmt.Errorf("%s is not a socket", path)
	}
	return fd, nil
}

// dialNoFollow connects to the unix socket at path (see openSocket).
func dialNoFollow(ctx context.Context, path string) (net.Conn, error) {
	fd, err := openSocket(path)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var d net.Dialer
	return d.DialContext(ctx, "unix", "/proc/self/fd/"+strconv.Itoa(fd))
}

// dialQMPNoFollow waits for QEMU's monitor socket at path to appear and
// connects to it (see openSocket).
func dialQMPNoFollow(ctx context.Context, path string) (*QMP, error) {
	for {
		fd, err := openSocket(path)
		if err == nil {
			defer unix.Close(fd)
			return DialQMP(ctx, "/proc/self/fd/"+strconv.Itoa(fd))
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("QMP socket %s: %w: %w", path, err, errdefs.ErrUnavailable)
		case <-time.After(5 * time.Millisecond):
		}
	}
}
