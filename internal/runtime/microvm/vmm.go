package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/hostproc"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
)

// vmm owns one sandbox's QEMU process, one at a time: launching it from
// vm.json inside its jail (or adopting one that outlived a server
// restart), its QMP monitor, whether the guest is paused on purpose, the
// watchdog that pings the guest's init, why the process ended on its own
// (ExitReason), and killing it with its run files. The instance's
// lifecycle methods call launch, adopt and stop with the instance's mu
// held; mu here guards only the fields below, for short reads that never
// wait for a boot.
type vmm struct {
	rt    *Runtime
	spec  runtime.Spec
	files layout
	guest *guestCtl // the watchdog pings through it; a launch forgets its stats

	mu         sync.Mutex
	proc       *vmProc // the running QEMU; nil when none
	paused     bool
	exitReason string // why the last QEMU ended on its own
}

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

func (v *vmm) current() *vmProc {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.proc
}

// alive: QEMU runs (the guest may be paused).
func (v *vmm) alive() bool {
	pr := v.current()
	return pr != nil && pr.alive()
}

// exited is closed when the running QEMU ends; nil when none runs.
func (v *vmm) exited() <-chan struct{} {
	if pr := v.current(); pr != nil {
		return pr.exited
	}
	return nil
}

// pid is QEMU's host pid (0 when not running).
func (v *vmm) pid() int {
	if pr := v.current(); pr != nil && pr.alive() {
		return pr.pid
	}
	return 0
}

// lastExit is why the last QEMU ended on its own (guest panic, guest
// power-off, QEMU crash, hung guest), with the console's tail. Empty while
// running or after a stop.
func (v *vmm) lastExit() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.proc != nil && v.proc.alive() {
		return ""
	}
	return v.exitReason
}

func (v *vmm) consoleTail(max int64) string { return readTail(v.files.consoleLog(), max) }

// launch starts QEMU from vm.json; incoming, when not nil, is the migration
// stream it restores from (descriptor 3, -incoming fd:3). QEMU is detached
// from this process (it outlives a server restart). launch records the
// pid, dials QMP and starts watching. Called with the instance's mu held
// and no QEMU running.
func (v *vmm) launch(ctx context.Context, incoming *os.File) (err error) {
	if v.alive() {
		return fmt.Errorf("sandbox %s: QEMU already runs: %w", v.spec.ID, errdefs.ErrConflict)
	}
	vm, err := v.files.readVM()
	if err != nil {
		return err
	}
	vm.IncomingFD = 0
	if incoming != nil {
		vm.IncomingFD = 3
	}
	releaseConns(v.files.agentSocket(), v.files.qmpSocket(), v.files.ctlSocket())
	// QEMU truncates the console log itself (-serial file: opens it so).
	p, err := Launch(vm, LaunchOptions{Incoming: incoming, Detached: true, StderrPath: v.files.qemuErrLog(), Jail: v.jailOptions(vm)})
	if err != nil {
		return err
	}
	pr := &vmProc{pid: p.Pid(), exited: make(chan struct{}), p: p}
	_ = os.Remove(v.files.hungFile())
	go v.reap(pr, p.Done())
	defer func() {
		if err != nil {
			pr.stopping.Store(true)
			_ = pr.kill(10 * time.Second)
		}
	}()
	rec, err := hostproc.Identify(pr.pid)
	if err != nil {
		return fmt.Errorf("QEMU exited at once: %v", pr.qemuError(v.files.qemuErrLog()))
	}
	pr.startTime = rec.StartTime
	if err := hostproc.WritePidFile(v.files.pidFile(), rec); err != nil {
		return err
	}
	v.mu.Lock()
	v.proc, v.paused, v.exitReason = pr, false, ""
	v.mu.Unlock()
	v.guest.forget()
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := v.qmpClient(qctx); err != nil {
		if !pr.alive() {
			return fmt.Errorf("sandbox %s: QEMU ended: %s", v.spec.ID, v.describeExit(pr))
		}
		return err
	}
	go v.watch(pr)
	return nil
}

// qemuOverheadMiB is QEMU's own memory beside the guest's RAM and TCG's
// translation cache: device state, block and I/O buffers, its heap.
const qemuOverheadMiB = 128

// jailOptions confine the QEMU of vm: it writes only vm/, and its host
// cgroup bounds its memory to the guest's RAM plus what QEMU needs on
// top, its CPU to the vCPUs plus half a core for QEMU's own threads (the
// main loop, I/O), and its threads to jail.DefaultPids.
func (v *vmm) jailOptions(vm VM) *JailOptions {
	mem := int64(vm.MemoryMiB+vm.TBSizeMiB+qemuOverheadMiB) << 20
	o := &JailOptions{
		ID:       v.spec.ID,
		Binary:   v.rt.jailBinary(),
		Writable: []string{v.files.vmDir()},
		Limits:   jail.Limits{MemoryBytes: mem, CPUs: float64(max(vm.CPUs, 1)) + 0.5},
	}
	if v.spec.Background {
		o.Limits.CPUWeight = cgroupfs.BackgroundCPUWeight
	}
	return o
}

// adopt attaches to a QEMU that still runs (a server restart): the
// pid file must name a live process with the recorded start time whose
// command line names this sandbox's directory.
// Called with the instance's mu held.
func (v *vmm) adopt(ctx context.Context) {
	hp, err := hostproc.Adopt(v.files.pidFile())
	if err != nil {
		return
	}
	// Read after the pidfd was opened and the start time matched, so it
	// is that process's command line.
	cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", hp.Pid()))
	if !strings.Contains(string(cmdline), v.files.dir+"/") {
		_ = hp.Close()
		return
	}
	pr := &vmProc{pid: hp.Pid(), startTime: hp.Record().StartTime, exited: make(chan struct{}), hp: hp}
	pr.armed.Store(true) // it ran before the restart
	go v.reap(pr, hp.Exited())
	v.mu.Lock()
	v.proc, v.exitReason = pr, ""
	v.mu.Unlock()
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if q, err := v.qmpClient(qctx); err == nil {
		if status, err := q.Status(qctx); err == nil {
			v.mu.Lock()
			v.paused = status == "paused"
			v.mu.Unlock()
		}
	}
	go v.watch(pr)
}

