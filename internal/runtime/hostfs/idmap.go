package hostfs

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"
)

// IDMap maps Size ids from 0 inside a user namespace to HostID… outside.
type IDMap struct {
	HostID uint32
	Size   uint32
}

// HoldArg is the first argument that makes space-agent a holder for
// OpenUserns: it blocks until its stdin reaches EOF and exits.
const HoldArg = "hold-userns"

// OpenUserns returns a descriptor of a new user namespace with ids mapped
// by m (uids and gids alike), for id-mapped mounts. A Go program cannot
// create a user namespace in-process, so holder (argv, env) is started in
// one: it must block until its stdin reaches EOF and then exit (space-agent
// does with HoldArg). The namespace lives as long as the returned
// descriptor is open; the caller closes it.
func OpenUserns(holder, env []string, m IDMap) (int, error) {
	if len(holder) == 0 {
		return -1, fmt.Errorf("user namespace holder: no program")
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return -1, err
	}
	defer pr.Close()
	defer pw.Close()
	cmd := exec.Command(holder[0], holder[1:]...)
	cmd.Env = env
	cmd.Stdin = pr
	idm := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(m.HostID), Size: int(m.Size)}}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  unix.CLONE_NEWUSER,
		UidMappings: idm,
		GidMappings: idm,
		Pdeathsig:   syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		return -1, fmt.Errorf("user namespace for id-mapped mounts: %w", err)
	}
	fd, openErr := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	pw.Close()
	if err := cmd.Wait(); err != nil && openErr == nil {
		unix.Close(fd)
		return -1, fmt.Errorf("user namespace holder: %w", err)
	}
	if openErr != nil {
		return -1, fmt.Errorf("open user namespace: %w", openErr)
	}
	return fd, nil
}

// MountIDMapped attaches at dst a read-only, nosuid, nodev view of the tree
// at src and everything mounted below it, with ids mapped through the user
// namespace userns (host id X appears as the id X maps to outside userns;
// ids it does not map appear as the overflow id). dst is created if
// missing; if it already is a mount point, MountIDMapped assumes an earlier
// call attached it and does nothing (callers that re-adopt after a crash
// rely on this).
func MountIDMapped(src, dst string, userns int) error {
	if IsMountPoint(dst) {
		return nil
	}
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return err
	}
	tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("open_tree %s: %w", src, err)
	}
	defer unix.Close(tree)
	attr := unix.MountAttr{
		Attr_set:  unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV,
		Userns_fd: uint64(userns),
	}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		return fmt.Errorf("id-map %s: %w", src, err)
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach id-mapped %s at %s: %w", src, dst, err)
	}
	return nil
}
