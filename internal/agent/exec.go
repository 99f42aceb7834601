package agent

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"sync"
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
	b := make([]byte, 32<<10)
	for {
		n, err := r.Read(b)
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
	l, err := a.prepare(req.Cmd, req.Env, req.Workdir, req.User, false)
	if err != nil {
		return nil, err
	}

	var ends [3][2]*os.File
	for i := range ends {
		r, w, err := os.Pipe()
		if err != nil {
			for _, e := range ends[:i] {
				e[0].Close()
				e[1].Close()
			}
			return nil, fmt.Errorf("creating pipes: %v: %w", err, errdefs.ErrUnavailable)
		}
		ends[i] = [2]*os.File{r, w}
	}
	stdinW, outR, errR := ends[0][1], ends[1][0], ends[2][0]
	defer stdinW.Close()
	defer outR.Close()
	defer errR.Close()

	start := time.Now()
	attr := &syscall.ProcAttr{
		Dir:   l.dir,
		Env:   l.env,
		Files: []uintptr{ends[0][0].Fd(), ends[1][1].Fd(), ends[2][1].Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true, Credential: l.cred},
	}
	pid, done, err := a.reaper.start(l.argv0, l.argv, attr)
	ends[0][0].Close()
	ends[1][1].Close()
	ends[2][1].Close()
	if err != nil {
		return nil, spawnError(l.argv0, err)
	}

	go func() {
		// A process that never reads its stdin gets EPIPE here once it exits
		// (or the deferred Close unblocks the write).
		if len(req.Stdin) > 0 {
			stdinW.Write(req.Stdin)
		}
		stdinW.Close()
	}()
	out := &capture{limit: int(limit)}
	errc := &capture{limit: int(limit)}
	var pumps sync.WaitGroup
	pumps.Add(2)
	go func() { defer pumps.Done(); out.drain(outR) }()
	go func() { defer pumps.Done(); errc.drain(errR) }()

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

	pumped := make(chan struct{})
	go func() { pumps.Wait(); close(pumped) }()
	select {
	case <-pumped:
	case <-time.After(drainGrace):
		outR.Close()
		errR.Close()
		<-pumped
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
