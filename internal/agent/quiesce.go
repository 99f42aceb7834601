package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// Quiesce and resume (agentproto.PathQuiesce).
//
// gVisor cannot checkpoint a socket bound on the host, nor a connection
// accepted on one, so before a checkpoint the host asks the agent to close
// every host-facing connection and, when it listens on a socket (--socket),
// that listener too, and to remove the socket file: the host knows the agent
// is quiet when the file is gone.
//
// The agent listens again when a resume marker appears next to its socket
// (ResumeSuffix: /run/space/agent.sock.resume under gvisor). The runtime
// writes it from the host after a failed checkpoint, and before `runsc
// restore` so the restored agent finds it on its first look. The agent polls
// for it every resumePoll while quiesced (a stat through the gofer costs a
// few microseconds of sentry time; inotify does not see host writes through
// a gofer mount, and a signal through `runsc kill` costs a runsc process on
// the restore path). A sandbox process can write the marker too: that only
// makes its own agent listen early, which fails its own checkpoint.
//
// With --fd or --serial the agent only drops its sessions: the inherited
// listener cannot be re-created, and a serial port has no listener.

// quiesceGrace is how long a quiesce waits for the host to close its
// sessions before closing them itself.
const quiesceGrace = 500 * time.Millisecond

// ResumeSuffix is appended to the socket path to name the resume marker.
const ResumeSuffix = ".resume"

// resumePoll is how often a quiesced agent looks for its resume marker: it
// bounds the restore → agent-listening latency this mechanism adds.
const resumePoll = 2 * time.Millisecond

// listenCtl tracks the agent's host-facing sessions and its socket listener.
type listenCtl struct {
	mu       sync.Mutex
	sessions map[*yamux.Session]struct{}
	sock     string       // socket path in --socket mode, else ""
	ln       net.Listener // current listener in --socket mode
	quiesced bool         // --socket mode: listener closed until resumed
}

// track registers a new session; during a quiesce it is refused (closed).
func (lc *listenCtl) track(s *yamux.Session) bool {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if lc.quiesced {
		return false
	}
	if lc.sessions == nil {
		lc.sessions = map[*yamux.Session]struct{}{}
	}
	lc.sessions[s] = struct{}{}
	return true
}

func (lc *listenCtl) untrack(s *yamux.Session) {
	lc.mu.Lock()
	delete(lc.sessions, s)
	lc.mu.Unlock()
}

// quiesce closes the listener (socket mode), then waits for the host to
// close every session (closing what remains after quiesceGrace), then
// removes the socket file: "socket file gone" means "no host connection
// left".
func (a *Agent) quiesce() {
	lc := &a.lc
	lc.mu.Lock()
	ln, sock := lc.ln, lc.sock
	if sock != "" {
		if lc.quiesced {
			lc.mu.Unlock()
			return
		}
		lc.quiesced = true
		lc.ln = nil
		// A marker left from before must not end this quiesce at once.
		os.Remove(sock + ResumeSuffix)
	}
	sessions := make([]*yamux.Session, 0, len(lc.sessions))
	for s := range lc.sessions {
		sessions = append(sessions, s)
	}
	lc.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	// The host closes its session once it has read the 204; closing it
	// from here at once could cut that answer off. Sessions still open
	// after quiesceGrace are closed.
	deadline := time.Now().Add(quiesceGrace)
	for len(sessions) > 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
		open := sessions[:0]
		for _, s := range sessions {
			if !s.IsClosed() {
				open = append(open, s)
			}
		}
		sessions = open
	}
	for _, s := range sessions {
		s.Close()
	}
	if sock != "" {
		os.Remove(sock)
	}
	a.log.Info("quiesced", "closed_by_agent", len(sessions), "socket", sock)
}

func (a *Agent) handleQuiesce(w http.ResponseWriter, r *http.Request) {
	w.WriteHeader(http.StatusNoContent)
	// The answer is on the wire before the session goes away: a yamux
	// write returns once its frame has been written to the connection.
	_ = http.NewResponseController(w).Flush()
	go a.quiesce()
}

// serveSocket listens on path and serves until ctx ends or the listener
// fails; after a quiesce it waits for the resume marker and listens again.
func (a *Agent) serveSocket(ctx context.Context, path string) error {
	lc := &a.lc
	for {
		os.Remove(path)
		ln, err := net.Listen("unix", path)
		if err != nil {
			return err
		}
		// quiesce removes the file itself, after the sessions are closed.
		ln.(*net.UnixListener).SetUnlinkOnClose(false)
		lc.mu.Lock()
		lc.sock, lc.ln, lc.quiesced = path, ln, false
		lc.mu.Unlock()
		a.log.Info("agent listening", "socket", path)
		serr := a.Serve(ln)
		lc.mu.Lock()
		quiesced := lc.quiesced
		lc.mu.Unlock()
		if !quiesced {
			ln.Close()
			os.Remove(path)
			return serr
		}
		if err := waitResume(ctx, path+ResumeSuffix); err != nil {
			return err
		}
	}
}

