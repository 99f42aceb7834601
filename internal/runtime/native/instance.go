package native

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/runtime/hostproc"
	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

// agentOOMScoreAdj makes the OOM killer prefer the sandbox's own processes
// over its agent. Lowering it needs CAP_SYS_RESOURCE on the host, so code in
// the sandbox cannot copy it; children inherit it but may raise it.
const agentOOMScoreAdj = -500

// setupTimeout bounds how long the init may take to build the sandbox.
const setupTimeout = 30 * time.Second

type instance struct {
	rt   *Runtime
	spec runtime.Spec
	dir  string
	cg   *cgroupfs.Group
	// oom reads cg's OOM count around every exec through a kept file;
	// closed with the cgroup.
	oomOnce sync.Once
	oom     *cgroupfs.OOMCounter

	mu     sync.Mutex
	pid    int             // init pid on the host; 0 when not running
	exited <-chan struct{} // closed when init dies; nil when not running
}

var (
	_ runtime.Instance       = (*instance)(nil)
	_ runtime.Pauser         = (*instance)(nil)
	_ runtime.ChangeExporter = (*instance)(nil)
	_ runtime.NICProvider    = (*instance)(nil)
)

func (i *instance) diskImage() string   { return filepath.Join(i.dir, "disk.img") }
func (i *instance) rwDir() string       { return filepath.Join(i.dir, "rw") }
func (i *instance) rootDir() string     { return filepath.Join(i.dir, "root") }
func (i *instance) sockPath() string    { return filepath.Join(i.dir, "agent.sock") }
func (i *instance) pidFile() string     { return filepath.Join(i.dir, "init.pid") }
func (i *instance) logFile() string     { return filepath.Join(i.rwDir(), "init.log") }
func (i *instance) exportDir() string   { return filepath.Join(i.dir, "export") }
func (i *instance) templateRef() string { return filepath.Join(i.dir, "template") }

// Dir is the sandbox's directory on the host (DataDir/sandboxes/<id>).
func (i *instance) Dir() string { return i.dir }

// ID implements runtime.Instance.
func (i *instance) ID() string { return i.spec.ID }

// Pid is the host pid of the sandbox's init (0 when not running), for
// host-side checks such as the uid mapping in /proc/<pid>/status.
func (i *instance) Pid() int {
	i.mu.Lock()
	defer i.mu.Unlock()
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

// DialAgent implements runtime.Instance.
func (i *instance) DialAgent(ctx context.Context) (net.Conn, error) {
	if !i.Alive() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrUnavailable)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", i.sockPath())
	if err != nil {
		return nil, fmt.Errorf("dial agent of %s: %w: %w", i.spec.ID, err, errdefs.ErrUnavailable)
	}
	return c, nil
}

// listen creates the agent's listening socket. The host owns it so that a
// restarted server can dial a sandbox that kept running.
func (i *instance) listen() (*os.File, error) {
	path := i.sockPath()
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), path)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		f.Close()
		return nil, fmt.Errorf("bind %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		f.Close()
		return nil, err
	}
	if err := unix.Listen(fd, 64); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Start implements runtime.Instance.
