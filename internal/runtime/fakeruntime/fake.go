// Package fakeruntime is a runtime.Runtime with no isolation at all: each
// instance is the real space-agent running as a plain host process, its file
// operations confined to a per-instance directory. It exists so the manager's
// state machine (operations, waking, idle policy, TTL, reconcile after a
// restart) can be tested quickly and without privileges beyond a template
// import. It is never registered in a server.
package fakeruntime

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// Name is the name tests use for this runtime.
const Name = "fake"

var (
	_ runtime.Runtime     = (*Runtime)(nil)
	_ runtime.Instance    = (*Instance)(nil)
	_ runtime.Pauser      = (*Instance)(nil)
	_ runtime.NICProvider = (*Instance)(nil)
)

// live holds the agent processes of every fake runtime in this test binary,
// by instance directory, so a second Runtime on the same DataDir (a
// "restarted server") can re-adopt them the way a real runtime would.
var (
	liveMu sync.Mutex
	live   = map[string]*process{}
)

type process struct {
	cmd    *exec.Cmd
	exited chan struct{}
}

// Runtime is the fake runtime.
type Runtime struct {
	cfg  runtime.Config
	opts Options

	faultMu sync.Mutex
	faults  map[string]fault // by verb: the next call fails
}

// Options turn on the fake's optional abilities.
type Options struct {
	// Suspend makes instances runtime.Suspenders and Fork makes them
	// runtime.Forkers — WITHOUT ANY MEMORY: the fake cannot checkpoint a
	// process. Suspend stops the agent and leaves a marker file (the
	// "image"), Restore starts a fresh agent and removes it, Fork starts a
	// fresh agent per child on a copy of the parent's files. Every process
	// of the sandbox and its memory are LOST across these verbs. They exist
	// only to drive the manager's state machine (phases, failures, wake,
	// idle suspend, restart) in tests; real suspend/fork semantics are
	// tested against real runtimes.
	Suspend, Fork bool
	// Stats, when set, answers Instance.Stats of a running instance (the
	// fake has no cgroup to read): tests feed the counters they need.
	Stats func(id string) runtime.Stats
}

type fault struct {
	err          error
	discardImage bool
}

// New builds a fake runtime rooted at cfg.DataDir.
func New(cfg runtime.Config) *Runtime { return NewWithOptions(cfg, Options{}) }

// NewWithOptions builds a fake runtime with optional abilities.
func NewWithOptions(cfg runtime.Config, opts Options) *Runtime {
	return &Runtime{cfg: cfg, opts: opts, faults: map[string]fault{}}
}

// FailNext makes the next call of verb (api.OpSuspend, api.OpRestore,
// api.OpFork, or "nic" for NIC) on any instance fail with err, honouring the runtime
// contract for failures: a failed suspend leaves the instance running, a
// failed restore keeps the image unless discardImage, a failed fork leaves
// no child behind.
func (r *Runtime) FailNext(verb string, err error, discardImage bool) {
	r.faultMu.Lock()
	defer r.faultMu.Unlock()
	r.faults[verb] = fault{err: err, discardImage: discardImage}
}

func (r *Runtime) takeFault(verb string) (fault, bool) {
	r.faultMu.Lock()
	defer r.faultMu.Unlock()
	f, ok := r.faults[verb]
	delete(r.faults, verb)
	return f, ok
}

func (r *Runtime) Name() string { return Name }

func (r *Runtime) Probe(context.Context) runtime.Capabilities {
	verbs := map[string]bool{}
	for _, v := range []string{api.OpCreate, api.OpDelete, api.OpStop, api.OpStart, api.OpPause, api.OpResume, api.OpWake} {
		verbs[v] = true
	}
	why := "the fake runtime keeps no memory images"
	reasons := map[string]string{}
	if r.opts.Suspend {
		verbs[api.OpSuspend], verbs[api.OpRestore] = true, true
	} else {
		reasons[api.OpSuspend], reasons[api.OpRestore] = why, why
	}
	if r.opts.Fork {
		verbs[api.OpFork] = true
	} else {
		reasons[api.OpFork] = why
	}
	return runtime.Capabilities{
		Available: true, Isolation: "none (test fake)", Strength: 0, Verbs: verbs, VerbReasons: reasons,
	}
}

// instance wraps a base instance with the optional abilities turned on.
func (r *Runtime) instance(i *Instance) runtime.Instance {
	switch {
	case r.opts.Suspend && r.opts.Fork:
		return &suspendForkInstance{suspendInstance{i}}
	case r.opts.Suspend:
		return &suspendInstance{i}
	case r.opts.Fork:
		return &forkInstance{i}
	}
	return i
}

func (r *Runtime) dir(id string) string { return filepath.Join(r.cfg.DataDir, id) }

func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (runtime.Instance, error) {
	d := r.dir(spec.ID)
	if err := os.MkdirAll(filepath.Join(d, "root"), 0o755); err != nil {
		return nil, err
	}
	return r.instance(&Instance{rt: r, id: spec.ID, dir: d}), nil
}

