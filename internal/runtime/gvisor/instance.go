package gvisor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/hostproc"
)

// startTimeout bounds `runsc run` plus the agent binding its socket.
const startTimeout = 60 * time.Second

// An instance is one sandbox: one gVisor sandbox (runsc container) at a
// time, started from a bundle over the sandbox's overlay root, or
// restored from a checkpoint. It is the value the manager holds; its own
// methods are the runtime interfaces it implements and the lifecycle
// steps that change pid and exited, which mu guards with the lifecycle
// itself. The rest of the work is in fields of their own types:
//
//   - files (layout, layout.go): the sandbox directory's names, and
//     mounting the root there;
//   - agent (agentChan, agentchan.go): the host's side of the agent's
//     socket;
//   - ckpt (checkpointer, suspend.go, fork.go): suspend images and
//     checkpoints of the paused sandbox;
//   - meter (meter, stats.go): what Stats and OOMKills read;
//   - rs (runsc, runsc.go): the runsc command runner.
type instance struct {
	rt    *Runtime
	rs    *runsc
	spec  runtime.Spec
	files layout // the sandbox's directory

	mu     sync.Mutex
	pid    int             // sandbox (sentry) pid on the host; 0 when not running
	exited <-chan struct{} // closed when the sandbox process exits

	agent *agentChan    // the agent's socket
	ckpt  *checkpointer // suspend images and checkpoints
	meter *meter        // stats and the OOM count
}

var (
	_ runtime.Instance       = (*instance)(nil)
	_ runtime.Pauser         = (*instance)(nil)
	_ runtime.ChangeExporter = (*instance)(nil)
	_ runtime.NICProvider    = (*instance)(nil)
	_ runtime.OOMCounter     = (*instance)(nil)
)

// ID implements runtime.Instance.
func (i *instance) ID() string { return i.spec.ID }

// Dir is the sandbox's directory on the host.
func (i *instance) Dir() string { return i.files.dir }

// Pid is the host pid of the sandbox process (gVisor's sentry), 0 when not
// running. The sentry runs unprivileged on the host; the conformance suite
// checks that through this.
func (i *instance) Pid() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.aliveLocked() {
		return 0
	}
	return i.pid
}

func (i *instance) aliveLocked() bool { return hostproc.Running(i.exited) }

// Alive implements runtime.Instance.
func (i *instance) Alive() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.aliveLocked()
}

// Exited implements runtime.Instance.
func (i *instance) Exited() <-chan struct{} {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.exited
}

// adopt attaches to a sandbox process that still runs (server restart).
func (i *instance) adopt(ctx context.Context) {
	if p, err := hostproc.Adopt(i.files.pidFile()); err == nil {
		i.pid, i.exited = p.Pid(), p.Exited()
	}
}

// DialAgent implements runtime.Instance. The socket lives in a directory
// the sandbox can write, so it is opened without following symlinks and
// must be a socket: the sandbox cannot point the host at another socket.
func (i *instance) DialAgent(ctx context.Context) (net.Conn, error) {
	if !i.Alive() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrUnavailable)
	}
	return i.agent.dial(ctx)
}

// Start implements runtime.Instance.
func (i *instance) Start(ctx context.Context) (err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.aliveLocked() {
		return fmt.Errorf("sandbox %s is already running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if i.ckpt.saved() {
		return fmt.Errorf("sandbox %s is suspended (restore or destroy it): %w", i.spec.ID, errdefs.ErrConflict)
	}
	if _, err := os.Stat(i.files.dir); err != nil {
		return fmt.Errorf("sandbox %s: %w", i.spec.ID, errdefs.ErrNotFound)
	}
	t0 := time.Now()
	// Whatever step fails, nothing of this start stays (mounts, runsc
	// container, processes); the disk image is kept.
	defer func() {
		if err != nil {
			i.stopLocked(context.WithoutCancel(ctx))
		}
	}()
	if err := i.files.mountRoot(i.spec.RootFS, i.rt.usernsFD); err != nil {
		return err
	}
	hostname := i.spec.Hostname
	if hostname == "" {
		hostname = i.spec.ID
	}
	writeHostFiles(i.files.rootfsDir(), hostname)
	if err := prepareNIC(i.files.netnsPath(), i.spec.ID); err != nil {
		return err
	}
	bs := bundleSpec(i.spec.ID, i.files.rootfsDir(), hostname, i.files.agentDir(), i.rt.cfg.AgentBinary, i.files.netnsPath(), i.spec.Limits)
	if i.spec.Background {
		bs.background()
	}
	if err := writeSpec(i.files.dir, bs); err != nil {
		return err
	}
	tPrepared := time.Now()
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	runArgs := []string{"--detach", "--bundle", i.files.dir, "--pid-file", i.files.runscPid(), i.spec.ID}
	if err := i.rs.runReplacingStale(ctx, startTimeout, "run", i.spec.ID, runArgs...); err != nil {
		return fmt.Errorf("start sandbox %s: %w", i.spec.ID, err)
	}
	tRun := time.Now()
	exited, pid, err := i.trackSandboxLocked()
	if err != nil {
		return fmt.Errorf("start sandbox %s: %w", i.spec.ID, err)
	}
	if err := i.agent.waitListening(ctx, exited); err != nil {
		return err
	}
	i.rt.log.Debug("sandbox started", "id", i.spec.ID, "pid", pid,
		"prepare", tPrepared.Sub(t0), "runsc_run", tRun.Sub(tPrepared), "agent_socket", time.Since(tRun))
	return nil
}

// Stop implements runtime.Instance: runsc deletes the container (killing
// the sandbox), the overlay and disk are unmounted and kept.
// A suspended instance's memory image is discarded: stopped means no saved
// processes, and the next Start boots afresh from the disk.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.stopLocked(ctx); err != nil {
		return err
	}
	return i.ckpt.discard()
}