func (i *instance) Start(ctx context.Context) (err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.aliveLocked() {
		return fmt.Errorf("sandbox %s is already running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	t0 := time.Now()
	defer i.rt.disks.busy()()
	if err := i.rt.checkAgent(); err != nil {
		return fmt.Errorf("native runtime: %w: %w", err, errdefs.ErrUnavailable)
	}
	// A read-only export of the disk (Changes) is a second superblock on
	// the same image once the disk is mounted again: end it first.
	if err := i.releaseChangesLocked(); err != nil {
		return err
	}
	if err := i.recordTemplate(); err != nil {
		return err
	}
	lower, releaseLower, err := i.rt.acquireRootfs(ctx, i.spec.RootFS, i.spec.TemplateDigest)
	if err != nil {
		return err
	}
	// Held until the overlay holds the layer (setup done or failed).
	defer releaseLower()
	if err := mountDisk(i.diskImage(), i.rwDir()); err != nil {
		return err
	}
	if err := os.MkdirAll(i.rootDir(), 0o700); err != nil {
		return err
	}
	bin, err := os.Open(i.rt.initBinary())
	if err != nil {
		return err
	}
	defer bin.Close()
	agentBin := bin
	if bin.Name() != i.rt.cfg.AgentBinary {
		if agentBin, err = os.Open(i.rt.cfg.AgentBinary); err != nil {
			return err
		}
		defer agentBin.Close()
	}
	cl := cgroupLimits(i.spec.Limits)
	if i.spec.Background {
		cl.CPUWeight = cgroupfs.BackgroundCPUWeight
	}
	if err := i.cg.Create(cl); err != nil {
		return err
	}
	ln, err := i.listen()
	if err != nil {
		return err
	}
	defer ln.Close()
	logf, err := os.OpenFile(i.logFile(), os.O_CREATE|os.O_TRUNC|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cfgW, cfgR, err := configSocket()
	if err != nil {
		return err
	}
	defer cfgW.Close()
	defer cfgR.Close()
	statR, statW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer statR.Close()
	defer statW.Close()

	// Opened here rather than by cmd.Start, which on a v1 host runs inside
	// the sandbox's cgroups (devices).
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer devNull.Close()
	cmd := &exec.Cmd{
		// Exec through the descriptor: the binary's directory need not be
		// reachable by the sandbox's uid.
		Path:  fmt.Sprintf("/proc/self/fd/%d", nsinit.FDAgentBinary),
		Args:  []string{filepath.Base(bin.Name()), nsinit.RoleSetup},
		Stdin: devNull,
		// Nothing of the server's environment (non-nil: nil would inherit it).
		Env:    []string{},
		Stdout: logf,
		Stderr: logf,
		// fd 3, 4, 5, 6: nsinit.FDAgentListener, FDConfig, FDStatus,
		// FDAgentBinary; 7–10 are the init's (the layers); 11:
		// FDAgentExe.
		ExtraFiles: []*os.File{ln, cfgR, statW, bin, nil, nil, nil, nil, agentBin},
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: unix.CLONE_NEWUSER | unix.CLONE_NEWNS | unix.CLONE_NEWPID |
				unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostIDBase, Size: idRange}},
			// Become the namespace's root (host uid 100000000): the host's
			// root is not mapped inside and would be nobody, without caps.
			Credential:                 &syscall.Credential{Uid: 0, Gid: 0},
			GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostIDBase, Size: idRange}},
			GidMappingsEnableSetgroups: true,
			// Its own session: no signal from the server's terminal or
			// process group reaches it. No Pdeathsig: sandboxes outlive a
			// crashed server and get re-adopted.
			Setsid: true,
		},
	}
	tPrepared := time.Now()
	conf := nsinit.Config{Hostname: i.spec.Hostname, SpawnedUnixNano: tPrepared.UnixNano(), ResolvConf: hostnet.ResolvConf}
	// Born in the sandbox's cgroups (cgroupfs.StartIn): limited from its
	// first instruction, and no move of a running process, which costs
	// 10–15 ms of the kernel's cgroup lock on a busy v1 host.
	if err := i.cg.StartIn(cmd); err != nil {
		return fmt.Errorf("start sandbox init: %w", err)
	}
	tSpawned := time.Now()
	pid := cmd.Process.Pid
	cfgR.Close()
	statW.Close()
	// Open the pidfd before anything can reap the child, so it names this
	// process and no later one with a reused pid.
	proc, procErr := hostproc.OpenPid(pid)
	// Reap it whenever it dies while this server lives.
	go cmd.Wait()
	defer func() {
		if err != nil {
			_ = unix.Kill(pid, unix.SIGKILL)
			ctx := context.WithoutCancel(ctx)
			_ = i.cg.Kill(ctx)
			_ = i.cg.Remove()
			os.Remove(i.pidFile())
			os.Remove(i.sockPath())
		}
	}()
	if procErr != nil {
		return fmt.Errorf("sandbox init: %w", procErr)
	}
	exited := proc.Exited()
	// The sandbox has its NIC from the start, its far end unattached (no
	// carrier) until the gateway calls NIC. Its network namespace exists
	// since the clone, so the device is made while the init starts up.
	nicErr := make(chan error, 1)
	go func() {
		tap, err := hostnet.CreateTAP(fmt.Sprintf("/proc/%d/ns/net", pid))
		if err == nil {
			tap.Close()
		}
		nicErr <- err
	}()
	defer func() {
		if e := <-nicErr; e != nil && err == nil {
			err = fmt.Errorf("sandbox %s NIC: %w", i.spec.ID, e)
		}
	}()
	tPlaced := time.Now()
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid), []byte(strconv.Itoa(agentOOMScoreAdj)), 0); err != nil {
		// Lowering needs CAP_SYS_RESOURCE, which a confined server (or this
		// test host) may lack: the sandbox still works, its agent is just
		// not protected from the OOM killer.
		i.rt.oomWarn.Do(func() {
			i.rt.log.Warn("cannot protect sandbox agents from the OOM killer", "err", err)
		})
	}
	if err := hostproc.WritePidFile(i.pidFile(), proc.Record()); err != nil {
		return err
	}
	if conf.Hostname == "" {
		conf.Hostname = i.spec.ID
	}
	dirs := []string{lower, filepath.Join(i.rwDir(), "upper"), filepath.Join(i.rwDir(), "work"), i.rootDir()}
	if err := sendConfig(cfgW, pid, conf, dirs); err != nil {
		return err
	}
	cfgW.Close()
	tConfigured := time.Now()
	if err := i.waitSetup(ctx, statR, exited); err != nil {
		return err
	}
	tSetup := time.Now()
	if err := <-nicErr; err != nil {
		nicErr <- nil
		return fmt.Errorf("sandbox %s NIC: %w", i.spec.ID, err)
	}
	nicErr <- nil
	i.rt.log.Debug("sandbox started", "id", i.spec.ID, "pid", pid,
		"prepare", tPrepared.Sub(t0), "spawn", tSpawned.Sub(tPrepared), "pidfd", tPlaced.Sub(tSpawned), "config", tConfigured.Sub(tPlaced),
		"setup", tSetup.Sub(tConfigured), "nic_wait", time.Since(tSetup))
	i.pid = pid
	i.exited = exited
	return nil
}

