package cgroupfs

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// StartIn starts cmd as a member of the group from its first instruction,
// instead of moving it in after it started (AddProc). A move of a running
// process takes the kernel's global cgroup_threadgroup_rwsem for writing,
// which waits for an RCU grace period per hierarchy: 10–15 ms for the six
// v1 hierarchies of a sandbox on a busy 2-core VM. Neither way below takes
// that lock.
//
// v2: clone3(CLONE_INTO_CGROUP) with a descriptor of the group's directory.
// v1: an OS thread joins every hierarchy by writing "0" to its "tasks"
// files (the kernel then moves only the calling thread, and skips the
// global lock), forks the child, which inherits the thread's cgroups, and
// goes back where it was the same way. Should it fail to go back, the
// thread is never given back to the Go scheduler: its goroutine ends
// locked, so the runtime ends the thread. The main thread, which the
// runtime cannot end, takes the slow way instead (start, then AddProc).
//
// Everything cmd.Start opens should be set up by the caller
// (Stdin/Stdout/Stderr as *os.File), since on v1 it would be opened from
// inside the group (its device rules). A page the thread faults in on the
// way is charged to the group's memory cgroup; cmd.Start's few small
// allocations come from pages the process already has.
func (g *Group) StartIn(cmd *exec.Cmd) error {
	if g.unified {
		dir, err := os.OpenFile(g.dirs[""], unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open cgroup: %w", err)
		}
		defer dir.Close()
		if cmd.SysProcAttr == nil {
			cmd.SysProcAttr = &syscall.SysProcAttr{}
		}
		cmd.SysProcAttr.UseCgroupFD = true
		cmd.SysProcAttr.CgroupFD = int(dir.Fd())
		return cmd.Start()
	}
	errc := make(chan error, 1)
	go func() {
		goruntime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// The main thread cannot end: if it could not go back, it
			// would stay in the group (and be killed with it).
			goruntime.UnlockOSThread()
			errc <- g.startThenAdd(cmd)
			return
		}
		back, err := g.joinThread()
		if err == nil {
			err = cmd.Start()
		}
		if back() == nil {
			goruntime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// joinThread moves the calling thread, and only it, into every v1
// hierarchy of the group; back moves it to where it was.
func (g *Group) joinThread() (back func() error, err error) {
	if g.unified {
		return func() error { return nil }, errors.New("cgroup v2 does not move single threads between domain cgroups")
	}
	here, err := os.ReadFile("/proc/thread-self/cgroup")
	if err != nil {
		return func() error { return nil }, err
	}
	// The "tasks" file of each hierarchy this thread is in now.
	var origin []string
	for c, mount := range g.mounts {
		path, ok := v1Path(string(here), c)
		if !ok {
			return func() error { return nil }, fmt.Errorf("this thread is in no %s cgroup", c)
		}
		origin = append(origin, filepath.Join(mount, path, "tasks"))
	}
	back = func() error {
		var errs []error
		for _, f := range origin {
			errs = append(errs, writeFile(f, "0"))
		}
		return errors.Join(errs...)
	}
	for _, d := range g.Paths() {
		if err := writeFile(filepath.Join(d, "tasks"), "0"); err != nil {
			return back, err
		}
	}
	return back, nil
}

// v1Path finds controller's hierarchy in a /proc/…/cgroup listing and
// returns the cgroup path there.
func v1Path(listing, controller string) (string, bool) {
	for _, line := range strings.Split(listing, "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 && slices.Contains(strings.Split(f[1], ","), controller) {
			return f[2], true
		}
	}
	return "", false
}

// startThenAdd is the slow way: start, then move the process in.
func (g *Group) startThenAdd(cmd *exec.Cmd) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	if err := g.AddProc(cmd.Process.Pid); err != nil {
		_ = cmd.Process.Kill()
		return err
	}
	return nil
}
