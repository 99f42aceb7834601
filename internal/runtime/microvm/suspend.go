package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// Suspend and restore.
//
// Suspend saves the whole guest (RAM and devices, SaveState) into
// state/vm.state and ends QEMU; the disk stays where it is, consistent with
// the saved RAM (QEMU flushed it when the migration completed, and the
// guest never ran again). Restore starts QEMU from vm.json with the state
// as its incoming stream, then tells the guest's init it was restored
// (vmctl: fresh host entropy credited and the CRNG reseeded, the clock set
// to now, the hostname), and removes the image.
//
// The state is written to a temporary file in the sandbox directory and
// renamed into state/ only once complete and synced, so Suspended (the
// image's presence) never sees a partial one, also after a server restart.
// Neither the image nor vm.json lives in vm/, the directory QEMU may write.

var (
	_ runtime.Suspender = (*instance)(nil)
	_ runtime.Forker    = (*instance)(nil)
)

const (
	// stateName is the suspend image in stateDir.
	stateName = "vm.state"
	// agentReleaseWait bounds the wait for the quiesced agent to let go of
	// its port (it closes sessions the host left open after 0.5 s).
	agentReleaseWait = 3 * time.Second
)

// Suspended implements runtime.Suspender.
func (i *instance) Suspended() bool {
	var st unix.Stat_t
	return unix.Lstat(i.files.stateFile(), &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFREG
}

// Suspend implements runtime.Suspender. The manager has quiesced the agent
// and dropped its connection.
func (i *instance) Suspend(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.Alive() {
		return fmt.Errorf("suspend sandbox %s: not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if i.Suspended() {
		return fmt.Errorf("suspend sandbox %s: already holds a suspend image: %w", i.spec.ID, errdefs.ErrConflict)
	}
	t0 := time.Now()
	if err := i.syncGuestLocked(ctx); err != nil {
		// Only a Stop of the suspended sandbox (which discards its RAM)
		// would lose the guest's unwritten data; the suspend goes on.
		i.rt.log.Warn("suspend: the guest did not sync its disk", "id", i.spec.ID, "err", err)
	}
	tSynced := time.Now()
	tmp := filepath.Join(i.files.dir, stateName+".tmp")
	info, err := i.snap.save(ctx, tmp, true, nil)
	if err != nil {
		return fmt.Errorf("suspend sandbox %s: %w", i.spec.ID, err)
	}
	// The guest stays stopped from here on: whatever fails, it is either
	// saved or running again.
	if err := publishState(tmp, i.files.stateDir(), i.files.stateFile()); err != nil {
		os.Remove(tmp)
		return errors.Join(fmt.Errorf("suspend sandbox %s: %w", i.spec.ID, err), i.snap.cont(ctx, info))
	}
	tSaved := time.Now()
	if err := i.vm.stop(ctx); err != nil {
		return fmt.Errorf("suspend sandbox %s: saved, but stopping QEMU: %w", i.spec.ID, err)
	}
	i.rt.log.Debug("sandbox suspended", "id", i.spec.ID, "guest_sync", tSynced.Sub(t0), "bytes", info.Bytes, "pause", info.Pause,
		"migrate", info.Migrate, "sync", info.Sync, "total", tSaved.Sub(t0), "stop", time.Since(tSaved))
	return nil
}

// guestSyncTimeout bounds the guest's sync before a suspend.
const guestSyncTimeout = 20 * time.Second

// syncGuestLocked makes the guest write its dirty page cache to its disk
// before a suspend (vmctl sync, done by the guest's init): a suspended
// sandbox may be stopped, which discards its RAM and keeps only the disk,
// and that disk must then hold everything written before the suspend.
func (i *instance) syncGuestLocked(ctx context.Context) error {
	paused := i.vm.isPaused()
	if paused {
		return errors.New("the guest is paused")
	}
	ctx, cancel := context.WithTimeout(ctx, guestSyncTimeout)
	defer cancel()
	return i.guest.sync(ctx)
}

// publishState moves the complete state file tmp to dst in dir.
func publishState(tmp, dir, dst string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Restore implements runtime.Suspender, also on an instance from Open
// after a server restart. On error the image stays (Restore may be
// retried) and no QEMU of the attempt runs.
func (i *instance) Restore(ctx context.Context) (err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.Alive() {
		return fmt.Errorf("restore sandbox %s: running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if !i.Suspended() {
		return fmt.Errorf("restore sandbox %s: no suspend image: %w", i.spec.ID, errdefs.ErrConflict)
	}
	t0 := time.Now()
	if err := i.snap.restoreFrom(ctx, i.files.stateFile(), guestHostname(i.spec)); err != nil {
		return fmt.Errorf("restore sandbox %s: %w", i.spec.ID, err)
	}
	tRestored := time.Now()
	if err := os.RemoveAll(i.files.stateDir()); err != nil {
		return fmt.Errorf("restore sandbox %s: removing its image: %w", i.spec.ID, err)
	}
	i.rt.log.Debug("sandbox restored", "id", i.spec.ID, "restore", tRestored.Sub(t0))
	return nil
}

// snapshots owns the snapshot steps of one sandbox's guest that Suspend,
// Fork and warm templates are made of: saving the stopped guest's state
// to a file once its agent let go of its port (with the disks copied while
// it stays stopped), letting it run again, and continuing a new QEMU from
// a state file, the guest told it was restored. Callers hold the
// instance's mu.
type snapshots struct {
	rt    *Runtime
	id    string
	files layout
	vm    *vmm
	guest *guestCtl
}

// save waits for the agent to release its port, stops the guest
// and saves its state into the new file path (fsync'd if durable); then,
// with the guest still stopped, it runs copyDisks (may be nil). On error
// the file is removed and a guest that ran runs again. On success the guest stays stopped: the
// caller ends QEMU or calls cont.
func (sn *snapshots) save(ctx context.Context, path string, durable bool, copyDisks func() error) (info SaveInfo, err error) {
	if err := sn.waitAgentReleased(ctx); err != nil {
		return info, err
	}
	q, err := sn.vm.qmpClient(ctx)
	if err != nil {
		return info, err
	}
	defer func() {
		if err != nil && errors.Is(err, errdefs.ErrUnavailable) {
			dropQMP(sn.files.qmpSocket(), q)
		}
	}()
	_ = os.Remove(path)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return info, err
	}
	defer f.Close()
	wasPaused := sn.vm.setPaused(true) // the watchdog leaves a stopped guest alone
	if !wasPaused {
		// vmctl answers strictly in turn, without request ids: a call in
		// flight when the guest stops (a watchdog ping) would be answered
		// by a restored copy to its own host, as the answer to its first
		// call. One round trip now waits for any call in flight, and the
		// watchdog leaves a paused guest alone.
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := sn.guest.ping(pctx); err != nil {
			sn.rt.log.Warn("snapshot: the guest's init did not answer a ping", "id", sn.id, "err", err)
		}
		cancel()
	}
	info, err = saveState(ctx, q, f, durable)
	if err != nil {
		os.Remove(path)
		sn.vm.setPaused(wasPaused)
		return info, err
	}
	info.WasPaused = info.WasPaused || wasPaused
	if copyDisks != nil {
		if err := copyDisks(); err != nil {
			os.Remove(path)
			return info, errors.Join(err, sn.cont(ctx, info))
		}
	}
	return info, nil
}

// waitAgentReleased waits for the guest's agent to close its port
// after the host dropped its connection (WaitAgentPortReleased). An agent
// that keeps it open (not quiesced, or no longer ours) is logged and not
// waited for longer: its session would be in a snapshot, and a host
// dialling the restored guest at once could talk into it.
func (sn *snapshots) waitAgentReleased(ctx context.Context) error {
	q, err := sn.vm.qmpClient(ctx)
	if err != nil {
		return err
	}
	ok, err := WaitAgentPortReleased(ctx, q, agentReleaseWait)
	if err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropQMP(sn.files.qmpSocket(), q)
		}
		return err
	}
	if !ok {
		sn.rt.log.Warn("the agent kept its port open", "id", sn.id, "waited", agentReleaseWait)
	}
	return nil
}

// cont lets the guest run again after save, unless it
// was paused before.
func (sn *snapshots) cont(ctx context.Context, info SaveInfo) error {
	if info.WasPaused {
		return nil
	}
	q, err := sn.vm.qmpClient(ctx)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := ContinueAfterSave(cctx, q); err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropQMP(sn.files.qmpSocket(), q)
		}
		return err
	}
	sn.vm.setPaused(false)
	return nil
}

