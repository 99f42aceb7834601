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