// NIC implements runtime.NICProvider: the TAP device eth0 in the network
// namespace of the sandbox's init, created by Start and (re)configured on
// every call (hostnet.CreateTAP). The namespace belongs
// to the sandbox's user namespace; the host's root may still enter it, and
// the sandbox, without CAP_NET_ADMIN, cannot attach to the device or
// change its configuration. The device dies with the namespace: when the
// sandbox's processes are gone and the caller has closed the descriptor.
func (i *instance) NIC(ctx context.Context) (*os.File, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.aliveLocked() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", i.pid))
	if err != nil {
		return nil, fmt.Errorf("sandbox %s network namespace: %w", i.spec.ID, err)
	}
	defer ns.Close()
	// Still alive after the open: the pid named this sandbox's init (it
	// cannot have been reused while the init lives).
	if !i.aliveLocked() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	return hostnet.CreateTAP(fmt.Sprintf("/proc/self/fd/%d", ns.Fd()))
}

// waitSetup waits for the init's verdict: EOF with nothing written means it
// exec'd the agent; text is the error that made it give up.
func (i *instance) waitSetup(ctx context.Context, statR *os.File, exited <-chan struct{}) error {
	type result struct {
		msg []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		msg, err := io.ReadAll(io.LimitReader(statR, 4096))
		done <- result{msg, err}
	}()
	timer := time.NewTimer(setupTimeout)
	defer timer.Stop()
	select {
	case res := <-done:
		if len(res.msg) > 0 {
			return fmt.Errorf("sandbox %s setup failed: %s", i.spec.ID, bytes.TrimSpace(res.msg))
		}
		if res.err != nil {
			return res.err
		}
		select {
		case <-exited:
			return fmt.Errorf("sandbox %s init exited during setup: %s", i.spec.ID, i.logTail())
		default:
			return nil
		}
	case <-ctx.Done():
		return fmt.Errorf("sandbox %s setup: %w", i.spec.ID, ctx.Err())
	case <-timer.C:
		return fmt.Errorf("sandbox %s setup took over %v: %w", i.spec.ID, setupTimeout, errdefs.ErrTimeout)
	}
}

