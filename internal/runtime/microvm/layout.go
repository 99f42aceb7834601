package microvm

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spacehq/space/internal/errdefs"
)

// layout owns the names of one sandbox's files (sandboxes/<id>/, described
// at instance) and the VM description stored there (vm.json). It holds no
// state beyond the directory: every part of an instance (the QEMU process,
// snapshots, warm templates) names its files through it.
type layout struct {
	id  string // the sandbox's id, for errors
	dir string // sandboxes/<id>
}

func (f layout) vmFile() string      { return filepath.Join(f.dir, "vm.json") }
func (f layout) pidFile() string     { return filepath.Join(f.dir, "qemu.pid") }
func (f layout) qemuErrLog() string  { return filepath.Join(f.dir, "qemu.err") }
func (f layout) stateDir() string    { return filepath.Join(f.dir, "state") }
func (f layout) vmDir() string       { return filepath.Join(f.dir, "vm") }
func (f layout) diskImage() string   { return filepath.Join(f.vmDir(), "disk.img") }
func (f layout) consoleLog() string  { return filepath.Join(f.vmDir(), "console.log") }
func (f layout) agentSocket() string { return filepath.Join(f.vmDir(), "agent.sock") }
func (f layout) ctlSocket() string   { return filepath.Join(f.vmDir(), "ctl.sock") }
func (f layout) qmpSocket() string   { return filepath.Join(f.vmDir(), "qmp.sock") }
func (f layout) netSocket() string   { return filepath.Join(f.vmDir(), "net.sock") }
func (f layout) netPeer() string     { return filepath.Join(f.vmDir(), "gw.sock") }

// stateFile is the suspend image (suspend.go).
func (f layout) stateFile() string { return filepath.Join(f.stateDir(), stateName) }

// bootedFile marks a sandbox that ran (warm.go).
func (f layout) bootedFile() string { return filepath.Join(f.dir, bootedMarker) }

// hungFile holds the watchdog's verdict on the running QEMU, written
// before it kills it: every instance value of the sandbox, and a server
// started later, then tell a hung guest from a crash.
func (f layout) hungFile() string { return filepath.Join(f.dir, "hung") }

// hasSavedState reports whether a suspend image waits in state/.
func (f layout) hasSavedState() bool {
	ents, err := os.ReadDir(f.stateDir())
	return err == nil && len(ents) > 0
}

// writeVM stores the VM description launch starts from.
func (f layout) writeVM(vm VM) error {
	b, err := json.MarshalIndent(vm, "", "  ")
	if err != nil {
		return err
	}
	tmp := f.vmFile() + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, f.vmFile())
}

// readVM loads the stored VM description.
func (f layout) readVM() (VM, error) {
	var vm VM
	b, err := os.ReadFile(f.vmFile())
	if err != nil {
		return vm, fmt.Errorf("sandbox %s has no VM description: %w: %w", f.id, err, errdefs.ErrNotFound)
	}
	if err := json.Unmarshal(b, &vm); err != nil {
		return vm, fmt.Errorf("sandbox %s: VM description: %w", f.id, err)
	}
	return vm, nil
}