// restoreFrom starts QEMU from vm.json with the state file as its
// incoming stream, waits until the guest runs and tells its init it was
// restored. On error QEMU is stopped.
func (sn *snapshots) restoreFrom(ctx context.Context, state, hostname string) (err error) {
	fd, err := unix.Open(state, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: state, Err: err}
	}
	f := os.NewFile(uintptr(fd), state)
	defer f.Close()
	defer func() {
		if err != nil {
			if serr := sn.vm.stop(context.WithoutCancel(ctx)); serr != nil {
				err = errors.Join(err, serr)
			}
		}
	}()
	t0 := time.Now()
	if err := sn.vm.launch(ctx, f); err != nil {
		// A stream QEMU cannot load ends it before its monitor answers:
		// its stderr says why.
		if msg := strings.TrimSpace(readTail(sn.files.qemuErrLog(), 1024)); msg != "" {
			return fmt.Errorf("%w; QEMU: %s", err, msg)
		}
		return err
	}
	tLaunched := time.Now()
	pr := sn.vm.current()
	q, err := sn.vm.qmpClient(ctx)
	if err != nil {
		return err
	}
	if err := WaitIncoming(ctx, q, pr.exited); err != nil {
		if !pr.alive() {
			return fmt.Errorf("%w: %s", err, sn.vm.describeExit(pr))
		}
		return err
	}
	sn.vm.setPaused(false)
	tLoaded := time.Now()
	if err := sn.guest.restored(ctx, hostname); err != nil {
		return err
	}
	// launch: jail + QEMU up to its monitor; load: the state read and the
	// guest continued; reseed: vmctl restored answered by the running guest.
	sn.rt.log.Debug("guest restored", "id", sn.id, "launch", tLaunched.Sub(t0), "load", tLoaded.Sub(tLaunched), "reseed", time.Since(tLoaded))
	return nil
}

// guestHostname is the sandbox's hostname in the guest.
func guestHostname(spec runtime.Spec) string {
	if spec.Hostname != "" {
		return spec.Hostname
	}
	return spec.ID
}