// waitResume polls for the resume marker and removes it.
func waitResume(ctx context.Context, marker string) error {
	t := time.NewTicker(resumePoll)
	defer t.Stop()
	for {
		var st unix.Stat_t
		if unix.Lstat(marker, &st) == nil {
			os.Remove(marker)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Limits of agentproto.Restored the agent accepts.
const (
	minSeed = 32
	maxSeed = 4096
)

// hostnameRE is what the agent accepts as a hostname (RFC 1123 labels).
var hostnameRE = regexp.MustCompile(`^[a-zA-Z0-9]([a-zA-Z0-9-]{0,62}\.?)*$`)

// handleRestored runs after a restore or fork: new entropy, the new
// hostname, the host's clock where the sandbox may set it.
func (a *Agent) handleRestored(w http.ResponseWriter, r *http.Request) {
	var req agentproto.Restored
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, err)
		return
	}
	if len(req.Seed) < minSeed || len(req.Seed) > maxSeed {
		writeError(w, fmt.Errorf("seed must be %d..%d bytes, got %d: %w", minSeed, maxSeed, len(req.Seed), errdefs.ErrInvalidArgument))
		return
	}
	if req.Hostname != "" && (len(req.Hostname) > 64 || !hostnameRE.MatchString(req.Hostname)) {
		writeError(w, fmt.Errorf("invalid hostname %q: %w", req.Hostname, errdefs.ErrInvalidArgument))
		return
	}
	if err := mixEntropy(req.Seed); err != nil {
		writeError(w, fmt.Errorf("mixing the seed into the entropy pool: %w", err))
		return
	}
	if req.Hostname != "" {
		if err := a.setHostname(req.Hostname); err != nil {
			writeError(w, err)
			return
		}
	}
	if req.TimeUnixNano > 0 && a.cfg.OwnsSystem {
		setClock(req.TimeUnixNano, a.log)
	}
	w.WriteHeader(http.StatusNoContent)
}

// mixEntropy writes seed into the kernel's pool through /dev/urandom (any
// process may; it mixes without crediting entropy) and, where permitted,
// also credits it with RNDADDENTROPY. Under gVisor every read of
// /dev/urandom is fresh host randomness anyway; the write matters on
// kernels whose pool a snapshot copies (microVMs).
func mixEntropy(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(seed); err != nil {
		return err
	}
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	words := (len(seed) + 3) / 4
	buf := make([]byte, 8+4*words)
	binary.NativeEndian.PutUint32(buf[0:], uint32(len(seed)*8))
	binary.NativeEndian.PutUint32(buf[4:], uint32(len(seed)))
	copy(buf[8:], seed)
	// EPERM without CAP_SYS_ADMIN (always in a sandbox) and ENOTTY where
	// the device does not implement it: the write above already mixed.
	_, _, _ = unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&buf[0])))
	return nil
}

// setHostname sets the kernel hostname where the agent owns the system
// (its UTS namespace may refuse: EPERM is not an error) and rewrites
// /etc/hostname below its root.
func (a *Agent) setHostname(name string) error {
	if a.cfg.OwnsSystem {
		if err := unix.Sethostname([]byte(name)); err != nil && !errors.Is(err, unix.EPERM) {
			a.log.Warn("sethostname failed", "err", err)
		}
	}
	if _, err := a.root.stat("etc/hostname"); err != nil {
		return nil // no such file to keep in step
	}
	if _, err := a.root.writeFile("etc/hostname", -1, strings.NewReader(name+"\n")); err != nil {
		return fmt.Errorf("writing /etc/hostname: %w", err)
	}
	return nil
}

// setClock sets the realtime clock to the host's when it is more than a
// second off and the sandbox may (gVisor and containers refuse: EPERM).
func setClock(unixNano int64, log interface{ Debug(string, ...any) }) {
	now := time.Now().UnixNano()
	if d := now - unixNano; d > -int64(time.Second) && d < int64(time.Second) {
		return
	}
	ts := unix.NsecToTimespec(unixNano)
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		log.Debug("clock not set", "err", err)
	}
}
