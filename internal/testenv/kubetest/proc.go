package kubetest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// proc is one component process, its output in Dir/<name>.log.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed when it has exited
	err  error         // its Wait error, once done
}

// start starts a component; path is put before $PATH.
func (c *Cluster) start(name, bin, path string, args ...string) (*proc, error) {
	log, err := os.OpenFile(filepath.Join(c.Dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.Command(bin, args...)
	cmd.Dir = c.Dir
	cmd.Stdout, cmd.Stderr = log, log
	// No proxy, no kubeconfig or HOME of the machine's user.
	p := os.Getenv("PATH")
	if path != "" {
		p = path + ":" + p
	}
	cmd.Env = []string{"PATH=" + p, "HOME=" + filepath.Join(c.Dir, "home")}
	// Its own process group (Close kills the group: anything it forked
	// goes too), and SIGKILL when the test process dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := startOnSpawner(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	pr := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		pr.err = cmd.Wait()
		close(pr.done)
	}()
	c.procs = append(c.procs, pr)
	return pr, nil
}

// stop kills p's process group and waits for p.
func (p *proc) stop() {
	if p == nil {
		return
	}
	select {
	case <-p.done:
	default:
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
	// Children that left the group would have been reparented; a
	// component's forks (mount, nsenter) are short and in its group.
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
}

// Pdeathsig fires when the thread that forked the child exits, not the
// process: a component started from a goroutine whose locked OS thread
// later ends (code that leaves a thread in another namespace lets it die)
// would be killed under the test. So every component is forked from one
// goroutine that holds its thread for the life of the test process.
var spawn = make(chan func())

func init() {
	go func() {
		runtime.LockOSThread() // never unlocked: this thread never exits
		for f := range spawn {
			f()
		}
	}()
}

func startOnSpawner(cmd *exec.Cmd) error {
	errc := make(chan error, 1)
	spawn <- func() { errc <- cmd.Start() }
	return <-errc
}

// waitFor polls check every 50 ms until it succeeds, p (when not nil)
// exits, ctx ends or timeout passes; the error names what and carries the
// last check error and, for a component, the end of its log.
func (c *Cluster) waitFor(ctx context.Context, p *proc, timeout time.Duration, what string, check func() error) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if last = check(); last == nil {
			return nil
		}
		var exited <-chan struct{}
		if p != nil {
			exited = p.done
		}
		select {
		case <-exited:
			return fmt.Errorf("waiting for %s: %s exited (%v); its log ends:\n%s", what, p.name, p.err, c.LogTail(p.name, 4096))
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last: %v)", what, ctx.Err(), last)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			tail := ""
			if p != nil {
				tail = "; " + p.name + "'s log ends:\n" + c.LogTail(p.name, 4096)
			}
			return fmt.Errorf("waiting for %s: timed out after %v (last: %v)%s", what, timeout, last, tail)
		}
	}
}

// StopKubelet stops the kubelet (Close does too); the node's pods keep
// running in the CRI.
func (c *Cluster) StopKubelet() {
	c.kubelet.stop()
}

// Close stops everything in reverse order — kubelet, the CRI (opts.StopCRI),
// apiserver, etcd — and then removes every trace on the host: mounts below
// Dir, the cluster's cgroups, the kernel settings and log directory the
// kubelet changed, and Dir itself.
func (c *Cluster) Close() error {
	if c == nil || c.closed {
		return nil
	}
	c.closed = true
	var errs []error
	c.kubelet.stop()
	if c.opts.StopCRI != nil {
		if err := c.opts.StopCRI(); err != nil {
			errs = append(errs, fmt.Errorf("stopping the CRI: %w", err))
		}
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].stop()
	}
	if err := cleanDir(c.Dir); err != nil {
		errs = append(errs, err)
	}
	if c.lock != nil {
		c.lock.Close()
	}
	return errors.Join(errs...)
}

// Sweep cleans what killed test processes left: every kubetest directory
// in the temp dir whose lock no live process holds is cleaned as Close
// would (its processes died with their test through Pdeathsig).
func Sweep() {
	ents, _ := os.ReadDir(os.TempDir())
	for _, e := range ents {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), dirPrefix) {
			continue
		}
		dir := filepath.Join(os.TempDir(), e.Name())
		f, err := os.Open(filepath.Join(dir, "lock"))
		if err != nil {
			continue // not made by Start, or half made: leave it
		}
		if syscallFlockNB(f) == nil {
			cleanDir(dir)
		}
		f.Close()
	}
}
