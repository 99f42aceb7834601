package microvm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

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
// For the snapshot code (suspend.go, fork.go, warm.go, migrate.go):
//
//   - i.mu is held by every lifecycle method (Start, Stop, Destroy, Pause,
//     Resume) for its whole run; startWarm and afterColdBoot are called with
//     it held, and launch, stopLocked and setPausedLocked expect it held.
//   - launch(ctx, incoming) starts QEMU from vm.json; with incoming, QEMU
//     gets -incoming fd:3 on that file and reads the stream itself (QMP
//     "inmigrate" until the migration completes, then "paused"; the caller
//     waits and sends cont). launch returns once QMP answers; it records
//     the pid and starts the exit watcher and the watchdog, which counts
//     silence only after the guest's init first answered. writeVM stores
//     a description first (cold boots do).
//   - qmpClient(ctx) and i.guest are the VM's QMP and vmctl clients;
//     after a failed call, dropClients() makes the next call dial again.
//   - setPausedLocked(true) before a QMP stop keeps the watchdog from
//     counting a paused guest's silence; cont + setPausedLocked(false).
//   - stopLocked kills QEMU (the exit is not reported as a crash) and
//     leaves disk and state/ alone; i.files.diskImage(), i.files.stateDir(), i.files.dir.
type instance struct {
	rt    *Runtime
	spec  runtime.Spec
	files layout    // the sandbox's directory
	guest *guestCtl // the guest init's control port

	// mu serializes lifecycle changes; it may be held for a whole boot.
	mu sync.Mutex

	// smu guards the fields below for short reads (Alive, Stats, …),
	// so they never wait for a boot.
	smu        sync.Mutex
	proc       *vmProc // the running QEMU; nil when none
	paused     bool
	exitReason string // why the last QEMU ended on its own
}

var (
	_ runtime.Instance     = (*instance)(nil)
	_ runtime.Pauser       = (*instance)(nil)
	_ runtime.ExitReasoner = (*instance)(nil)
	_ runtime.NICProvider  = (*instance)(nil)
)

// ID implements runtime.Instance.
func (i *instance) ID() string { return i.spec.ID }

// vmProc is one QEMU process, started here or re-adopted after a restart.
type vmProc struct {
	pid       int
	startTime uint64
	exited    chan struct{}     // closed when QEMU has exited
	p         *Process          // nil when adopted
	hp        *hostproc.Process // adopted: the pidfd signals go through; nil otherwise

	// stopping marks an exit the runtime caused (Stop, Destroy, a failed
	// start): not reported as the guest's own end.
	stopping atomic.Bool
	// armed: the guest's init has answered once (or the guest ran before
	// a restart), so silence counts; a booting or incoming guest that
	// never answered is bounded by its start's timeout instead.
	armed atomic.Bool
}

func (pr *vmProc) alive() bool {
	select {
	case <-pr.exited:
		return false
	default:
		return true
	}
}

// kill SIGKILLs QEMU and waits up to d for it to be gone.
func (pr *vmProc) kill(d time.Duration) error {
	if pr.p != nil {
		_ = pr.p.cmd.Process.Kill()
	} else if pr.hp != nil {
		_ = pr.hp.Signal(unix.SIGKILL)
	}
	select {
	case <-pr.exited:
		return nil
	case <-time.After(d):
		return fmt.Errorf("QEMU (pid %d) did not exit after SIGKILL", pr.pid)
	}
}

// qemuError is how QEMU exited, when known.
func (pr *vmProc) qemuError(errLog string) error {
	if pr.p != nil {
		return pr.p.Err()
	}
	if msg := strings.TrimSpace(readTail(errLog, 2048)); msg != "" {
		return errors.New("qemu: " + msg)
	}
	return nil
}

func (i *instance) current() *vmProc {
	i.smu.Lock()
	defer i.smu.Unlock()
	return i.proc
}

// Alive implements runtime.Instance: QEMU runs (the guest may be paused).
func (i *instance) Alive() bool {
	pr := i.current()
	return pr != nil && pr.alive()
}

// Exited implements runtime.Instance.
func (i *instance) Exited() <-chan struct{} {
	if pr := i.current(); pr != nil {
		return pr.exited
	}
	return nil
}

