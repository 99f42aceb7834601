// Package hostproc names and watches the host processes a runtime starts
// for its sandboxes (native's sandbox init, runsc's sentry, QEMU) across
// server restarts.
//
// A pid alone is not an identity: once the process is gone the kernel may
// hand the number to an unrelated one. A Record pairs it with the
// process's start time (field 22 of /proc/<pid>/stat, clock ticks since
// boot), which names one process for the host's boot. Runtimes keep the
// Record in a pid file (WritePidFile, atomic), and after a restart Open
// re-adopts the process only if that very process still runs: it opens a
// pidfd first and then checks the start time, so the pidfd names the
// process that matched even if it dies right after; a zombie counts as
// gone. Exited watches the pidfd through the Go runtime's poller, so a
// watched sandbox holds no OS thread.
package hostproc

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// ErrNotRunning is wrapped by errors about a process that has exited, is
// a zombie, or whose pid now names another process.
var ErrNotRunning = os.ErrProcessDone

// Record names one process for the lifetime of the host's boot.
type Record struct {
	Pid       int
	StartTime uint64 // clock ticks since boot
}

var procFS = sync.OnceValues(func() (procfs.FS, error) { return procfs.NewFS(procfs.DefaultMountPoint) })

// stat reads /proc/<pid>/stat; a zombie (or a dead task still listed) is
// ErrNotRunning.
func stat(pid int) (procfs.ProcStat, error) {
	fs, err := procFS()
	if err != nil {
		return procfs.ProcStat{}, err
	}
	p, err := fs.Proc(pid)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return procfs.ProcStat{}, fmt.Errorf("process %d: %w", pid, ErrNotRunning)
		}
		return procfs.ProcStat{}, err
	}
	st, err := p.Stat()
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return procfs.ProcStat{}, fmt.Errorf("process %d: %w", pid, ErrNotRunning)
		}
		return procfs.ProcStat{}, fmt.Errorf("process %d: %w", pid, err)
	}
	if st.State == "Z" || st.State == "X" || st.State == "x" {
		return procfs.ProcStat{}, fmt.Errorf("process %d is a zombie: %w", pid, ErrNotRunning)
	}
	return st, nil
}

// StartTime returns the start time of pid, which must be running (not a
// zombie).
func StartTime(pid int) (uint64, error) {
	st, err := stat(pid)
	if err != nil {
		return 0, err
	}
	return st.Starttime, nil
}

// Identify returns the Record of pid as it runs now.
func Identify(pid int) (Record, error) {
	st, err := StartTime(pid)
	if err != nil {
		return Record{}, err
	}
	return Record{Pid: pid, StartTime: st}, nil
}

// CPUTime returns the user plus system CPU time of pid, in nanoseconds.
func CPUTime(pid int) (int64, error) {
	fs, err := procFS()
	if err != nil {
		return 0, err
	}
	p, err := fs.Proc(pid)
	if err != nil {
		return 0, err
	}
	st, err := p.Stat()
	if err != nil {
		return 0, err
	}
	// USER_HZ is 100 on every Linux ABI Go supports (procfs assumes it too).
	return int64(st.UTime+st.STime) * 1e7, nil
}

// WritePidFile records rec in path atomically (a temporary file renamed
// over it), so a reader sees the old record or the new one.
func WritePidFile(path string, rec Record) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d %d\n", rec.Pid, rec.StartTime), 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}

// ReadPidFile reads a record written by WritePidFile. A missing file is an
// error wrapping os.ErrNotExist.
func ReadPidFile(path string) (Record, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Record{}, err
	}
	var rec Record
	if _, err := fmt.Sscanf(string(data), "%d %d", &rec.Pid, &rec.StartTime); err != nil {
		return Record{}, fmt.Errorf("malformed pid file %s: %w", path, err)
	}
	if rec.Pid <= 1 {
		return Record{}, fmt.Errorf("malformed pid file %s: pid %d", path, rec.Pid)
	}
	return rec, nil
}

// Process is a pidfd on one running process. The caller either watches it
// (Exited), after which the pidfd is released when the process exits, or
// releases it with Close.
type Process struct {
	rec Record
	f   *os.File // non-blocking pidfd

	mu      sync.Mutex
	watched bool
	closed  bool
	exited  chan struct{}
}

