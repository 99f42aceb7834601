package microvm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/hostproc"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
)

// warmHostname is the hostname of a first boot that may become a warm
// snapshot (see Start).
const warmHostname = "sandbox"

// An instance is one sandbox: one QEMU process at a time, booted cold from
// the template's root image and the sandbox's disk, or restored from a
// snapshot (suspend.go, fork.go, warm.go).
//
// Files in its directory (sandboxes/<id>/), the server's own:
//
//	vm.json      the VM description of the last cold boot: a restore, also
//	             after a server restart, starts QEMU with exactly that
//	             command line (plus -incoming)
//	qemu.pid     "pid starttime" of the running QEMU (re-adoption)
//	qemu.err     QEMU's stderr
//	hung         the watchdog's verdict on the QEMU it killed
//	state/       a suspend image waits here; Start refuses while it holds
//	             anything and Stop removes it
//
// and in its vm/ subdirectory, the only one QEMU may write (the jail binds
// it read-write and gives it to QEMU's uid), so nothing the server trusts
// lives there and the server never follows a link in it (QEMU runs a
// guest that may own it):
//
//	vm/disk.img     the writable ext4 disk (virtio-blk serial space-disk)
//	vm/console.log  the guest's serial console
//	vm/agent.sock   the agent's virtio-serial port (chardev socket)
//	vm/ctl.sock     the guest init's control port (package vmctl)
//	vm/qmp.sock     QEMU's monitor
//	vm/net.sock     QEMU's end of the NIC (unix datagram socket, nic.go)
//	vm/gw.sock      the host's end of the NIC, bound by NIC
//
// An instance is the value the manager holds; its own methods are the
// runtime interfaces it implements, and each part of the work is a field
// of its own type:
//
//   - files (layout, layout.go): the names above and vm.json;
//   - vm (vmm, vmm.go): the QEMU process, its QMP monitor, the paused
//     flag, the watchdog and the exit reason;
//   - guest (guestCtl, guestctl.go): the guest init's control port;
//   - snap (snapshots, suspend.go): a guest's state saved to a file and
//     continued from one, which Suspend, Fork and warm templates use;
//   - warm (warmer, warm.go): the booted marker, a fresh sandbox's start
//     from its kind's warm snapshot, and taking that snapshot.
//
// For the snapshot code (suspend.go, fork.go, warm.go, migrate.go):
//
//   - i.mu is held by every lifecycle method (Start, Stop, Destroy, Pause,
//     Resume) for its whole run; i.warm.start and i.warm.afterColdBoot are called with
//     it held, and i.vm.launch, i.vm.stop and i.vm.setPaused expect it held.
//   - i.vm.launch(ctx, incoming) starts QEMU from vm.json; with incoming,
//     QEMU gets -incoming fd:3 on that file and reads the stream itself (QMP
//     "inmigrate" until the migration completes, then "paused"; the caller
//     waits and sends cont). launch returns once QMP answers; it records
//     the pid and starts the exit watcher and the watchdog, which counts
//     silence only after the guest's init first answered.
//     i.files.writeVM stores a description first (cold boots do).
//   - i.vm.qmpClient(ctx) and i.guest are the VM's QMP and vmctl clients;
//     a failed call drops the shared client, so the next call dials again.
//   - i.vm.setPaused(true) before a QMP stop keeps the watchdog from
//     counting a paused guest's silence; cont + i.vm.setPaused(false).
//   - i.vm.stop kills QEMU (the exit is not reported as a crash) and
//     leaves disk and state/ alone.
type instance struct {
	rt    *Runtime
	spec  runtime.Spec
	files layout     // the sandbox's directory
	vm    *vmm       // the QEMU process
	guest *guestCtl  // the guest init's control port
	snap  *snapshots // save and restore of the guest's state
	warm  *warmer    // warm templates of the sandbox's kind

	// mu serializes lifecycle changes; it may be held for a whole boot.
	mu sync.Mutex
}

var (
	_ runtime.Instance     = (*instance)(nil)
	_ runtime.Pauser       = (*instance)(nil)
	_ runtime.ExitReasoner = (*instance)(nil)
	_ runtime.NICProvider  = (*instance)(nil)
)

