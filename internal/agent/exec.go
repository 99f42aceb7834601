package agent

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

func (a *Agent) handleExec(w http.ResponseWriter, r *http.Request) {
	var req agentproto.ExecRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, err)
		return
	}
	res, err := a.Exec(r.Context(), &req)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// capture keeps the first limit bytes of a stream and counts the rest.
type capture struct {
	buf       []byte
	limit     int
	truncated bool
}

// drain reads r to EOF (or until r is closed), so the writer never blocks
// on a full pipe even after the cap is reached.
func (c *capture) drain(r *os.File) {
	b := readBufs.Get().(*[maxOutputFrame]byte)
	defer readBufs.Put(b)
	for {
		n, err := r.Read(b[:])
		if n > 0 {
			keep := min(n, c.limit-len(c.buf))
			if keep < n {
				c.truncated = true
			}
			c.buf = append(c.buf, b[:keep]...)
		}
		if err != nil {
			return
		}
	}
}

// Exec runs a process to completion (synchronous exec). If ctx ends first
// (the caller went away) the process group is killed.
func (a *Agent) Exec(ctx context.Context, req *agentproto.ExecRequest) (*api.ExecResult, error) {
	limit := req.MaxOutputBytes
	switch {
	case limit == 0:
		limit = agentproto.DefaultSyncOut
	case limit < 0 || limit > agentproto.MaxSyncOut:
		return nil, fmt.Errorf("max_output_bytes must be 1..%d: %w", agentproto.MaxSyncOut, errdefs.ErrInvalidArgument)
	}
	if req.TimeoutSeconds < 0 || math.IsNaN(req.TimeoutSeconds) || math.IsInf(req.TimeoutSeconds, 0) {
		return nil, fmt.Errorf("timeout_seconds must be a non-negative number: %w", errdefs.ErrInvalidArgument)
	}
	l, err := a.prepare(req.Cmd, req.Env, req.Workdir, req.User, req.Root, false)
	if err != nil {
		return nil, err
	}

	// Stdin that fits into the pipe is written before the start, without a
	// writer goroutine; larger stdin is fed while the process runs.
	stdinR, preloaded, err := preloadedStdin(req.Stdin)
	if err != nil {
		return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
	}
	var stdinW *os.File
	if !preloaded {
		if stdinR, stdinW, err = inPipe(); err != nil {
			return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
		}
		defer stdinW.Close()
	}
	outR, outW, err := outPipe()
	if err != nil {
		closeFDs(stdinR)
		return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer outR.Close()
	errR, errW, err := outPipe()
	if err != nil {
		closeFDs(stdinR, outW)
		return nil, fmt.Errorf("creating pipes: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer errR.Close()

	start := time.Now()
	attr := &syscall.ProcAttr{
		Dir:   l.dir,
		Env:   l.env,
		Files: []uintptr{uintptr(stdinR), uintptr(outW), uintptr(errW)},
		Sys:   &syscall.SysProcAttr{Setsid: true, Credential: l.cred, Chroot: l.chroot},
	}
	pid, done, err := a.reaper.start(l.argv0, l.argv, attr)
	closeFDs(stdinR, outW, errW)
	if err != nil {
		return nil, spawnError(l.argv0, err)
	}

	if stdinW != nil {
		go func() {
			// A process that never reads its stdin gets EPIPE here once it
			// exits (or the deferred Close unblocks the write).
			stdinW.Write(req.Stdin)
			stdinW.Close()
		}()
	}
	out := &capture{limit: int(limit)}
	errc := &capture{limit: int(limit)}
	pumped := make(chan struct{}, 2)
	go func() { out.drain(outR); pumped <- struct{}{} }()
	go func() { errc.drain(errR); pumped <- struct{}{} }()

	var deadline <-chan time.Time
	if req.TimeoutSeconds > 0 {
		// Clamped so an absurd timeout cannot overflow into an instant one.
		t := time.NewTimer(time.Duration(min(req.TimeoutSeconds, 1e9) * float64(time.Second)))
		defer t.Stop()
		deadline = t.C
	}
	var ws unix.WaitStatus
	timedOut, canceled := false, false
	select {
	case ws = <-done:
	case <-deadline:
		timedOut = true
		a.reaper.signalGroup(pid, unix.SIGKILL)
		ws = <-done
	case <-ctx.Done():
		canceled = true
		a.reaper.signalGroup(pid, unix.SIGKILL)
		ws = <-done
	}
	elapsed := time.Since(start)

	// The pipes normally reach EOF together with the exit; only background
	// children that inherited them keep them open, for drainGrace at most.
	var grace *time.Timer
	for n := 0; n < 2; n++ {
		select {
		case <-pumped:
			continue
		default:
		}
		if grace == nil {
			grace = time.NewTimer(drainGrace)
			defer grace.Stop()
		}
		select {
		case <-pumped:
		case <-grace.C:
			outR.Close()
			errR.Close()
			<-pumped
		}
	}
	if canceled {
		return nil, fmt.Errorf("exec canceled: %w", ctx.Err())
	}
	es := exitStatus(ws)
	return &api.ExecResult{
		ExitCode:        es.ExitCode,
		Signal:          es.Signal,
		TimedOut:        timedOut,
		Stdout:          string(out.buf),
		Stderr:          string(errc.buf),
		StdoutTruncated: out.truncated,
		StderrTruncated: errc.truncated,
		DurationMS:      float64(elapsed.Microseconds()) / 1000,
	}, nil
}