// Open returns the process rec names if, and only if, that very process
// still runs: its pidfd is opened first and the start time checked after,
// so the pidfd names the process that matched. A zombie is not running.
func Open(rec Record) (*Process, error) {
	p, err := OpenPid(rec.Pid)
	if err != nil {
		return nil, err
	}
	if p.rec.StartTime != rec.StartTime {
		p.Close()
		return nil, fmt.Errorf("pid %d names another process now (start time %d, not %d): %w", rec.Pid, p.rec.StartTime, rec.StartTime, ErrNotRunning)
	}
	return p, nil
}

// Adopt opens the process the pid file at path names, if it still runs
// (ReadPidFile, then Open).
func Adopt(path string) (*Process, error) {
	rec, err := ReadPidFile(path)
	if err != nil {
		return nil, err
	}
	return Open(rec)
}

// OpenPid opens the process pid names now and records its start time, read
// after the pidfd was opened, so the Record names the process the pidfd
// holds. For a process just started (a child not yet reaped cannot have
// lost its pid) the Record is then written to a pid file.
func OpenPid(pid int) (*Process, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("pid %d: %w", pid, ErrNotRunning)
	}
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("process %d: %w", pid, ErrNotRunning)
		}
		return nil, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	st, err := StartTime(pid)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	// A non-blocking descriptor is registered with the runtime's poller.
	return &Process{rec: Record{Pid: pid, StartTime: st}, f: os.NewFile(uintptr(fd), "pidfd"), exited: make(chan struct{})}, nil
}

// Pid returns the process's pid.
func (p *Process) Pid() int { return p.rec.Pid }

// Record returns the process's identity, as kept in a pid file.
func (p *Process) Record() Record { return p.rec }

// Signal sends sig through the pidfd, so it reaches this process and never
// a later one with the same pid. Once the process has exited and its pidfd
// was released it returns an error wrapping ErrNotRunning.
func (p *Process) Signal(sig syscall.Signal) error {
	rc, err := p.f.SyscallConn()
	if err != nil {
		return fmt.Errorf("process %d: %w", p.rec.Pid, err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.PidfdSendSignal(int(fd), sig, nil, 0)
	}); err != nil {
		// The pidfd was released: the process has exited (or was closed).
		return fmt.Errorf("process %d: %w", p.rec.Pid, ErrNotRunning)
	}
	if errors.Is(serr, unix.ESRCH) {
		return fmt.Errorf("process %d: %w", p.rec.Pid, ErrNotRunning)
	}
	return serr
}

// Exited returns a channel closed when the process exits (becomes a
// zombie or is gone). The first call starts the watch, which from then on
// owns the pidfd and closes it after the exit; Close is then a no-op. The
// wait parks in the Go runtime's poller: no OS thread is held per process.
func (p *Process) Exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.watched && !p.closed {
		p.watched = true
		go p.watch()
	}
	return p.exited
}

func (p *Process) watch() {
	defer close(p.exited)
	defer p.f.Close()
	rc, err := p.f.SyscallConn()
	if err == nil {
		err = rc.Read(func(fd uintptr) bool {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(pfd, 0)
			return (n > 0 && pfd[0].Revents != 0) || (err != nil && !errors.Is(err, unix.EINTR))
		})
	}
	if err != nil {
		// Not pollable through the runtime (it should be): wait in a
		// blocking poll rather than report an exit that did not happen.
		rc, rerr := p.f.SyscallConn()
		if rerr != nil {
			return
		}
		_ = rc.Control(func(fd uintptr) {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			for {
				if _, err := unix.Poll(pfd, -1); !errors.Is(err, unix.EINTR) {
					return
				}
			}
		})
	}
}

// Close releases the pidfd of a process that is not watched (Exited's
// channel then never closes). After Exited it does nothing: the watch
// releases the pidfd.
func (p *Process) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.watched || p.closed {
		return nil
	}
	p.closed = true
	return p.f.Close()
}

// Running reports whether the process behind an Exited channel still runs:
// false for a nil channel (nothing started or watched) and for a closed one.
func Running(exited <-chan struct{}) bool {
	if exited == nil {
		return false
	}
	select {
	case <-exited:
		return false
	default:
		return true
	}
}
