package hostfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spacehq/space/internal/errdefs"
)

// MkdirSandbox creates dir, the host directory of sandbox id (mode 0700),
// and its parent if missing (0700 too). A dir that already exists means
// the sandbox does: errdefs.ErrConflict.
func MkdirSandbox(dir, id string) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("sandbox %s already exists: %w", id, errdefs.ErrConflict)
		}
		return err
	}
	return nil
}

// RemoveSandbox removes dir, the host directory of sandbox id, and
// everything below it, refusing while anything is still mounted below it:
// a RemoveAll through a live mount would delete what is mounted there (a
// template's tree, another disk).
func RemoveSandbox(dir, id string) error {
	mps, err := MountsUnder(dir)
	if err != nil {
		return fmt.Errorf("remove sandbox %s: reading the mount table: %w", id, err)
	}
	if len(mps) > 0 {
		return fmt.Errorf("remove sandbox %s: still has mounts %v", id, mps)
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove sandbox %s: %w", id, err)
	}
	return nil
}