// Pid is QEMU's host pid (0 when not running): the conformance suite
// checks from the host that the process serving the sandbox is
// unprivileged.
func (i *instance) Pid() int {
	if pr := i.current(); pr != nil && pr.alive() {
		return pr.pid
	}
	return 0
}

// ExitReason implements runtime.ExitReasoner: why the last QEMU ended on
// its own (guest panic, guest power-off, QEMU crash, hung guest), with the
// console's tail. Empty while running or after a Stop.
func (i *instance) ExitReason() string {
	i.smu.Lock()
	defer i.smu.Unlock()
	if i.proc != nil && i.proc.alive() {
		return ""
	}
	return i.exitReason
}

func (i *instance) consoleTail(max int64) string { return readTail(i.files.consoleLog(), max) }

// DialAgent implements runtime.Instance. A VM that ended says why, with
// its console's tail.
func (i *instance) DialAgent(ctx context.Context) (net.Conn, error) {
	pr := i.current()
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

// coldVM describes a cold boot of this sandbox: the template's root image,
// the sandbox's disk, its limits and hostname.
func (i *instance) coldVM(accel string) (VM, error) {
	bf, err := i.rt.bootFiles()
	if err != nil {
		return VM{}, err
	}
	img, err := i.rt.images.Path(i.spec.TemplateDigest)
	if err != nil {
		return VM{}, err
	}
	if _, err := os.Stat(img); err != nil {
		// Forgotten since Create (template garbage collection) or never
		// prepared (an Open after a restart): derive it again.
		if i.spec.RootFS == "" {
			return VM{}, fmt.Errorf("root image of %s is missing and no template tree was given: %w", i.spec.TemplateDigest, errdefs.ErrNotFound)
		}
		if img, err = i.rt.images.Prepare(context.Background(), i.spec.TemplateDigest, i.spec.RootFS); err != nil {
			return VM{}, err
		}
	}
	hostname := i.spec.Hostname
	if hostname == "" {
		hostname = i.spec.ID
	}
	l := i.spec.Limits
	vm := VM{
		Kernel:           bf.kernel.Vmlinuz,
		Initrd:           bf.initrd,
		Accel:            accel,
		CPUs:             vcpus(l.CPUs),
		MemoryMiB:        int(l.MemoryMiB) + guestOverheadMiB,
		AgentSocket:      i.files.agentSocket(),
		ConsoleLog:       i.files.consoleLog(),
		RootImage:        img,
		Disk:             i.files.diskImage(),
		CtlSocket:        i.files.ctlSocket(),
		QMPSocket:        i.files.qmpSocket(),
		NetSocket:        i.files.netSocket(),
		NetPeer:          i.files.netPeer(),
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
			if serr := i.stopLocked(context.WithoutCancel(ctx)); serr != nil {
				i.rt.log.Warn("cleaning up a failed start", "id", i.spec.ID, "err", serr)
			}
		}
	}()
	t0 := time.Now()
	switch err := i.startWarm(ctx); {
	case err == nil:
		i.rt.log.Debug("sandbox started warm", "id", i.spec.ID, "took", time.Since(t0))
		return nil
	case !errors.Is(err, errNoWarm):
		i.rt.log.Warn("warm start failed; booting cold", "id", i.spec.ID, "err", err)
		if err := i.stopLocked(ctx); err != nil {
			return err
		}
	}
	caps := i.rt.Probe(ctx)
	accel := caps.Details["accel"]
	if accel == "" {
		accel = AccelTCG
	}
	vm, err := i.coldVM(accel)
	if err != nil {
		return err
	}
	// A boot that may become its kind's warm snapshot carries nothing of
	// this sandbox: every later sandbox of the kind starts from its memory
	// (kernel command line, hostname). It boots as warmHostname and gets
	// its own name right after the snapshot.
	bootVM := vm
	warmEligible := !i.booted() && !i.rt.noWarm.Load()
	if warmEligible {
		bootVM.Hostname = warmHostname
	}
	if err := i.files.writeVM(bootVM); err != nil {
		return err
	}
	if err := i.launch(ctx, nil); err != nil {
		return err
	}
	tLaunched := time.Now()
	if err := i.waitReady(ctx); err != nil {
		return err
	}
	i.rt.log.Debug("sandbox booted", "id", i.spec.ID, "launch", tLaunched.Sub(t0), "boot", time.Since(tLaunched))
	i.afterColdBoot(ctx)
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
	pr := i.current()
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
	if q, err := i.qmpClient(ctx); err == nil {
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
			return fmt.Errorf("sandbox %s ended during boot: %s: %w", i.spec.ID, i.describeExit(pr), errdefs.ErrUnavailable)
		case <-ctx.Done():
			return fmt.Errorf("sandbox %s: the guest's init does not answer its control port: %w: %w", i.spec.ID, err, errdefs.ErrUnavailable)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// launch starts QEMU from vm.json; incoming, when not nil, is the migration
// stream it restores from (descriptor 3, -incoming fd:3). QEMU is detached
// from this process (it outlives a server restart). launch records the
// pid, dials QMP and starts watching. Called with i.mu held and no QEMU
// running.
func (i *instance) launch(ctx context.Context, incoming *os.File) (err error) {
	if i.Alive() {
		return fmt.Errorf("sandbox %s: QEMU already runs: %w", i.spec.ID, errdefs.ErrConflict)
	}
	vm, err := i.files.readVM()
	if err != nil {
		return err
	}
	vm.IncomingFD = 0
	if incoming != nil {
		vm.IncomingFD = 3
	}
	releaseConns(i.files.agentSocket(), i.files.qmpSocket(), i.files.ctlSocket())
	// QEMU truncates the console log itself (-serial file: opens it so).
	p, err := Launch(vm, LaunchOptions{Incoming: incoming, Detached: true, StderrPath: i.files.qemuErrLog(), Jail: i.jailOptions(vm)})
	if err != nil {
		return err
	}
	pr := &vmProc{pid: p.Pid(), exited: make(chan struct{}), p: p}
	_ = os.Remove(i.files.hungFile())
	go i.reap(pr, p.Done())
	defer func() {
		if err != nil {
			pr.stopping.Store(true)
			_ = pr.kill(10 * time.Second)
		}
	}()
	rec, err := hostproc.Identify(pr.pid)
	if err != nil {
		return fmt.Errorf("QEMU exited at once: %v", pr.qemuError(i.files.qemuErrLog()))
	}
	pr.startTime = rec.StartTime
	if err := hostproc.WritePidFile(i.files.pidFile(), rec); err != nil {
		return err
	}
	i.smu.Lock()
	i.proc, i.paused, i.exitReason = pr, false, ""
	i.smu.Unlock()
	i.guest.forget()
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := i.qmpClient(qctx); err != nil {
		if !pr.alive() {
			return fmt.Errorf("sandbox %s: QEMU ended: %s", i.spec.ID, i.describeExit(pr))
		}
		return err
	}
	go i.watch(pr)
	return nil
}

// qemuOverheadMiB is QEMU's own memory beside the guest's RAM and TCG's
// translation cache: device state, block and I/O buffers, its heap.
const qemuOverheadMiB = 128

// jailOptions confine the QEMU of vm: it writes only vm/, and its host
// cgroup bounds its memory to the guest's RAM plus what QEMU needs on
// top, its CPU to the vCPUs plus half a core for QEMU's own threads (the
// main loop, I/O), and its threads to jail.DefaultPids.
func (i *instance) jailOptions(vm VM) *JailOptions {
	mem := int64(vm.MemoryMiB+vm.TBSizeMiB+qemuOverheadMiB) << 20
	o := &JailOptions{
		ID:       i.spec.ID,
		Binary:   i.rt.jailBinary(),
		Writable: []string{i.files.vmDir()},
		Limits:   jail.Limits{MemoryBytes: mem, CPUs: float64(max(vm.CPUs, 1)) + 0.5},
	}
	if i.spec.Background {
		o.Limits.CPUWeight = cgroupfs.BackgroundCPUWeight
	}
	return o
}

// Foreground implements runtime.Foregrounder: QEMU's jail cgroup gets the
// default CPU weight.
func (i *instance) Foreground() error { return jail.SetCPUWeight(i.spec.ID, cgroupfs.DefaultCPUWeight) }

var _ runtime.Foregrounder = (*instance)(nil)

// adoptLocked attaches to a QEMU that still runs (a server restart): the
// pid file must name a live process with the recorded start time whose
// command line names this sandbox's directory.
func (i *instance) adoptLocked(ctx context.Context) {
	hp, err := hostproc.Adopt(i.files.pidFile())
	if err != nil {
		return
	}
	// Read after the pidfd was opened and the start time matched, so it
	// is that process's command line.
	cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", hp.Pid()))
	if !strings.Contains(string(cmdline), i.files.dir+"/") {
		_ = hp.Close()
		return
	}
	pr := &vmProc{pid: hp.Pid(), startTime: hp.Record().StartTime, exited: make(chan struct{}), hp: hp}
	pr.armed.Store(true) // it ran before the restart
	go i.reap(pr, hp.Exited())
	i.smu.Lock()
	i.proc, i.exitReason = pr, ""
	i.smu.Unlock()
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if q, err := i.qmpClient(qctx); err == nil {
		if status, err := q.Status(qctx); err == nil {
			i.smu.Lock()
			i.paused = status == "paused"
			i.smu.Unlock()
		}
	}
	go i.watch(pr)
}

// qmpClient is the VM's QMP client (dialled when there is none).
func (i *instance) qmpClient(ctx context.Context) (*QMP, error) {
	if !i.Alive() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrUnavailable)
	}
	return sharedQMP(ctx, i.files.qmpSocket())
}

