package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/coder/websocket"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

const (
	// drainGrace is how long output is still collected after a process
	// exits, for background children that inherited its stdout/stderr. The
	// exiting process's own output is already in the pipe and is read at
	// once; only late writes by such children can be cut off.
	drainGrace = 250 * time.Millisecond
	// maxHeldDrain bounds how long after its exit a process's output may
	// still be held back by attaches (see proc.wait): a background child
	// that floods forever must not keep FrameExit away for ever.
	maxHeldDrain = 30 * time.Second
	// maxOutputFrame bounds the data of one stdout/stderr frame.
	maxOutputFrame = 32 << 10
	// stdinQueue is how many stdin frames may wait for a process that is
	// not reading; beyond it the attach applies backpressure.
	stdinQueue = 64
	// attachWriteTimeout drops an attach whose client stopped reading.
	attachWriteTimeout = 2 * time.Minute
	maxProcID          = 64
)

// proc is a long-lived process with replay buffers.
type proc struct {
	id  string
	pid int
	cmd []string
	tty bool
	rp  *reaper

	mu      sync.Mutex
	out     [2]*ring      // stdout, stderr (PTY output is stdout)
	changed chan struct{} // closed and replaced on every change
	exit    *api.ExitStatus
	drained bool // exited and every output byte is in the rings

	finished chan struct{} // closed when drained
	stdinQ   chan []byte   // nil entry = close stdin
	stdin    *os.File      // pipe write end, or the PTY master
	master   *os.File      // PTY master (tty only)
	readers  []*os.File    // read ends, closed after the drain grace
	closeIn  sync.Once

	// Backpressure (see store). Guarded by mu.
	stall   time.Duration        // Config.AttachStall
	cursors map[*cursor]struct{} // live attaches
	freed   chan struct{}        // closed and replaced when a cursor advances or leaves while a pump waits
	held    int                  // pumps waiting for room now
	holds   int                  // waits begun so far
	pending *cursor              // holds the output for the first attach (ProcStart.HoldForAttach) until it comes
}

// cursor is the read position of one live attach. While it makes progress
// it holds the pumps back: they do not overwrite bytes it has not yet
// taken, so an attached client sees every byte, as on a terminal, and the
// process blocks on its pipe or pty when the client is slow.
type cursor struct {
	off     [2]int64  // next offset the attach copies out of each ring
	blocked time.Time // since when it has held a pump back without advancing (zero: it has not)
	stalled bool      // held a pump back for p.stall: holds nothing until it advances again
}

// advance records that c has taken every byte before offs. Called with
// p.mu held.
func (p *proc) advance(c *cursor, offs [2]int64) {
	if offs == c.off {
		return
	}
	c.off, c.blocked, c.stalled = offs, time.Time{}, false
	p.wakePumps()
}

// wakePumps lets waiting pumps recompute their room. Called with p.mu held.
func (p *proc) wakePumps() {
	if p.held > 0 {
		close(p.freed)
		p.freed = make(chan struct{})
	}
}

// broadcast wakes every attach waiting for news. Called with p.mu held.
func (p *proc) broadcast() {
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *proc) info() agentproto.ProcInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	return agentproto.ProcInfo{ID: p.id, Pid: p.pid, Cmd: p.cmd, TTY: p.tty, Running: p.exit == nil, Exit: p.exit,
		StdoutEnd: p.out[0].end, StderrEnd: p.out[1].end}
}

func (p *proc) kill() {
	p.rp.signalGroup(p.pid, unix.SIGKILL) // Conflict when already reaped: nothing to do
}

