package microvm

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spacehq/space/internal/errdefs"
)

// KernelRelease is the guest kernel scripts/setup.sh pins
// (linux-image-6.1.0-50-cloud-amd64 6.1.176-1); keep the two in step.
const KernelRelease = "6.1.0-50-cloud-amd64"

// Kernel is an unpacked guest kernel package.
type Kernel struct {
	Release    string
	Dir        string // the package's unpacked tree
	Vmlinuz    string // compressed bzImage: QEMU boots it directly
	ModulesDir string // lib/modules/<release>
}

// KernelDir is where scripts/setup.sh unpacks the guest kernel below the
// cache directory (testenv.CacheDir, /var/cache/space by default).
func KernelDir(cacheDir string) string {
	return filepath.Join(cacheDir, "microvm", "kernel-"+KernelRelease)
}

// FindKernel returns the pinned guest kernel unpacked below cacheDir, or an
// error wrapping errdefs.ErrNotFound when setup has not unpacked it
// completely.
func FindKernel(cacheDir string) (Kernel, error) {
	dir := KernelDir(cacheDir)
	k := Kernel{
		Release:    KernelRelease,
		Dir:        dir,
		Vmlinuz:    filepath.Join(dir, "boot", "vmlinuz-"+KernelRelease),
		ModulesDir: filepath.Join(dir, "lib", "modules", KernelRelease),
	}
	// setup.sh writes "complete" last, after an atomic rename of the tree.
	for _, p := range []string{filepath.Join(dir, "complete"), k.Vmlinuz, k.ModulesDir} {
		if _, err := os.Stat(p); err != nil {
			return Kernel{}, fmt.Errorf("guest kernel %s (run scripts/setup.sh): %w: %w", KernelRelease, err, errdefs.ErrNotFound)
		}
	}
	return k, nil
}
