package gvisor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// agentChan owns the host's side of the agent's channel: the unix socket
// the agent binds in its directory (agent/, mounted at /run/space; the
// sandbox's to write, so nothing there is followed and the socket is
// dialled through an O_PATH descriptor), dialling it, waiting for the
// agent to listen (after a start; polling after a restore) or to go
// quiet (PathQuiesce), and making a quiesced agent listen again (the
// resume marker).
type agentChan struct {
	id    string // the sandbox's id, for errors
	files layout
}

// dial connects to the agent's socket (DialAgent without the liveness
// check, for callers holding the instance's mu).
func (a *agentChan) dial(ctx context.Context) (net.Conn, error) {
	fd, err := unix.Open(a.files.sockPath(), unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dial agent of %s: %w: %w", a.id, err, errdefs.ErrUnavailable)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return nil, fmt.Errorf("dial agent of %s: %s is not a socket: %w", a.id, a.files.sockPath(), errdefs.ErrUnavailable)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		return nil, fmt.Errorf("dial agent of %s: %w: %w", a.id, err, errdefs.ErrUnavailable)
	}
	return c, nil
}

// waitListening waits until the agent has bound its socket (it listens right
// after), the sandbox dies, or ctx ends. An inotify watch on the agent's
// directory wakes it as the socket appears; the periodic Lstat stays as the
// check that counts (events are only a hint: the directory is the
// sandbox's, which can make any events it likes) and as the fallback if
// inotify is unavailable.
func (a *agentChan) waitListening(ctx context.Context, exited <-chan struct{}) error {
	ino := -1
	if fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK); err == nil {
		if _, err := unix.InotifyAddWatch(fd, a.files.agentDir(), unix.IN_CREATE|unix.IN_MOVED_TO|unix.IN_ONLYDIR|unix.IN_DONT_FOLLOW); err == nil {
			ino = fd
		} else {
			unix.Close(fd)
		}
	}
	if ino >= 0 {
		defer unix.Close(ino)
	}
	buf := make([]byte, 4096)
	delay := 500 * time.Microsecond
	for {
		var st unix.Stat_t
		if err := unix.Lstat(a.files.sockPath(), &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFSOCK {
			// The agent binds, then listens: until it listens a connect
			// is refused. Start promises a socket that can be dialled.
			c, err := a.dial(ctx)
			if err == nil {
				c.Close()
				return nil
			}
			if !errors.Is(err, unix.ECONNREFUSED) {
				return err
			}
			time.Sleep(200 * time.Microsecond)
			continue
		}
		select {
		case <-exited:
			return fmt.Errorf("sandbox %s exited before its agent listened", a.id)
		case <-ctx.Done():
			return fmt.Errorf("sandbox %s: agent did not listen: %w", a.id, errors.Join(ctx.Err(), errdefs.ErrTimeout))
		default:
		}
		if ino >= 0 {
			// Wait for an event in the directory for at most 10 ms, then
			// look again (and at exited and ctx).
			fds := []unix.PollFd{{Fd: int32(ino), Events: unix.POLLIN}}
			if n, _ := unix.Poll(fds, 10); n > 0 {
				for {
					if n, err := unix.Read(ino, buf); n <= 0 || err != nil {
						break
					}
				}
			}
			continue
		}
		select {
		case <-exited:
		case <-ctx.Done():
		case <-time.After(delay):
		}
		delay = min(2*delay, 20*time.Millisecond)
	}
}

// waitPolling waits for the agent's socket like waitListening but polls
// every millisecond: after a restore the socket comes back within tens of
// milliseconds, and that wait counts against every wake.
func (a *agentChan) waitPolling(ctx context.Context, exited <-chan struct{}) error {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		var st unix.Stat_t
		if err := unix.Lstat(a.files.sockPath(), &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFSOCK {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("sandbox %s exited before its agent listened", a.id)
		case <-ctx.Done():
			return fmt.Errorf("sandbox %s: agent did not listen: %w", a.id, errors.Join(ctx.Err(), errdefs.ErrTimeout))
		case <-t.C:
		}
	}
}

// waitQuiesced waits for the agent to remove its socket (PathQuiesce).
func (a *agentChan) waitQuiesced(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, quiesceWait)
	defer cancel()
	for {
		var st unix.Stat_t
		if err := unix.Lstat(a.files.sockPath(), &st); errors.Is(err, unix.ENOENT) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("its agent still listens (not quiesced): %w", errdefs.ErrConflict)
		case <-time.After(time.Millisecond):
		}
	}
}

// resume writes the resume marker and waits for the agent's socket.
func (a *agentChan) resume(ctx context.Context, exited <-chan struct{}) error {
	if err := writeResumeMarker(a.files.agentDir()); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), quiesceWait)
	defer cancel()
	err := a.waitPolling(ctx, exited)
	removeResumeMarker(a.files.agentDir())
	return err
}