func (r *Runtime) Open(ctx context.Context, spec runtime.Spec) (runtime.Instance, error) {
	d := r.dir(spec.ID)
	if _, err := os.Stat(d); err != nil {
		return nil, fmt.Errorf("fake instance %s: %w", spec.ID, errdefs.ErrNotFound)
	}
	return r.instance(&Instance{rt: r, id: spec.ID, dir: d}), nil
}

func (r *Runtime) Sweep(ctx context.Context, keep func(string) bool) ([]string, error) {
	ents, err := os.ReadDir(r.cfg.DataDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range ents {
		if keep(e.Name()) {
			continue
		}
		in := &Instance{rt: r, id: e.Name(), dir: r.dir(e.Name())}
		if err := in.Destroy(ctx); err != nil {
			return removed, err
		}
		removed = append(removed, e.Name())
	}
	return removed, nil
}

// Instance is one fake sandbox: an agent process.
type Instance struct {
	rt  *Runtime
	id  string
	dir string
}

func (i *Instance) ID() string { return i.id }

func (i *Instance) proc() *process {
	liveMu.Lock()
	defer liveMu.Unlock()
	return live[i.dir]
}

func (i *Instance) sock() string { return filepath.Join(i.dir, "agent.sock") }

func (i *Instance) Start(ctx context.Context) error {
	if p := i.proc(); p != nil {
		select {
		case <-p.exited:
		default:
			return nil
		}
	}
	os.Remove(i.sock())
	cmd := exec.Command(i.rt.cfg.AgentBinary, "--socket", i.sock(), "--root", filepath.Join(i.dir, "root"))
	// Its own UTS namespace: a restored or forked agent sets its hostname
	// (agentproto.PathRestored), which must not rename the test host.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Cloneflags: syscall.CLONE_NEWUTS}
	// The agent's log, for a test that wonders why it died.
	logf, err := os.OpenFile(filepath.Join(i.dir, "agent.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd.Stderr = logf
	if err := cmd.Start(); err != nil {
		return err
	}
	p := &process{cmd: cmd, exited: make(chan struct{})}
	go func() { cmd.Wait(); close(p.exited) }()
	liveMu.Lock()
	live[i.dir] = p
	liveMu.Unlock()
	// Start returns once the stream can be dialled, like real runtimes.
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("unix", i.sock()); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-p.exited:
			return errors.New("fake agent exited during start")
		case <-time.After(5 * time.Millisecond):
		}
	}
	return errors.New("fake agent socket never appeared")
}

func (i *Instance) Alive() bool {
	p := i.proc()
	if p == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

func (i *Instance) DialAgent(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "unix", i.sock())
}

func (i *Instance) signal(sig syscall.Signal) error {
	p := i.proc()
	if p == nil {
		return nil
	}
	return syscall.Kill(-p.cmd.Process.Pid, sig)
}

func (i *Instance) Stop(ctx context.Context) error {
	// Stopping a suspended instance discards its image.
	if err := os.Remove(i.imagePath()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return i.kill(ctx)
}

// kill ends the agent process (and its group).
func (i *Instance) kill(ctx context.Context) error {
	p := i.proc()
	if p == nil {
		return nil
	}
	i.signal(syscall.SIGCONT)
	i.signal(syscall.SIGKILL)
	select {
	case <-p.exited:
	case <-ctx.Done():
		return ctx.Err()
	}
	liveMu.Lock()
	delete(live, i.dir)
	liveMu.Unlock()
	return nil
}

func (i *Instance) Destroy(ctx context.Context) error {
	if err := i.Stop(ctx); err != nil {
		return err
	}
	return os.RemoveAll(i.dir)
}

func (i *Instance) Stats(context.Context) (runtime.Stats, error) {
	if f := i.rt.opts.Stats; f != nil && i.proc() != nil {
		return f(i.id), nil
	}
	return runtime.Stats{}, nil
}

func (i *Instance) Exited() <-chan struct{} {
	if p := i.proc(); p != nil {
		return p.exited
	}
	return nil
}

func (i *Instance) Pause(context.Context) error  { return i.signal(syscall.SIGSTOP) }
func (i *Instance) Resume(context.Context) error { return i.signal(syscall.SIGCONT) }

// NIC returns one end of a fresh datagram socket pair whose other end is
// closed (frames written go nowhere): enough for the manager's attach path
// to run against a fake gateway. It fails unless the instance runs, as a
// real NIC would, and when FailNext("nic", …) armed a fault.
func (i *Instance) NIC(ctx context.Context) (*os.File, error) {
	if f, ok := i.rt.takeFault("nic"); ok {
		return nil, f.err
	}
	if !i.Alive() {
		return nil, fmt.Errorf("fake instance %s is not running: %w", i.id, errdefs.ErrConflict)
	}
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fake NIC: %w", err)
	}
	syscall.Close(fds[1])
	return os.NewFile(uintptr(fds[0]), "fake-nic-"+i.id), nil
}
