package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// Snapshot primitives: a guest's whole state (RAM and devices) saved to a
// file through QEMU's migration stream, and a new QEMU that continues from
// that file.
//
// The stream goes through a descriptor QEMU receives over QMP (getfd, then
// `migrate uri=fd:NAME`): QEMU runs with -sandbox spawn=deny, which forbids
// the exec: URIs, and QEMU 7.2 has no file: URI. A restore hands the file
// to the new QEMU as an inherited descriptor (-incoming fd:N). The guest is
// stopped before the save, so the stream is one pass over RAM and nothing
// changes between the state and the disk the caller may copy next: when
// the migration completes QEMU has flushed and released its block devices,
// and it stays paused ("postmigrate") until `cont` or `quit`.

const (
	// migrateFDName names the descriptor handed to QEMU for a save.
	migrateFDName = "space-state"
	// migrateBandwidth lifts QEMU's migration bandwidth cap (32 MiB/s by
	// default, which would make a 256 MiB guest take seconds) to 1 TiB/s.
	migrateBandwidth = 1 << 40
	// DefaultMigrateTimeout bounds a save or a restore when the caller's
	// context has no earlier deadline; a few hundred MiB take well under a
	// second here.
	DefaultMigrateTimeout = 2 * time.Minute
	// migratePoll is how often the migration's progress is asked for.
	migratePoll = 2 * time.Millisecond
)

// SaveInfo describes one save.
type SaveInfo struct {
	Bytes     int64         // size of the state file
	Pause     time.Duration // QMP stop
	Migrate   time.Duration // the stream, from `migrate` to completed
	Sync      time.Duration // fsync of the state file
	WasPaused bool          // the guest was already paused before the save
}

// SaveState stops the guest behind q (if it runs) and writes its state to
// f, which must be empty and open for writing; f is fsync'd. On success
// the guest stays stopped: the caller copies its disk if it needs to, then
// sends `cont` (ContinueAfterSave) or ends QEMU. On error a guest that was
// running runs again, so a failed save never costs the guest.
func SaveState(ctx context.Context, q *QMP, f *os.File) (SaveInfo, error) {
	return saveState(ctx, q, f, true)
}

// saveState is SaveState; durable=false skips the fsync, for a state file
// that does not outlive the process's use of it (a fork's).
func saveState(ctx context.Context, q *QMP, f *os.File, durable bool) (info SaveInfo, err error) {
	ctx, cancel := boundedCtx(ctx, DefaultMigrateTimeout)
	defer cancel()
	t0 := time.Now()
	status, err := q.Status(ctx)
	if err != nil {
		return info, fmt.Errorf("save: %w", err)
	}
	switch status {
	case "running":
		if _, err := q.Execute(ctx, "stop", nil); err != nil {
			return info, fmt.Errorf("save: pausing the guest: %w", err)
		}
	case "paused":
		info.WasPaused = true
	default:
		return info, fmt.Errorf("save: guest is %q, not running or paused: %w", status, errdefs.ErrConflict)
	}
	defer func() {
		if err != nil && !info.WasPaused {
			// A fresh context: the caller's may be what ended the save.
			cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer ccancel()
			if cerr := ContinueAfterSave(cctx, q); cerr != nil {
				err = errors.Join(err, fmt.Errorf("and the guest did not run again: %w", cerr))
			}
		}
	}()
	info.Pause = time.Since(t0)
	params := map[string]any{"max-bandwidth": int64(migrateBandwidth)}
	if _, err := q.Execute(ctx, "migrate-set-parameters", params); err != nil {
		return info, fmt.Errorf("save: %w", err)
	}
	if _, err := q.ExecuteWithFD(ctx, "getfd", map[string]any{"fdname": migrateFDName}, f); err != nil {
		return info, fmt.Errorf("save: passing the state file: %w", err)
	}
	t1 := time.Now()
	if _, err := q.Execute(ctx, "migrate", map[string]any{"uri": "fd:" + migrateFDName}); err != nil {
		// migrate did not take the descriptor: do not leave it in QEMU.
		_, _ = q.Execute(context.WithoutCancel(ctx), "closefd", map[string]any{"fdname": migrateFDName})
		return info, fmt.Errorf("save: %w", err)
	}
	if err := waitMigration(ctx, q); err != nil {
		return info, fmt.Errorf("save: %w", err)
	}
	info.Migrate = time.Since(t1)
	if durable {
		t2 := time.Now()
		if err := f.Sync(); err != nil {
			return info, fmt.Errorf("save: syncing the state file: %w", err)
		}
		info.Sync = time.Since(t2)
	}
	st, err := f.Stat()
	if err != nil {
		return info, fmt.Errorf("save: %w", err)
	}
	if st.Size() == 0 {
		return info, fmt.Errorf("save: QEMU reported completion but wrote nothing")
	}
	info.Bytes = st.Size()
	return info, nil
}

// ContinueAfterSave lets a guest run again after SaveState ("postmigrate":
// `cont` also takes its block devices back).
func ContinueAfterSave(ctx context.Context, q *QMP) error {
	if _, err := q.Execute(ctx, "cont", nil); err != nil {
		return fmt.Errorf("continuing the guest: %w", err)
	}
	return nil
}

