package agent

import (
	"fmt"
	"net/http"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// File operations as a user (the user= query parameter of the files
// routes). The operation runs on an OS thread of its own whose credentials
// are switched to the user's, so the kernel's own permission checks apply
// (a user cannot write into /root) and files it creates are the user's.
//
// Credentials are per thread in the kernel (and in gVisor's sentry); the
// POSIX rule that they are per process is glibc's and Go's doing
// (syscall.Setresuid and syscall.Setgroups run on every thread through
// AllThreadsSyscall). So the switch uses the raw syscalls on a locked
// thread: setgroups, setresgid(-1, gid, -1), setresuid(-1, uid, -1). The
// real and saved ids stay 0, which is what lets the thread switch back
// (an unprivileged thread may set its effective uid to its real or saved
// one); while switched its effective capabilities are empty, so nothing
// that runs there has root's privileges. setfsuid would be the narrower
// tool, but gVisor answers it with ENOSYS (gvisor.dev/issue/260), and one
// path for every runtime is worth more than the narrower one on two.
//
// Threads the Go runtime creates while a locked thread runs are cloned
// from its template thread, not from the locked one, so they never inherit
// the user's credentials. If switching back fails the goroutine exits with
// the thread still locked, and the runtime destroys that thread instead of
// reusing it.

// userIdentity resolves the request's user= query parameter. nil means the
// agent's own identity (root), which needs no switch.
func (a *Agent) userIdentity(r *http.Request) (*identity, error) {
	spec := r.URL.Query().Get(agentproto.QueryUser)
	if spec == "" {
		return nil, nil
	}
	id, err := a.resolveUser(spec)
	if err != nil {
		return nil, err
	}
	if id.uid == 0 && id.gid == 0 {
		return nil, nil // root: the agent already is
	}
	return id, nil
}

// threadPanic carries a panic from the switched thread to the caller's
// goroutine (handlers abort streams with panic(http.ErrAbortHandler)).
type threadPanic struct{ v any }

// runAs runs fn with id's credentials (nil: as the agent) and returns its
// error. fn runs on another goroutine; a panic in it is re-raised here.
func runAs(id *identity, fn func() error) error {
	if id == nil {
		return fn()
	}
	agentGroups() // read before any thread is switched
	done := make(chan any, 1)
	go func() {
		runtime.LockOSThread()
		var res any
		if err := switchThread(id); err != nil {
			res = err
		} else {
			res = callRecovering(fn)
		}
		if err := restoreThread(); err != nil {
			// Leave the thread locked: when this goroutine returns, the
			// runtime terminates it instead of running other goroutines
			// with a user's credentials.
			done <- fmt.Errorf("restoring the agent's credentials: %w: %w", err, errdefs.ErrUnavailable)
			return
		}
		// The switches made the kernel reset the process's dumpable flag
		// to fs.suid_dumpable; make it non-dumpable again (harden.go).
		if hardened.Load() {
			if err := setNonDumpable(); err != nil && res == nil {
				res = err
			}
		}
		runtime.UnlockOSThread()
		done <- res
	}()
	switch res := (<-done).(type) {
	case nil:
		return nil
	case threadPanic:
		panic(res.v)
	case error:
		return res
	default:
		panic(res)
	}
}

func callRecovering(fn func() error) (res any) {
	defer func() {
		if p := recover(); p != nil {
			res = threadPanic{p}
		}
	}()
	if err := fn(); err != nil {
		return err
	}
	return nil
}

const keepID = ^uintptr(0) // -1: leave this id as it is

// switchThread gives the calling (locked) thread id's groups, gid and uid.
func switchThread(id *identity) error {
	groups := make([]int, len(id.groups))
	for i, g := range id.groups {
		groups[i] = int(g)
	}
	// x/sys's Setgroups is the raw, per-thread syscall (unlike syscall's).
	if err := unix.Setgroups(groups); err != nil {
		return fmt.Errorf("acting as uid %d: setgroups: %w: %w", id.uid, err, errdefs.ErrUnprocessable)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, keepID, uintptr(id.gid), keepID); e != 0 {
		return fmt.Errorf("acting as uid %d: setresgid %d: %w: %w", id.uid, id.gid, e, errdefs.ErrUnprocessable)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keepID, uintptr(id.uid), keepID); e != 0 {
		return fmt.Errorf("acting as uid %d: setresuid: %w: %w", id.uid, e, errdefs.ErrUnprocessable)
	}
	// Trust but verify: a kernel that ignored a call must not let the
	// operation run as root.
	if euid, egid := threadIDs(); euid != id.uid || egid != id.gid {
		return fmt.Errorf("acting as uid %d: the thread is uid %d gid %d: %w", id.uid, euid, egid, errdefs.ErrUnavailable)
	}
	return nil
}

// restoreThread switches the calling thread back to root: uid first (it
// gives back the capabilities the gid and groups need).
func restoreThread() error {
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keepID, 0, keepID); e != 0 {
		return fmt.Errorf("setresuid 0: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, keepID, 0, keepID); e != 0 {
		return fmt.Errorf("setresgid 0: %w", e)
	}
	if err := unix.Setgroups(agentGroups()); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if euid, egid := threadIDs(); euid != 0 || egid != 0 {
		return fmt.Errorf("the thread is still uid %d gid %d", euid, egid)
	}
	return nil
}

// threadIDs returns the calling thread's effective uid and gid.
func threadIDs() (uint32, uint32) {
	euid, _, _ := unix.RawSyscall(unix.SYS_GETEUID, 0, 0, 0)
	egid, _, _ := unix.RawSyscall(unix.SYS_GETEGID, 0, 0, 0)
	return uint32(euid), uint32(egid)
}

// agentGroups are the agent's own supplementary groups, read once, before
// the first switch (every thread has them but one switched by runAs).
var agentGroups = sync.OnceValue(func() []int {
	g, err := unix.Getgroups()
	if err != nil || g == nil {
		return []int{}
	}
	return g
})
