package agent

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// reaper owns wait4 for the whole process. The agent is PID 1 of its
// sandbox, so every orphan in the sandbox becomes its child and must be
// reaped; exec.Cmd.Wait cannot be used because it would race this global
// wait4(-1) loop. Outside a sandbox (tests) the agent makes itself a child
// subreaper so orphans behave the same way.
//
// Locking: mu is write-held while reaping and read-held while forking and
// signalling. A child cannot be reaped between ForkExec and its
// registration (no exit status is ever lost to the "exited before
// registered" race), and a pid is never signalled after it was reaped (so a
// recycled pid is never hit).
type reaper struct {
	log *slog.Logger
	mu  sync.RWMutex

	wmu     sync.Mutex
	waiters map[int]chan unix.WaitStatus
}

var (
	reaperOnce sync.Once
	theReaper  *reaper
	reaperErr  error
)

// startReaper starts the process-wide reaper once.
func startReaper(log *slog.Logger) (*reaper, error) {
	reaperOnce.Do(func() {
		if os.Getpid() != 1 {
			if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
				reaperErr = fmt.Errorf("prctl(PR_SET_CHILD_SUBREAPER): %w", err)
				return
			}
		}
		// Descriptors inherited without close-on-exec (from whatever started
		// the agent) must not reach the processes it runs.
		if err := unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC); err != nil {
			log.Warn("cannot mark inherited descriptors close-on-exec", "err", err)
		}
		r := &reaper{log: log, waiters: map[int]chan unix.WaitStatus{}}
		ch := make(chan os.Signal, 1)
		signal.Notify(ch, unix.SIGCHLD)
		go func() {
			r.reapAll() // children that exited before Notify
			for range ch {
				r.reapAll()
			}
		}()
		theReaper = r
	})
	return theReaper, reaperErr
}

// reapAll collects every exited child and hands each status to its owner.
func (r *reaper) reapAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
		r.wmu.Lock()
		ch, ok := r.waiters[pid]
		delete(r.waiters, pid)
		r.wmu.Unlock()
		if ok {
			ch <- ws // buffered: never blocks
		} else {
			r.log.Debug("reaped orphan", "pid", pid, "status", describeStatus(ws))
		}
	}
}

// start forks and executes argv0 and registers the child. The returned
// channel receives the child's wait status exactly once.
func (r *reaper) start(argv0 string, argv []string, attr *syscall.ProcAttr) (int, <-chan unix.WaitStatus, error) {
	ch := make(chan unix.WaitStatus, 1)
	r.mu.RLock()
	defer r.mu.RUnlock()
	pid, err := syscall.ForkExec(argv0, argv, attr)
	if err != nil {
		return 0, nil, err
	}
	r.wmu.Lock()
	r.waiters[pid] = ch
	r.wmu.Unlock()
	return pid, ch, nil
}

// signalGroup sends sig to the process group led by pid (every process the
// agent starts leads its own session and group), or to pid alone if it has
// left its group, unless pid has already been reaped.
func (r *reaper) signalGroup(pid int, sig unix.Signal) error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	r.wmu.Lock()
	_, alive := r.waiters[pid]
	r.wmu.Unlock()
	if !alive {
		return fmt.Errorf("process %d has already exited: %w", pid, errdefs.ErrConflict)
	}
	err := unix.Kill(-pid, sig)
	if err == unix.ESRCH {
		err = unix.Kill(pid, sig)
	}
	if err != nil {
		return fmt.Errorf("kill %d: %w", pid, err)
	}
	return nil
}