// startProc starts l with pipes or a PTY and begins buffering its output.
func (a *Agent) startProc(id string, l *launch, tty, hold bool, rows, cols uint16) (*proc, error) {
	p := &proc{
		id: id, cmd: l.argv, tty: tty, rp: a.reaper,
		out:      [2]*ring{newRing(a.cfg.RingBytes), newRing(a.cfg.RingBytes)},
		changed:  make(chan struct{}),
		finished: make(chan struct{}),
		stdinQ:   make(chan []byte, stdinQueue),
		stall:    a.cfg.AttachStall,
		cursors:  map[*cursor]struct{}{},
		freed:    make(chan struct{}),
	}
	if hold {
		p.pending = &cursor{}
		p.cursors[p.pending] = struct{}{}
	}
	sys := &syscall.SysProcAttr{Setsid: true, Credential: l.cred, Chroot: l.chroot}
	var files []uintptr
	var childEnds []func()
	if tty {
		master, slave, err := openPTY()
		if err != nil {
			return nil, fmt.Errorf("allocating a pty: %w: %w", err, errdefs.ErrUnavailable)
		}
		if rows == 0 {
			rows = 24
		}
		if cols == 0 {
			cols = 80
		}
		if err := setWinsize(master, rows, cols); err != nil {
			master.Close()
			unix.Close(slave)
			return nil, fmt.Errorf("setting pty size: %w", err)
		}
		files = []uintptr{uintptr(slave), uintptr(slave), uintptr(slave)}
		childEnds = append(childEnds, func() { unix.Close(slave) })
		sys.Setctty, sys.Ctty = true, 0
		p.master, p.stdin, p.readers = master, master, []*os.File{master}
	} else {
		stdinR, stdinW, err := inPipe()
		if err != nil {
			return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
		}
		outR, outW, err := outPipe()
		if err != nil {
			closeFDs(stdinR)
			stdinW.Close()
			return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
		}
		errR, errW, err := outPipe()
		if err != nil {
			closeFDs(stdinR, outW)
			stdinW.Close()
			outR.Close()
			return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
		}
		files = []uintptr{uintptr(stdinR), uintptr(outW), uintptr(errW)}
		childEnds = append(childEnds, func() { closeFDs(stdinR, outW, errW) })
		p.stdin = stdinW
		p.readers = []*os.File{outR, errR}
	}
	pid, done, err := a.reaper.start(l.argv0, l.argv, &syscall.ProcAttr{Dir: l.dir, Env: l.env, Files: files, Sys: sys})
	for _, c := range childEnds {
		c()
	}
	if err != nil {
		p.stdin.Close()
		for _, r := range p.readers {
			r.Close()
		}
		return nil, spawnError(l.argv0, err)
	}
	p.pid = pid

	var wg sync.WaitGroup
	for i, r := range p.readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.pump(r, i)
		}()
	}
	go p.feedStdin()
	go p.wait(done, &wg)
	return p, nil
}

// pump copies one output stream into its ring until EOF.
func (p *proc) pump(r *os.File, stream int) {
	buf := readBufs.Get().(*[maxOutputFrame]byte)
	defer readBufs.Put(buf)
	for {
		n, err := r.Read(buf[:])
		if n > 0 {
			p.store(stream, buf[:n])
		}
		if err != nil {
			return
		}
	}
}

// store appends b to a ring. With nobody attached it never waits: the ring
// overwrites what nobody read in time. While live attaches have not yet
// taken the bytes b would overwrite, it writes what fits and waits for
// them; an attach that takes nothing for p.stall while holding it is marked
// stalled and no longer counts (it gets FrameDropped instead).
func (p *proc) store(stream int, b []byte) {
	waited := false
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		room, deadline := p.room(stream, len(b))
		if room >= len(b) {
			p.out[stream].write(b)
			p.broadcast()
			return
		}
		if room > 0 {
			p.out[stream].write(b[:room])
			p.broadcast()
			b = b[room:]
		}
		if !waited {
			waited = true
			p.holds++
		}
		freed := p.freed
		p.held++
		p.mu.Unlock()
		wait := time.Until(deadline)
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-freed:
		case <-timer.C:
		}
		p.mu.Lock()
		p.held--
	}
}