// qmp runs one QMP command; a failed transport drops the client.
func (i *instance) qmp(ctx context.Context, cmd string) error {
	q, err := i.qmpClient(ctx)
	if err != nil {
		return err
	}
	if _, err := q.Execute(ctx, cmd, nil); err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropQMP(i.files.qmpSocket(), q)
		}
		return fmt.Errorf("sandbox %s: %w", i.spec.ID, err)
	}
	return nil
}

// Watchdog: a running, unpaused guest whose init answers no ping for
// watchdogMisses rounds in a row, over at least watchdogHang, is hung (a
// kernel stuck with interrupts off, a livelocked guest): it is killed and
// ExitReason says so. The bounds are generous because a TCG guest on a loaded host is slow, and a
// sandbox's own load (a fork bomb at its pids limit) must not count.
const (
	watchdogInterval = 3 * time.Second
	watchdogTimeout  = 5 * time.Second
	watchdogMisses   = 5
	// watchdogHang is the least silence that counts as hung, however
	// fast the misses come (a dial refused at once).
	watchdogHang = 30 * time.Second
)

// reap records why pr ended once dead is closed, then closes pr.exited:
// whoever sees Exited fire finds the reason already there.
func (i *instance) reap(pr *vmProc, dead <-chan struct{}) {
	<-dead
	i.recordExit(pr)
	close(pr.exited)
}