// qmpClient is the VM's QMP client (dialled when there is none).
func (v *vmm) qmpClient(ctx context.Context) (*QMP, error) {
	if !v.alive() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", v.spec.ID, errdefs.ErrUnavailable)
	}
	return sharedQMP(ctx, v.files.qmpSocket())
}

// qmp runs one QMP command; a failed transport drops the client.
func (v *vmm) qmp(ctx context.Context, cmd string) error {
	q, err := v.qmpClient(ctx)
	if err != nil {
		return err
	}
	if _, err := q.Execute(ctx, cmd, nil); err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropQMP(v.files.qmpSocket(), q)
		}
		return fmt.Errorf("sandbox %s: %w", v.spec.ID, err)
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
func (v *vmm) reap(pr *vmProc, dead <-chan struct{}) {
	<-dead
	v.recordExit(pr)
	close(pr.exited)
}

// watch waits for pr to exit, pinging the guest's init meanwhile, and
// records why it ended when the runtime did not end it.
func (v *vmm) watch(pr *vmProc) {
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
		v.mu.Lock()
		paused, current := v.paused, v.proc == pr
		v.mu.Unlock()
		if paused || !current || pr.stopping.Load() {
			misses = 0
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), watchdogTimeout)
		err := v.guest.ping(ctx)
		cancel()
		v.mu.Lock()
		paused = v.paused // paused while the ping was out: not a miss
		v.mu.Unlock()
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
			v.rt.log.Warn("guest did not answer a ping", "id", v.spec.ID, "err", err)
		}
		if misses >= watchdogMisses && time.Since(first) >= watchdogHang {
			why := fmt.Sprintf("the guest hung: its init answered no ping for %v (%d in a row; last: %v); QEMU was killed",
				time.Since(first).Round(time.Second), misses, oneLine(err.Error(), 200))
			_ = os.WriteFile(v.files.hungFile(), []byte(why), 0o600)
			_ = pr.kill(10 * time.Second)
		}
	}
}

// recordExit keeps the reason of an exit the runtime did not cause.
func (v *vmm) recordExit(pr *vmProc) {
	if pr.stopping.Load() {
		return
	}
	// Another instance value of this sandbox (an Open in this process)
	// stopped it: it removed or replaced the pid file first.
	if rec, err := hostproc.ReadPidFile(v.files.pidFile()); err != nil || rec != (hostproc.Record{Pid: pr.pid, StartTime: pr.startTime}) {
		return
	}
	why := v.describeExit(pr)
	v.rt.log.Warn("sandbox VM ended", "id", v.spec.ID, "reason", oneLine(why, 400))
	v.mu.Lock()
	if v.proc == pr {
		v.exitReason = why
	}
	v.mu.Unlock()
}

// describeExit says why pr ended, with the console's tail.
func (v *vmm) describeExit(pr *vmProc) string {
	tail := strings.TrimSpace(v.consoleTail(2048))
	var how string
	switch qerr := pr.qemuError(v.files.qemuErrLog()); {
	case readTail(v.files.hungFile(), 1024) != "":
		how = readTail(v.files.hungFile(), 1024)
	case strings.Contains(tail, "Kernel panic"):
		how = "the guest kernel panicked"
	case qerr != nil:
		how = "QEMU failed: " + qerr.Error()
	default:
		how = "the guest powered off (its init ended, e.g. the agent exited or was killed)"
	}
	return how + "; console:\n" + tail
}

// stop kills QEMU if it runs and removes its run files; the disk,
// vm.json, the console log and state/ stay. Called with the instance's mu
// held.
func (v *vmm) stop(ctx context.Context) error {
	v.mu.Lock()
	pr := v.proc
	v.mu.Unlock()
	if pr != nil {
		pr.stopping.Store(true)
		// First, so that other instance values of the sandbox see a
		// stop, not a crash (recordExit); a QEMU that survives is still
		// found by its cgroup and command line.
		_ = os.Remove(v.files.pidFile())
		if err := pr.kill(15 * time.Second); err != nil {
			return fmt.Errorf("sandbox %s: %w", v.spec.ID, err)
		}
	}
	releaseConns(v.files.agentSocket(), v.files.qmpSocket(), v.files.ctlSocket())
	v.mu.Lock()
	if v.proc == pr {
		v.proc, v.paused = nil, false
	}
	v.mu.Unlock()
	var errs []error
	// Kills whatever else still runs in the jail's cgroup.
	if err := jail.RemoveCgroup(v.spec.ID); err != nil {
		errs = append(errs, err)
	}
	// The NIC's sockets too: a descriptor NIC returned for this QEMU is
	// dead with it, and the next QEMU's NIC binds a fresh host end.
	for _, p := range []string{v.files.pidFile(), v.files.agentSocket(), v.files.ctlSocket(), v.files.qmpSocket(), v.files.netSocket(), v.files.netPeer()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// setPaused records whether the guest is stopped on purpose (the
// watchdog leaves it alone) and returns what was recorded before.
func (v *vmm) setPaused(p bool) (was bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	was, v.paused = v.paused, p
	return was
}

// isPaused reports whether the guest is stopped on purpose.
func (v *vmm) isPaused() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.paused
}