// room returns how many bytes stream can take now without overwriting
// bytes a live attach still needs, and, if that is less than need, the
// earliest time a holding attach counts as stalled. Called with p.mu held.
func (p *proc) room(stream, need int) (int, time.Time) {
	now := time.Now()
	r := p.out[stream]
	room := need
	var deadline time.Time
	for c := range p.cursors {
		if c.stalled {
			continue
		}
		off := min(max(c.off[stream], r.start()), r.end)
		free := int(off + int64(r.size) - r.end)
		if free >= need {
			continue
		}
		if c.blocked.IsZero() {
			c.blocked = now
		}
		d := c.blocked.Add(p.stall)
		if !now.Before(d) {
			c.stalled = true
			continue
		}
		room = min(room, free)
		if deadline.IsZero() || d.Before(deadline) {
			deadline = d
		}
	}
	return room, deadline
}

// wait records the exit status, lets the output drain, and releases the
// process's descriptors.
func (p *proc) wait(done <-chan unix.WaitStatus, pumps *sync.WaitGroup) {
	ws := <-done
	exited := time.Now()
	p.mu.Lock()
	p.exit = exitStatus(ws)
	p.broadcast()
	holds := p.holds
	p.mu.Unlock()

	pumped := make(chan struct{})
	go func() { pumps.Wait(); close(pumped) }()
	grace := time.NewTimer(drainGrace)
	defer grace.Stop()
	for waiting := true; waiting; {
		select {
		case <-pumped:
			waiting = false
		case <-grace.C:
			// Output held back by an attach is still the process's own
			// (it sat in the pipe at exit), so the grace runs only while
			// the pumps are free; maxHeldDrain bounds it anyway.
			p.mu.Lock()
			held, h := p.held, p.holds
			p.mu.Unlock()
			if (held > 0 || h != holds) && time.Since(exited) < maxHeldDrain {
				holds = h
				grace.Reset(drainGrace)
				continue
			}
			for _, r := range p.readers {
				r.Close()
			}
			<-pumped
			waiting = false
		}
	}
	for _, r := range p.readers {
		r.Close()
	}
	p.closeStdin()
	p.mu.Lock()
	p.drained = true
	p.broadcast()
	p.mu.Unlock()
	close(p.finished)
}

func (p *proc) closeStdin() {
	p.closeIn.Do(func() {
		if p.master == nil {
			p.stdin.Close()
		}
	})
}

// feedStdin writes queued stdin frames in order, so a process that does not
// read its input never stalls an attach's control frames (resize, signal).
func (p *proc) feedStdin() {
	for {
		select {
		case <-p.finished:
			return
		case b := <-p.stdinQ:
			if b == nil {
				if p.tty {
					// A terminal has no half-close: send the EOF character.
					p.stdin.Write([]byte{4})
				} else {
					p.closeStdin()
				}
				continue
			}
			p.stdin.Write(b) // EPIPE once the reader is gone: nothing to report to
		}
	}
}

func (a *Agent) lookupProc(id string) (*proc, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	p, ok := a.procs[id]
	if !ok {
		return nil, fmt.Errorf("process %q: %w", truncate(id, maxProcID), errdefs.ErrNotFound)
	}
	return p, nil
}

func validProcID(id string) error {
	if id == "" || len(id) > maxProcID {
		return fmt.Errorf("process id must be 1..%d characters: %w", maxProcID, errdefs.ErrInvalidArgument)
	}
	for _, c := range []byte(id) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("process id %q has characters outside [A-Za-z0-9._-]: %w", truncate(id, maxProcID), errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func (a *Agent) handleStartProc(w http.ResponseWriter, r *http.Request) {
	var req agentproto.ProcStart
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, err)
		return
	}
	if err := validProcID(req.ID); err != nil {
		writeError(w, err)
		return
	}
	l, err := a.prepare(req.Cmd, req.Env, req.Workdir, req.User, req.Root, req.TTY)
	if err != nil {
		writeError(w, err)
		return
	}
	a.mu.Lock()
	if _, dup := a.procs[req.ID]; dup {
		a.mu.Unlock()
		writeError(w, fmt.Errorf("process %q already exists: %w", req.ID, errdefs.ErrConflict))
		return
	}
	if len(a.procs) >= a.cfg.MaxProcs {
		a.mu.Unlock()
		writeError(w, fmt.Errorf("the agent already tracks %d processes; forget exited ones first: %w", len(a.procs), errdefs.ErrConflict))
		return
	}
	p, err := a.startProc(req.ID, l, req.TTY, req.HoldForAttach, req.Rows, req.Cols)
	if err == nil {
		a.procs[req.ID] = p
	}
	a.mu.Unlock()
	if err != nil {
		writeError(w, err)
		return
	}
	a.log.Debug("process started", "id", req.ID, "pid", p.pid, "tty", req.TTY)
	writeJSON(w, http.StatusCreated, p.info())
}

