package native

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

// configSocket returns a connected SEQPACKET pair (one message, one read):
// the host's end and the init's end
// (passed as nsinit.FDConfig).
func configSocket() (host, child *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	return os.NewFile(uintptr(fds[0]), "config-host"), os.NewFile(uintptr(fds[1]), "config-init"), nil
}

// sendConfig sends cfg to the init with O_PATH descriptors of dirs
// (lower, upper, work, root), opened through /proc/<pid>/root so that they
// belong to the init's mount namespace. The init runs as an unprivileged
// host uid and gets descriptors instead of paths, so DataDir (and whatever
// holds it) stays closed to that uid.
func sendConfig(sock *os.File, pid int, cfg any, dirs []string) error {
	if len(dirs) != nsinit.LayerFDs {
		return fmt.Errorf("sendConfig: %d dirs", len(dirs))
	}
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	root, err := unix.Open(fmt.Sprintf("/proc/%d/root", pid), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the sandbox init's root: %w", err)
	}
	defer unix.Close(root)
	for _, d := range dirs {
		// RESOLVE_IN_ROOT: an absolute symlink on the way (a DataDir
		// behind a link) must resolve in the init's namespace too, not in
		// ours, or the layer would belong to the wrong namespace.
		fd, err := unix.Openat2(root, d, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
		})
		if err != nil {
			return fmt.Errorf("open %s in the sandbox's mount namespace: %w", d, err)
		}
		fds = append(fds, fd)
	}
	data, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	if err := unix.Sendmsg(int(sock.Fd()), data, unix.UnixRights(fds...), nil, 0); err != nil {
		return fmt.Errorf("send config to sandbox init: %w", err)
	}
	return nil
}

// InitBinaryName is the small first-stage binary (cmd/space-nsinit) the
// runtime starts as a sandbox's init when it lies next to the agent binary;
// without it the agent binary is the init too (`space-agent init-native`).
const InitBinaryName = "space-nsinit"

// initBinary is the binary to start as a sandbox's init.
func (r *Runtime) initBinary() string {
	p := filepath.Join(filepath.Dir(r.cfg.AgentBinary), InitBinaryName)
	if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o001 != 0 {
		return p
	}
	return r.cfg.AgentBinary
}

// checkAgent verifies that the agent binary can be executed by a sandbox's
// host uid through a descriptor (only the file's own mode matters).
func (r *Runtime) checkAgent() error {
	fi, err := os.Stat(r.cfg.AgentBinary)
	if err != nil {
		return fmt.Errorf("agent binary: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o001 == 0 {
		return fmt.Errorf("agent binary %s (mode %v) must be a regular file executable by others (the sandbox's uid)", r.cfg.AgentBinary, fi.Mode().Perm())
	}
	return nil
}
