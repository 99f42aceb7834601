package gvisor

import (
	"errors"
	"os"
	"path/filepath"
)

// layout owns one sandbox's directory (sandboxes/<id>/): the names of what
// lives there, and mounting the sandbox's root in it. It holds nothing
// beyond the path; every part of an instance (the agent's channel,
// checkpoints, stats) names its files through it.
//
//	disk.img      the writable ext4 disk, mounted at rw/ while in use
//	rw/           upper/ and work/ of the overlay
//	lower/        the template, id-mapped read-only
//	rootfs/       the overlay: the sandbox's root
//	agent/        the agent's directory (/run/space in the sandbox)
//	netns         the pinned network namespace (network.go)
//	checkpoint/   a suspend image (suspend.go)
//	sandbox.pid   "pid starttime" of the sentry (re-adoption)
//	runsc.pid     the pid runsc wrote
type layout struct {
	dir string
}

func (f layout) diskImage() string { return filepath.Join(f.dir, "disk.img") }
func (f layout) rwDir() string     { return filepath.Join(f.dir, "rw") }
func (f layout) rootfsDir() string { return filepath.Join(f.dir, "rootfs") }
func (f layout) lowerDir() string  { return filepath.Join(f.dir, "lower") }
func (f layout) agentDir() string  { return filepath.Join(f.dir, "agent") }
func (f layout) sockPath() string  { return filepath.Join(f.agentDir(), agentSock) }
func (f layout) pidFile() string   { return filepath.Join(f.dir, "sandbox.pid") }
func (f layout) runscPid() string  { return filepath.Join(f.dir, "runsc.pid") }
func (f layout) netnsPath() string { return filepath.Join(f.dir, "netns") }
func (f layout) imageDir() string  { return filepath.Join(f.dir, "checkpoint") }

// mountRoot mounts the writable disk, the template at templateRoot
// id-mapped through the user namespace userns gives, and the overlay, and
// readies the agent's directory (no stale socket or pid files).
func (f layout) mountRoot(templateRoot string, userns func() (int, error)) error {
	if err := mountDisk(f.diskImage(), f.rwDir()); err != nil {
		return err
	}
	fd, err := userns()
	if err != nil {
		return err
	}
	if err := mountIDMapped(templateRoot, f.lowerDir(), fd); err != nil {
		return err
	}
	if err := mountOverlay(f.lowerDir(), filepath.Join(f.rwDir(), "upper"), filepath.Join(f.rwDir(), "work"), f.rootfsDir()); err != nil {
		return err
	}
	if err := makeAgentDir(f.agentDir()); err != nil {
		return err
	}
	for _, p := range []string{f.sockPath(), f.runscPid(), f.pidFile()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}
