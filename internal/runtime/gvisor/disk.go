package gvisor

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// The writable layer of a sandbox is a sparse ext4 image of Limits.DiskMiB
// mounted on the host, so a full disk is a real ENOSPC inside the sandbox
// and never a full host. The sandbox's root is a host overlayfs of the
// template tree (lower, never written) and the image's upper/ directory;
// runsc serves that merged directory to the sandbox through its gofer.

// formatDisk creates img (sparse) with an ext4 filesystem whose root
// belongs to the sandbox's root, giving mkfs at most a minute.
func formatDisk(ctx context.Context, img string, sizeMiB int64) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return hostfs.FormatExt4(ctx, img, sizeMiB, confine.IDBase)
}

// mountDisk mounts img at dir with upper/ and work/ owned by the sandbox's root.
func mountDisk(img, dir string) error { return hostfs.MountDisk(img, dir, confine.IDBase) }

// mountOverlay mounts the sandbox's root at merged: lower is the template
// tree, read-only to overlayfs by construction.
func mountOverlay(lower, upper, work, merged string) error {
	if hostfs.IsMountPoint(merged) {
		return nil
	}
	if err := os.MkdirAll(merged, 0o755); err != nil {
		return err
	}
	for _, p := range []string{lower, upper, work} {
		if strings.ContainsAny(p, ",:") {
			return fmt.Errorf("overlay layer path %q contains ',' or ':'", p)
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount overlay at %s: %w", merged, err)
	}
	return nil
}