// migrationStatus is the part of query-migrate the host reads.
type migrationStatus struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
}

func queryMigrate(ctx context.Context, q *QMP) (migrationStatus, error) {
	raw, err := q.Execute(ctx, "query-migrate", nil)
	if err != nil {
		return migrationStatus{}, err
	}
	var ms migrationStatus
	if err := json.Unmarshal(raw, &ms); err != nil {
		return ms, fmt.Errorf("query-migrate: %w", err)
	}
	return ms, nil
}

// waitMigration polls an outgoing migration until it completes. If it
// fails or ctx ends it is cancelled (and waited for, briefly) so that the
// guest can run again.
func waitMigration(ctx context.Context, q *QMP) error {
	for {
		ms, err := queryMigrate(ctx, q)
		if err != nil {
			return err
		}
		switch ms.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", ms.Status, truncateString(ms.ErrorDesc, 512))
		}
		select {
		case <-ctx.Done():
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			_, _ = q.Execute(cctx, "migrate_cancel", nil)
			for {
				ms, err := queryMigrate(cctx, q)
				if err != nil || ms.Status == "cancelled" || ms.Status == "failed" || ms.Status == "completed" {
					break
				}
				time.Sleep(migratePoll)
			}
			return fmt.Errorf("migration did not finish (last status %q): %w", ms.Status, errors.Join(ctx.Err(), errdefs.ErrTimeout))
		case <-time.After(migratePoll):
		}
	}
}

// WaitIncoming waits until a QEMU started with -incoming has loaded its
// state and runs the guest (it starts on its own once loaded). exited is
// closed when that QEMU ends — a stream it could not load makes it exit.
func WaitIncoming(ctx context.Context, q *QMP, exited <-chan struct{}) error {
	ctx, cancel := boundedCtx(ctx, DefaultMigrateTimeout)
	defer cancel()
	for {
		status, err := q.Status(ctx)
		if err != nil {
			select {
			case <-exited:
				return fmt.Errorf("QEMU exited while loading the state: %w", errdefs.ErrUnavailable)
			default:
			}
			return fmt.Errorf("restore: %w", err)
		}
		switch status {
		case "running":
			return nil
		case "inmigrate":
		case "paused", "postmigrate", "prelaunch":
			// Loaded but not started (a -S QEMU, or autostart off).
			ms, err := queryMigrate(ctx, q)
			if err != nil {
				return fmt.Errorf("restore: %w", err)
			}
			if ms.Status == "completed" || ms.Status == "" {
				if _, err := q.Execute(ctx, "cont", nil); err != nil {
					return fmt.Errorf("restore: starting the loaded guest: %w", err)
				}
				continue
			}
		default:
			return fmt.Errorf("restore: guest is %q after loading its state", status)
		}
		select {
		case <-exited:
			return fmt.Errorf("QEMU exited while loading the state: %w", errdefs.ErrUnavailable)
		case <-ctx.Done():
			return fmt.Errorf("restore: state not loaded (status %q): %w", status, errors.Join(ctx.Err(), errdefs.ErrTimeout))
		case <-time.After(migratePoll):
		}
	}
}

// chardevFrontendOpen reports whether the guest holds open the
// virtio-serial port behind the chardev with id label (QMP query-chardev
// "frontend-open": virtio-serial ports report the guest's open/close of the
// port there).
func chardevFrontendOpen(ctx context.Context, q *QMP, label string) (bool, error) {
	raw, err := q.Execute(ctx, "query-chardev", nil)
	if err != nil {
		return false, err
	}
	var chs []struct {
		Label        string `json:"label"`
		FrontendOpen bool   `json:"frontend-open"`
	}
	if err := json.Unmarshal(raw, &chs); err != nil {
		return false, fmt.Errorf("query-chardev: %w", err)
	}
	for _, c := range chs {
		if c.Label == label {
			return c.FrontendOpen, nil
		}
	}
	return false, fmt.Errorf("query-chardev: no chardev %q: %w", label, errdefs.ErrNotFound)
}

// agentChardev is the id of the agent port's chardev (VM.Args).
const agentChardev = "agent"

// WaitAgentPortReleased waits, up to d, until the guest's agent has closed
// its port once. Call it after the host closed its agent connection (the
// manager quiesces the agent and drops its client before a suspend or a
// fork): the agent then ends that session and reopens the port for the
// next one. A snapshot taken before that could hold the old session, and a
// host connecting to the restored guest right away would talk into it —
// the guest may never see the disconnect of a host that reconnects at
// once (virtio-serial only tells it "host connected" again), and the old
// session stalls the new one for a minute ("duplicate stream"). It
// returns false when the port stayed open for d.
func WaitAgentPortReleased(ctx context.Context, q *QMP, d time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for {
		open, err := chardevFrontendOpen(ctx, q, agentChardev)
		if err != nil {
			if ctx.Err() != nil {
				return false, nil
			}
			return false, err
		}
		if !open {
			return true, nil
		}
		select {
		case <-ctx.Done():
			return false, nil
		case <-time.After(migratePoll):
		}
	}
}

// boundedCtx gives ctx a deadline of d from now unless it has an earlier one.
func boundedCtx(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= d {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}