func (a *Agent) handleListProcs(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	procs := make([]*proc, 0, len(a.procs))
	for _, p := range a.procs {
		procs = append(procs, p)
	}
	a.mu.Unlock()
	out := make([]agentproto.ProcInfo, 0, len(procs))
	for _, p := range procs {
		out = append(out, p.info())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	writeJSON(w, http.StatusOK, out)
}

func (a *Agent) handleGetProc(w http.ResponseWriter, r *http.Request) {
	p, err := a.lookupProc(r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, p.info())
}

func (a *Agent) handleForgetProc(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	a.mu.Lock()
	p, ok := a.procs[id]
	delete(a.procs, id)
	a.mu.Unlock()
	if !ok {
		writeError(w, fmt.Errorf("process %q: %w", truncate(id, maxProcID), errdefs.ErrNotFound))
		return
	}
	p.kill()
	w.WriteHeader(http.StatusNoContent)
}

func (a *Agent) handleSignal(w http.ResponseWriter, r *http.Request) {
	p, err := a.lookupProc(r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	var req api.SignalRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, err)
		return
	}
	sig, err := parseSignal(req.Signal)
	if err != nil {
		writeError(w, err)
		return
	}
	if err := a.reaper.signalGroup(p.pid, sig); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func parseOffset(r *http.Request, name string) (int64, error) {
	s := r.URL.Query().Get(name)
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > 1<<62 {
		return 0, fmt.Errorf("%s must be a non-negative integer: %w", name, errdefs.ErrInvalidArgument)
	}
	return n, nil
}

// handleAttach streams a process's output over a WebSocket: FrameStarted,
// the replay from the requested offsets (with FrameDropped for anything
// already overwritten), live output, and FrameExit last.
func (a *Agent) handleAttach(w http.ResponseWriter, r *http.Request) {
	p, err := a.lookupProc(r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	var offs [2]int64
	for i, name := range []string{"stdout_offset", "stderr_offset"} {
		if offs[i], err = parseOffset(r, name); err != nil {
			writeError(w, err)
			return
		}
	}
	c, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true, CompressionMode: websocket.CompressionDisabled})
	if err != nil {
		return // Accept has answered the client
	}
	c.SetReadLimit(api.MaxFrame)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		defer cancel()
		if err := p.readClientFrames(ctx, c); err != nil {
			a.log.Debug("attach input ended", "id", p.id, "err", err)
		}
	}()
	if err := p.streamTo(ctx, c, offs); err != nil {
		a.log.Debug("attach output ended", "id", p.id, "err", err)
		c.CloseNow()
		return
	}
	c.Close(websocket.StatusNormalClosure, "")
}