func (i *instance) stopLocked(ctx context.Context) error {
	var errs []error
	if err := i.rs.deleteForce(ctx, i.spec.ID); err != nil {
		// runsc could not (it timed out, its state is damaged): kill the
		// sandbox's host processes directly, then let runsc forget it.
		i.rt.log.Warn("runsc delete failed; killing the sandbox's processes", "id", i.spec.ID, "err", err)
		killCgroup(i.spec.ID)
		if err := i.rs.deleteForce(ctx, i.spec.ID); err != nil {
			errs = append(errs, err)
		}
	}
	if i.exited != nil {
		select {
		case <-i.exited:
		case <-time.After(10 * time.Second):
			killCgroup(i.spec.ID)
			select {
			case <-i.exited:
			case <-time.After(5 * time.Second):
				errs = append(errs, fmt.Errorf("sandbox %s process %d did not exit", i.spec.ID, i.pid))
			}
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	i.pid, i.exited = 0, nil
	// runsc removes the cgroups it made; a sandbox that died without runsc
	// may leave them (with a gofer still in them).
	killCgroup(i.spec.ID)
	i.meter.stopped()
	_ = removeCgroups(i.spec.ID)
	for _, p := range []string{i.files.sockPath(), i.files.pidFile(), i.files.runscPid()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := hostfs.UnmountAll(i.files.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Destroy implements runtime.Instance. It works on any partial state.
func (i *instance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if _, err := os.Stat(i.files.dir); errors.Is(err, os.ErrNotExist) {
		// Already destroyed; runsc may still know the id if a crash came
		// between its delete and ours.
		return i.rs.deleteForce(ctx, i.spec.ID)
	}
	if err := i.stopLocked(ctx); err != nil {
		return err
	}
	return hostfs.RemoveSandbox(i.files.dir, i.spec.ID)
}

// Pause implements runtime.Pauser: the sentry stops every task; the
// sandbox stays resident and uses no CPU.
func (i *instance) Pause(ctx context.Context) error {
	if !i.Alive() {
		return fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	_, err := i.rs.run(ctx, 0, "pause", i.spec.ID)
	return err
}

// Resume implements runtime.Pauser.
func (i *instance) Resume(ctx context.Context) error {
	if !i.Alive() {
		return fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	_, err := i.rs.run(ctx, 0, "resume", i.spec.ID)
	return err
}

// OOMKills implements runtime.OOMCounter: Stats's OOMKills alone (the
// host cgroup's and the memory guard's), without asking runsc.
func (i *instance) OOMKills() (int64, error) {
	if !i.Alive() {
		return 0, nil
	}
	return i.meter.oomKills()
}

// Foreground implements runtime.Foregrounder: the host cgroup runsc made
// gets the default CPU weight.
func (i *instance) Foreground() error {
	return sandboxCgroup(i.spec.ID).SetCPUWeight(cgroupfs.DefaultCPUWeight)
}

var _ runtime.Foregrounder = (*instance)(nil)

var _ runtime.OOMCounter = (*instance)(nil)

// Stats implements runtime.Instance: OOM kills and CPU from the host's
// cgroups plus the memory guard's kills; memory and the process count from
// the sentry (runsc events), since on the host the sandbox's processes are
// not host processes and the host cgroup also holds the sentry's own
// overhead (its limit has headroom for it): the sentry's accounting is
// what the sandbox's limit applies to (meter).
func (i *instance) Stats(ctx context.Context) (runtime.Stats, error) {
	if !i.Alive() {
		return runtime.Stats{}, nil
	}
	return i.meter.stats(ctx)
}

// Changes implements runtime.ChangeExporter: the overlay's upper directory
// on the sandbox's disk, in kernel overlayfs format (trusted.* xattrs, ids
// not shifted).
func (i *instance) Changes(ctx context.Context) (runtime.Changes, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.aliveLocked() {
		return runtime.Changes{}, fmt.Errorf("sandbox %s is running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	mounted := hostfs.IsMountPoint(i.files.rwDir())
	if err := mountDisk(i.files.diskImage(), i.files.rwDir()); err != nil {
		return runtime.Changes{}, err
	}
	var once sync.Once
	return runtime.Changes{
		Dir:         filepath.Join(i.files.rwDir(), "upper"),
		OpaqueXattr: "trusted.overlay.opaque",
		IDBase:      confine.IDBase,
		Release: func() error {
			var err error
			once.Do(func() {
				if !mounted {
					err = hostfs.UnmountAll(i.files.rwDir())
				}
			})
			return err
		},
	}, nil
}

// makeAgentDir makes the directory the agent binds its socket in, owned by
// sandbox root (the agent runs as root of its own user namespace).
func makeAgentDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return os.Lchown(dir, confine.IDBase, confine.IDBase)
}

// trackSandboxLocked reads the pid runsc wrote (run or restore), watches
// the process and records it for re-adoption.
func (i *instance) trackSandboxLocked() (<-chan struct{}, int, error) {
	data, err := os.ReadFile(i.files.runscPid())
	if err != nil {
		return nil, 0, fmt.Errorf("runsc wrote no pid: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 0 {
		return nil, 0, fmt.Errorf("bad pid %q", data)
	}
	proc, err := hostproc.OpenPid(pid)
	if err != nil {
		return nil, 0, fmt.Errorf("sandbox process: %w", err)
	}
	exited := proc.Exited()
	i.pid, i.exited = pid, exited
	if err := raiseHostMemory(i.spec.ID, i.spec.Limits); err != nil {
		return nil, 0, err
	}
	if err := hostproc.WritePidFile(i.files.pidFile(), proc.Record()); err != nil {
		return nil, 0, err
	}
	return exited, pid, nil
}