// ID implements runtime.Instance.
func (i *instance) ID() string { return i.spec.ID }

// Alive implements runtime.Instance: QEMU runs (the guest may be paused).
func (i *instance) Alive() bool { return i.vm.alive() }

// Exited implements runtime.Instance.
func (i *instance) Exited() <-chan struct{} { return i.vm.exited() }

// Pid is QEMU's host pid (0 when not running): the conformance suite
// checks from the host that the process serving the sandbox is
// unprivileged.
func (i *instance) Pid() int { return i.vm.pid() }

// ExitReason implements runtime.ExitReasoner: why the last QEMU ended on
// its own (guest panic, guest power-off, QEMU crash, hung guest), with the
// console's tail. Empty while running or after a Stop.
func (i *instance) ExitReason() string { return i.vm.lastExit() }

// DialAgent implements runtime.Instance. A VM that ended says why, with
// its console's tail.
func (i *instance) DialAgent(ctx context.Context) (net.Conn, error) {
	pr := i.vm.current()
	if pr == nil || !pr.alive() {
		if why := i.ExitReason(); why != "" {
			return nil, fmt.Errorf("sandbox %s is not running: %s: %w", i.spec.ID, why, errdefs.ErrUnavailable)
		}
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrUnavailable)
	}
	c, err := dialAgentSocket(ctx, i.files.agentSocket())
	if err != nil {
		return nil, fmt.Errorf("dial agent of %s: %w: %w", i.spec.ID, err, errdefs.ErrUnavailable)
	}
	return c, nil
}

// coldVM describes a cold boot of spec's sandbox, whose files are files: the template's root image,
// the sandbox's disk, its limits and hostname.
func (r *Runtime) coldVM(spec runtime.Spec, files layout, accel string) (VM, error) {
	bf, err := r.bootFiles()
	if err != nil {
		return VM{}, err
	}
	img, err := r.images.Path(spec.TemplateDigest)
	if err != nil {
		return VM{}, err
	}
	if _, err := os.Stat(img); err != nil {
		// Forgotten since Create (template garbage collection) or never
		// prepared (an Open after a restart): derive it again.
		if spec.RootFS == "" {
			return VM{}, fmt.Errorf("root image of %s is missing and no template tree was given: %w", spec.TemplateDigest, errdefs.ErrNotFound)
		}
		if img, err = r.images.Prepare(context.Background(), spec.TemplateDigest, spec.RootFS); err != nil {
			return VM{}, err
		}
	}
	hostname := spec.Hostname
	if hostname == "" {
		hostname = spec.ID
	}
	l := spec.Limits
	vm := VM{
		Kernel:           bf.kernel.Vmlinuz,
		Initrd:           bf.initrd,
		Accel:            accel,
		CPUs:             vcpus(l.CPUs),
		MemoryMiB:        int(l.MemoryMiB) + guestOverheadMiB,
		AgentSocket:      files.agentSocket(),
		ConsoleLog:       files.consoleLog(),
		RootImage:        img,
		Disk:             files.diskImage(),
		CtlSocket:        files.ctlSocket(),
		QMPSocket:        files.qmpSocket(),
		NetSocket:        files.netSocket(),
		NetPeer:          files.netPeer(),
		Hostname:         hostname,
		SandboxMemoryMiB: l.MemoryMiB,
		Pids:             l.Pids,
		Seccomp:          true,
	}
	if accel == AccelTCG {
		vm.TBSizeMiB = tcgTBSizeMiB
	}
	return vm, nil
}

// vcpus is ceil(cpus), at least 1.
func vcpus(cpus float64) int {
	n := int(cpus)
	if float64(n) < cpus {
		n++
	}
	return max(n, 1)
}

