package microvm

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/forkutil"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// Fork.
//
// The parent (its agent quiesced by the manager) is stopped and its state
// saved to a file in its directory; while it stays stopped its disk —
// flushed by QEMU when the migration completed — is sparse-copied into
// every child's directory, so each child's disk matches the saved RAM.
// Then the parent runs again, and each child — its own directory, disk
// copy, sockets and QEMU — is restored from the file and told its own
// entropy, clock and hostname. Children take the parent's VM shape
// (memory, vCPUs, disk size): a restore cannot change them; their own
// limits apply from their next cold boot.

// forkParallel is how many children restore at once: a restore is mostly
// QEMU loading RAM and the guest catching up, CPU-bound under TCG.
const forkParallel = 2

// Fork implements runtime.Forker.
func (i *instance) Fork(ctx context.Context, children []runtime.Spec) (_ []runtime.Instance, err error) {
	if err := forkutil.Validate(i.spec.ID, children); err != nil {
		return nil, err
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.Alive() {
		return nil, fmt.Errorf("fork sandbox %s: not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	t0 := time.Now()
	parentVM, err := i.files.readVM()
	if err != nil {
		return nil, fmt.Errorf("fork sandbox %s: %w", i.spec.ID, err)
	}
	state, err := os.CreateTemp(i.files.dir, "fork-*.state")
	if err != nil {
		return nil, err
	}
	statePath := state.Name()
	state.Close()
	defer os.Remove(statePath)
	var info SaveInfo
	var tSnap time.Time
	out, err := forkutil.Run(ctx, i.spec.ID, children, forkutil.Ops[*instance]{
		New: i.rt.newChild,
		Snapshot: func(ctx context.Context, kids []*instance) error {
			copyDisks := func() error {
				for _, k := range kids {
					if err := hostfs.CopySparse(i.files.diskImage(), k.files.diskImage()); err != nil {
						return fmt.Errorf("copying the disk to %s: %w", k.spec.ID, err)
					}
				}
				return nil
			}
			// The state file lives only until the children are restored:
			// no fsync.
			var err error
			if info, err = i.snap.save(ctx, statePath, false, copyDisks); err != nil {
				return err
			}
			tSnap = time.Now()
			if err := i.snap.cont(ctx, info); err != nil {
				return fmt.Errorf("the parent did not run again: %w", err)
			}
			return nil
		},
		// Each child is restored from the parent's state file.
		Restore: func(ctx context.Context, k *instance) error {
			k.mu.Lock()
			defer k.mu.Unlock()
			hostname := guestHostname(k.spec)
			if err := k.files.writeVM(childVM(parentVM, k.files, hostname)); err != nil {
				return err
			}
			return k.snap.restoreFrom(ctx, statePath, hostname)
		},
		Parallel: forkParallel,
		Log:      i.rt.log,
	})
	if err != nil {
		return nil, err
	}
	i.rt.log.Debug("sandbox forked", "id", i.spec.ID, "children", len(out), "state_bytes", info.Bytes,
		"snapshot", tSnap.Sub(t0), "total", time.Since(t0))
	return out, nil
}

// newChild makes a fork child's directory and vm/ (its disk comes from the
// parent). The child is removed by Destroy like any instance.
func (r *Runtime) newChild(spec runtime.Spec) (*instance, error) {
	k, err := r.newInstance(spec)
	if err != nil {
		return nil, err
	}
	if spec.Hostname != "" && !hostnameRE.MatchString(spec.Hostname) {
		return nil, fmt.Errorf("hostname %q: %w", spec.Hostname, errdefs.ErrInvalidArgument)
	}
	if err := hostfs.MkdirSandbox(k.files.dir, spec.ID); err != nil {
		return nil, err
	}
	if err := os.Mkdir(k.files.vmDir(), 0o700); err != nil {
		os.RemoveAll(k.files.dir)
		return nil, err
	}
	// Restored children count as booted: their disk is not fresh (warm.go).
	if err := k.warm.markBooted(); err != nil {
		os.RemoveAll(k.files.dir)
		return nil, err
	}
	return k, nil
}

// childVM is the parent's VM with a child's own files and hostname.
func childVM(parent VM, files layout, hostname string) VM {
	vm := parent
	vm.AgentSocket = files.agentSocket()
	vm.ConsoleLog = files.consoleLog()
	vm.Disk = files.diskImage()
	vm.CtlSocket = files.ctlSocket()
	vm.QMPSocket = files.qmpSocket()
	if parent.NetSocket != "" {
		vm.NetSocket, vm.NetPeer = files.netSocket(), files.netPeer()
	}
	vm.Hostname = hostname
	vm.IncomingFD = 0
	return vm
}