// watch waits for pr to exit, pinging the guest's init meanwhile, and
// records why it ended when the runtime did not end it.
func (i *instance) watch(pr *vmProc) {
	t := time.NewTicker(watchdogInterval)
	defer t.Stop()
	misses := 0
	var first time.Time
	for {
		select {
		case <-pr.exited:
			return
		case <-t.C:
		}
		i.smu.Lock()
		paused, current := i.paused, i.proc == pr
		i.smu.Unlock()
		if paused || !current || pr.stopping.Load() {
			misses = 0
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), watchdogTimeout)
		err := i.guest.ping(ctx)
		cancel()
		i.smu.Lock()
		paused = i.paused // paused while the ping was out: not a miss
		i.smu.Unlock()
		if err == nil {
			pr.armed.Store(true)
		}
		if err == nil || paused || !pr.alive() || !pr.armed.Load() {
			misses, first = 0, time.Time{}
			continue
		}
		if misses == 0 {
			first = time.Now()
		}
		misses++
		if misses == 1 {
			i.rt.log.Warn("guest did not answer a ping", "id", i.spec.ID, "err", err)
		}
		if misses >= watchdogMisses && time.Since(first) >= watchdogHang {
			why := fmt.Sprintf("the guest hung: its init answered no ping for %v (%d in a row; last: %v); QEMU was killed",
				time.Since(first).Round(time.Second), misses, oneLine(err.Error(), 200))
			_ = os.WriteFile(i.files.hungFile(), []byte(why), 0o600)
			_ = pr.kill(10 * time.Second)
		}
	}
}