// logTail returns the end of the init's log for error messages. It is
// sandbox-written text, so it is bounded.
func (i *instance) logTail() string {
	f, err := os.Open(i.logFile())
	if err != nil {
		return "(no log)"
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > 1024 {
		f.Seek(-1024, io.SeekEnd)
	}
	b, _ := io.ReadAll(io.LimitReader(f, 1024))
	return string(bytes.TrimSpace(b))
}

// Stop implements runtime.Instance: everything in the cgroup dies, the disk
// is unmounted but kept.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.stopLocked(ctx)
}

func (i *instance) stopLocked(ctx context.Context) error {
	var errs []error
	if i.pid > 0 && i.aliveLocked() {
		// Killing the pid namespace's init takes all its processes with it;
		// the cgroup kill below catches anything that is not (yet) in it.
		_ = unix.Kill(i.pid, unix.SIGKILL)
	}
	if err := i.cg.Kill(ctx); err != nil {
		errs = append(errs, err)
	}
	if i.exited != nil {
		select {
		case <-i.exited:
		case <-time.After(10 * time.Second):
			errs = append(errs, fmt.Errorf("sandbox %s init did not exit after SIGKILL", i.spec.ID))
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	i.pid = 0
	i.exited = nil
	i.oomCounter().Close()
	if err := i.cg.Remove(); err != nil {
		errs = append(errs, err)
	}
	for _, p := range []string{i.sockPath(), i.pidFile()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := hostfs.UnmountAll(i.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Destroy implements runtime.Instance. It works on any partial state.
func (i *instance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.stopLocked(ctx); err != nil {
		return err
	}
	return hostfs.RemoveSandbox(i.dir, i.spec.ID)
}

// Pause implements runtime.Pauser with the cgroup freezer.
func (i *instance) Pause(ctx context.Context) error {
	if !i.Alive() {
		return fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	return i.cg.Freeze(ctx)
}

// Resume implements runtime.Pauser.
func (i *instance) Resume(ctx context.Context) error {
	if !i.Alive() {
		return fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	return i.cg.Thaw(ctx)
}

// OOMKills implements runtime.OOMCounter: Stats's OOMKills alone.
func (i *instance) OOMKills() (int64, error) {
	if !i.Alive() {
		return 0, nil
	}
	return i.oomCounter().Read()
}

// Foreground implements runtime.Foregrounder.
func (i *instance) Foreground() error { return i.cg.SetCPUWeight(cgroupfs.DefaultCPUWeight) }

var _ runtime.Foregrounder = (*instance)(nil)

func (i *instance) oomCounter() *cgroupfs.OOMCounter {
	i.oomOnce.Do(func() { i.oom = i.cg.OOMCounter() })
	return i.oom
}

var _ runtime.OOMCounter = (*instance)(nil)

// Stats implements runtime.Instance from the host's cgroup files.
func (i *instance) Stats(ctx context.Context) (runtime.Stats, error) {
	if !i.Alive() {
		return runtime.Stats{}, nil
	}
	s, err := cgroupStats(i.cg)
	if err != nil {
		return s, err
	}
	// The sandbox's ext4 disk is mounted at rwDir while it runs: the
	// overlay's upper (and work) directory and the init's log.
	s.DiskUsedBytes, err = hostfs.DiskUsed(i.rwDir())
	return s, err
}
