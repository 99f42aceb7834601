package gvisor

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// Inside gVisor the agent runs in a user namespace of its own (package
// ginit) where root is uid ginit.IDBase of the sentry, and through the
// gofer the sentry's ids are the host's. The template tree, owned by host
// root, is therefore mounted id-mapped (host 0 → IDBase) as the overlay's
// lower layer; the writable layer is created owned by IDBase. The template
// on disk stays as it is, shared by every runtime.

// usernsFD returns a descriptor of a user namespace mapping 0..IDSize-1 to
// IDBase…, made once per runtime: the agent binary's hold stage keeps the
// namespace alive while it is opened.
func (r *Runtime) usernsFD() (int, error) {
	r.usernsOnce.Do(func() { r.userns, r.usernsErr = makeUserns(r.cfg.AgentBinary) })
	return r.userns, r.usernsErr
}

func makeUserns(agent string) (int, error) {
	pr, pw, err := os.Pipe()
	if err != nil {
		return -1, err
	}
	defer pr.Close()
	defer pw.Close()
	cmd := exec.Command(agent)
	cmd.Env = []string{ginit.EnvStage + "=" + ginit.StageHold}
	cmd.Stdin = pr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  unix.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: ginit.IDBase, Size: ginit.IDSize}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: ginit.IDBase, Size: ginit.IDSize}},
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

// mountIDMapped attaches at dst a read-only, id-mapped (per userns) view of
// the tree at src and everything mounted below it.
func mountIDMapped(src, dst string, userns int) error {
	if hostfs.IsMountPoint(dst) {
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