// recordExit keeps the reason of an exit the runtime did not cause.
func (i *instance) recordExit(pr *vmProc) {
	if pr.stopping.Load() {
		return
	}
	// Another instance value of this sandbox (an Open in this process)
	// stopped it: it removed or replaced the pid file first.
	if rec, err := hostproc.ReadPidFile(i.files.pidFile()); err != nil || rec != (hostproc.Record{Pid: pr.pid, StartTime: pr.startTime}) {
		return
	}
	why := i.describeExit(pr)
	i.rt.log.Warn("sandbox VM ended", "id", i.spec.ID, "reason", oneLine(why, 400))
	i.smu.Lock()
	if i.proc == pr {
		i.exitReason = why
	}
	i.smu.Unlock()
}

// describeExit says why pr ended, with the console's tail.
func (i *instance) describeExit(pr *vmProc) string {
	tail := strings.TrimSpace(i.consoleTail(2048))
	var how string
	switch qerr := pr.qemuError(i.files.qemuErrLog()); {
	case readTail(i.files.hungFile(), 1024) != "":
		how = readTail(i.files.hungFile(), 1024)
	case strings.Contains(tail, "Kernel panic"):
		how = "the guest kernel panicked"
	case qerr != nil:
		how = "QEMU failed: " + qerr.Error()
	default:
		how = "the guest powered off (its init ended, e.g. the agent exited or was killed)"
	}
	return how + "; console:\n" + tail
}

// Stop implements runtime.Instance: the guest flushes its page cache to
// its disk, QEMU is killed (the guest's memory is gone), and a suspend
// image is discarded: the next Start boots afresh from the disk.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.Alive() {
		i.flushLocked(ctx)
	}
	if err := i.stopLocked(ctx); err != nil {
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
	i.smu.Lock()
	paused := i.paused
	i.smu.Unlock()
	if paused {
		if err := i.qmp(ctx, "cont"); err != nil {
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

// stopLocked kills QEMU if it runs and removes its run files; the disk,
// vm.json, the console log and state/ stay.
func (i *instance) stopLocked(ctx context.Context) error {
	i.smu.Lock()
	pr := i.proc
	i.smu.Unlock()
	if pr != nil {
		pr.stopping.Store(true)
		// First, so that other instance values of the sandbox see a
		// stop, not a crash (recordExit); a QEMU that survives is still
		// found by its cgroup and command line.
		_ = os.Remove(i.files.pidFile())
		if err := pr.kill(15 * time.Second); err != nil {
			return fmt.Errorf("sandbox %s: %w", i.spec.ID, err)
		}
	}
	releaseConns(i.files.agentSocket(), i.files.qmpSocket(), i.files.ctlSocket())
	i.smu.Lock()
	if i.proc == pr {
		i.proc, i.paused = nil, false
	}
	i.smu.Unlock()
	var errs []error
	// Kills whatever else still runs in the jail's cgroup.
	if err := jail.RemoveCgroup(i.spec.ID); err != nil {
		errs = append(errs, err)
	}
	// The NIC's sockets too: a descriptor NIC returned for this QEMU is
	// dead with it, and the next QEMU's NIC binds a fresh host end.
	for _, p := range []string{i.files.pidFile(), i.files.agentSocket(), i.files.ctlSocket(), i.files.qmpSocket(), i.files.netSocket(), i.files.netPeer()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Destroy implements runtime.Instance: QEMU, the disk, every file. It
// works on any partial state and is idempotent.
func (i *instance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.stopLocked(ctx); err != nil {
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
	i.setPausedLocked(true)
	if err := i.qmp(ctx, "stop"); err != nil {
		i.setPausedLocked(false)
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
	if err := i.qmp(ctx, "cont"); err != nil {
		return err
	}
	i.setPausedLocked(false)
	return nil
}

// setPausedLocked records whether the guest is stopped on purpose (the
// watchdog leaves it alone).
func (i *instance) setPausedLocked(p bool) {
	i.smu.Lock()
	i.paused = p
	i.smu.Unlock()
}

// Stats implements runtime.Instance: memory, OOM kills and processes of
// the sandbox's cgroup and the use of its disk as the guest kernel counts
// them (from the guest's
// init, outside the sandbox's confinement; clamped by vmctl), CPU from the
// host: the jail's cgroup, QEMU's CPU time, which is all the guest ran.
func (i *instance) Stats(ctx context.Context) (runtime.Stats, error) {
	pr := i.current()
	if pr == nil || !pr.alive() {
		return runtime.Stats{}, nil
	}
	i.smu.Lock()
	paused := i.paused
	i.smu.Unlock()
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