// Start implements runtime.Instance: a warm restore when warm.go has a
// snapshot for this sandbox's kind, else a cold boot. It returns when the
// agent has answered a health check and the guest's init its control
// port.
func (i *instance) Start(ctx context.Context) (err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.Alive() {
		return fmt.Errorf("sandbox %s is already running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if i.files.hasSavedState() {
		return fmt.Errorf("sandbox %s is suspended (restore or destroy it): %w", i.spec.ID, errdefs.ErrConflict)
	}
	if _, err := os.Stat(i.files.diskImage()); err != nil {
		return fmt.Errorf("sandbox %s: %w", i.spec.ID, errdefs.ErrNotFound)
	}
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	defer func() {
		if err != nil {
			if serr := i.vm.stop(context.WithoutCancel(ctx)); serr != nil {
				i.rt.log.Warn("cleaning up a failed start", "id", i.spec.ID, "err", serr)
			}
		}
	}()
	t0 := time.Now()
	switch err := i.warm.start(ctx); {
	case err == nil:
		i.rt.log.Debug("sandbox started warm", "id", i.spec.ID, "took", time.Since(t0))
		return nil
	case !errors.Is(err, errNoWarm):
		i.rt.log.Warn("warm start failed; booting cold", "id", i.spec.ID, "err", err)
		if err := i.vm.stop(ctx); err != nil {
			return err
		}
	}
	caps := i.rt.Probe(ctx)
	accel := caps.Details["accel"]
	if accel == "" {
		accel = AccelTCG
	}
	vm, err := i.rt.coldVM(i.spec, i.files, accel)
	if err != nil {
		return err
	}
	// A boot that may become its kind's warm snapshot carries nothing of
	// this sandbox: every later sandbox of the kind starts from its memory
	// (kernel command line, hostname). It boots as warmHostname and gets
	// its own name right after the snapshot.
	bootVM := vm
	warmEligible := !i.warm.booted() && !i.rt.noWarm.Load()
	if warmEligible {
		bootVM.Hostname = warmHostname
	}
	if err := i.files.writeVM(bootVM); err != nil {
		return err
	}
	if err := i.vm.launch(ctx, nil); err != nil {
		return err
	}
	tLaunched := time.Now()
	if err := i.waitReady(ctx); err != nil {
		return err
	}
	i.rt.log.Debug("sandbox booted", "id", i.spec.ID, "launch", tLaunched.Sub(t0), "boot", time.Since(tLaunched))
	i.warm.afterColdBoot(ctx)
	if warmEligible {
		if err := i.files.writeVM(vm); err != nil {
			return err
		}
		if err := i.guest.restored(ctx, vm.Hostname); err != nil {
			return fmt.Errorf("naming the sandbox after its first boot: %w", err)
		}
	}
	return nil
}

// waitReady waits until the agent answers health and the guest's init
// answers a ping, failing with the console's tail as soon as QEMU exits.
func (i *instance) waitReady(ctx context.Context) error {
	pr := i.vm.current()
	if pr == nil || pr.p == nil {
		return fmt.Errorf("sandbox %s: no QEMU to wait for", i.spec.ID)
	}
	c, _, err := pr.p.WaitHealthy(ctx)
	if err != nil {
		return fmt.Errorf("sandbox %s did not boot: %w", i.spec.ID, err)
	}
	c.Close()
	// The caller dials the agent next. Until the guest's agent has seen
	// this session end and let go of its port, a new connection would be
	// read by the old session and then cut when that one closes the port
	// (the conformance lifecycle subtest hit it under load).
	if q, err := i.vm.qmpClient(ctx); err == nil {
		if released, err := WaitAgentPortReleased(ctx, q, 5*time.Second); err != nil || !released {
			i.rt.log.Warn("the agent did not release its port after the boot's health check", "id", i.spec.ID, "released", released, "err", err)
		}
	}
	for {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := i.guest.ping(pctx)
		cancel()
		if err == nil {
			pr.armed.Store(true)
			return nil
		}
		select {
		case <-pr.exited:
			return fmt.Errorf("sandbox %s ended during boot: %s: %w", i.spec.ID, i.vm.describeExit(pr), errdefs.ErrUnavailable)
		case <-ctx.Done():
			return fmt.Errorf("sandbox %s: the guest's init does not answer its control port: %w: %w", i.spec.ID, err, errdefs.ErrUnavailable)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Foreground implements runtime.Foregrounder: QEMU's jail cgroup gets the
// default CPU weight.
func (i *instance) Foreground() error { return jail.SetCPUWeight(i.spec.ID, cgroupfs.DefaultCPUWeight) }

var _ runtime.Foregrounder = (*instance)(nil)

// Stop implements runtime.Instance: the guest flushes its page cache to
// its disk, QEMU is killed (the guest's memory is gone), and a suspend
// image is discarded: the next Start boots afresh from the disk.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.Alive() {
		i.flushLocked(ctx)
	}
	if err := i.vm.stop(ctx); err != nil {
		return err
	}
	if err := os.RemoveAll(i.files.stateDir()); err != nil {
		return fmt.Errorf("sandbox %s: removing its suspend image: %w", i.spec.ID, err)
	}
	return nil
}

// stopFlushTimeout bounds the guest's sync before a Stop: a guest that
// cannot flush in that time (hung, or writing gigabytes) is killed anyway.
const stopFlushTimeout = 10 * time.Second

// flushLocked asks the guest's init to write the guest's page cache to
// the disk (vmctl sync) before QEMU is killed, so a stop keeps what the
// sandbox wrote, as a clean shutdown would; a paused guest is resumed for
// it. Best effort: the kill that follows does not wait for a guest that
// does not answer.
func (i *instance) flushLocked(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, stopFlushTimeout)
	defer cancel()
	t0 := time.Now()
	paused := i.vm.isPaused()
	if paused {
		if err := i.vm.qmp(ctx, "cont"); err != nil {
			i.rt.log.Warn("stop: resuming the paused guest to flush its disk", "id", i.spec.ID, "err", err)
			return
		}
	}
	if err := i.guest.sync(ctx); err != nil {
		i.rt.log.Warn("stop: the guest did not flush its disk", "id", i.spec.ID, "err", err)
		return
	}
	i.rt.log.Debug("stop: guest disk flushed", "id", i.spec.ID, "took", time.Since(t0))
}

// Destroy implements runtime.Instance: QEMU, the disk, every file. It
// works on any partial state and is idempotent.
func (i *instance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.vm.stop(ctx); err != nil {
		return err
	}
	// A QEMU the pid file does not name (killed server between start
	// and pid file) still has the sandbox's files open.
	for _, pid := range qemuProcessesUnder(i.rt.sandboxesDir())[i.spec.ID] {
		killPid(pid)
	}
	return hostfs.RemoveSandbox(i.files.dir, i.spec.ID)
}

// Pause implements runtime.Pauser: QMP stop; the vCPUs stop, memory stays.
func (i *instance) Pause(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.Alive() {
		return fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	i.vm.setPaused(true)
	if err := i.vm.qmp(ctx, "stop"); err != nil {
		i.vm.setPaused(false)
		return err
	}
	return nil
}

// Resume implements runtime.Pauser: QMP cont.
func (i *instance) Resume(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.Alive() {
		return fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if err := i.vm.qmp(ctx, "cont"); err != nil {
		return err
	}
	i.vm.setPaused(false)
	return nil
}

// Stats implements runtime.Instance: memory, OOM kills and processes of
// the sandbox's cgroup and the use of its disk as the guest kernel counts
// them (from the guest's
// init, outside the sandbox's confinement; clamped by vmctl), CPU from the
// host: the jail's cgroup, QEMU's CPU time, which is all the guest ran.
func (i *instance) Stats(ctx context.Context) (runtime.Stats, error) {
	pr := i.vm.current()
	if pr == nil || !pr.alive() {
		return runtime.Stats{}, nil
	}
	paused := i.vm.isPaused()
	// A paused guest cannot answer: its counters are the ones it had
	// when it stopped, which the last answer is as good as.
	gs := i.guest.last()
	if !paused {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		var err error
		if gs, err = i.guest.stats(ctx); err != nil {
			return runtime.Stats{}, err
		}
	}
	cpu, err := jail.CgroupCPU(i.spec.ID)
	if err != nil {
		// No cgroup (an unjailed QEMU): its own CPU time is all the
		// guest ran.
		if cpu, err = hostproc.CPUTime(pr.pid); err != nil && pr.alive() {
			return runtime.Stats{}, err
		}
	}
	return runtime.Stats{MemoryBytes: gs.MemoryBytes, OOMKills: gs.OOMKills, Pids: gs.Pids, CPUNanos: cpu,
		MemoryCacheBytes: gs.MemoryCacheBytes, DiskUsedBytes: gs.DiskUsedBytes}, nil
}