func (p *proc) streamTo(ctx context.Context, c *websocket.Conn, offs [2]int64) error {
	send := func(b []byte) error {
		wctx, cancel := context.WithTimeout(ctx, attachWriteTimeout)
		defer cancel()
		return c.Write(wctx, websocket.MessageBinary, b)
	}
	sendJSON := func(typ byte, v any) error {
		b, _ := json.Marshal(v)
		return send(append([]byte{typ}, b...))
	}
	// The attach holds the output back from before FrameStarted, so a
	// client that starts the output after it (by stdin) misses nothing.
	cur := &cursor{off: offs}
	p.mu.Lock()
	p.cursors[cur] = struct{}{}
	if p.pending != nil {
		// The attach the start held the output for is here (or another
		// one, which takes over the hold from its own offsets).
		delete(p.cursors, p.pending)
		p.pending = nil
		p.wakePumps()
	}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.cursors, cur)
		p.wakePumps()
		p.mu.Unlock()
	}()
	if err := sendJSON(api.FrameStarted, api.Started{Pid: p.pid}); err != nil {
		return err
	}
	buf := make([]byte, maxOutputFrame)
	names := [2]string{"stdout", "stderr"}
	types := [2]byte{api.FrameStdout, api.FrameStderr}
	for {
		var frames [][]byte
		p.mu.Lock()
		changed := p.changed
		for i := range p.out {
			n, from, lost := p.out[i].read(offs[i], buf)
			if lost {
				b, _ := json.Marshal(api.Dropped{Stream: names[i], From: offs[i], To: from})
				frames = append(frames, append([]byte{api.FrameDropped}, b...))
			}
			if n > 0 {
				frames = append(frames, api.EncodeOutput(types[i], from, buf[:n]))
			}
			offs[i] = from + int64(n)
		}
		p.advance(cur, offs)
		drained, exit := p.drained, p.exit
		p.mu.Unlock()

		for _, f := range frames {
			if err := send(f); err != nil {
				return err
			}
		}
		if len(frames) > 0 {
			continue
		}
		if drained {
			return sendJSON(api.FrameExit, exit)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (p *proc) readClientFrames(ctx context.Context, c *websocket.Conn) error {
	for {
		typ, data, err := c.Read(ctx)
		if err != nil {
			return err
		}
		if typ != websocket.MessageBinary || len(data) == 0 {
			c.Close(websocket.StatusUnsupportedData, "binary frames only")
			return fmt.Errorf("client sent a non-binary or empty frame")
		}
		payload := data[1:]
		switch data[0] {
		case api.FrameStdin:
			if len(payload) == 0 {
				continue
			}
			select {
			case p.stdinQ <- payload:
			case <-p.finished:
			case <-ctx.Done():
				return ctx.Err()
			}
		case api.FrameCloseStdin:
			select {
			case p.stdinQ <- nil:
			case <-p.finished:
			case <-ctx.Done():
				return ctx.Err()
			}
		case api.FrameResize:
			var rs api.Resize
			if err := json.Unmarshal(payload, &rs); err != nil || rs.Rows == 0 || rs.Cols == 0 {
				continue // a bad resize is ignored, not fatal
			}
			if p.master != nil {
				p.mu.Lock()
				drained := p.drained
				p.mu.Unlock()
				if !drained {
					setWinsize(p.master, rs.Rows, rs.Cols)
				}
			}
		case api.FrameSignal:
			var sr api.SignalRequest
			if err := json.Unmarshal(payload, &sr); err != nil {
				continue
			}
			if sig, err := parseSignal(sr.Signal); err == nil {
				p.rp.signalGroup(p.pid, sig)
			}
		default:
			c.Close(websocket.StatusPolicyViolation, "unknown frame type")
			return fmt.Errorf("client sent unknown frame type %d", data[0])
		}
	}
}

// openPTY allocates a pseudo-terminal. The master is non-blocking (so
// closing it interrupts a blocked read); the slave is opened through the
// master (TIOCGPTPEER), not by a /dev/pts path the sandbox could swap.
func openPTY() (*os.File, int, error) {
	mfd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, -1, err
	}
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(mfd)
		return nil, -1, fmt.Errorf("unlockpt: %w", err)
	}
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(mfd), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		unix.Close(mfd)
		return nil, -1, fmt.Errorf("TIOCGPTPEER: %w", errno)
	}
	return os.NewFile(uintptr(mfd), "/dev/ptmx"), int(sfd), nil
}

// setWinsize sets the terminal size without forcing the master into
// blocking mode (as File.Fd would).
func setWinsize(master *os.File, rows, cols uint16) error {
	rc, err := master.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	err = rc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols})
	})
	if err != nil {
		return err
	}
	return ierr
}
