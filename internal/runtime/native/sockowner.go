package native

import (
	"fmt"
	"net/netip"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostproc"
)

var _ runtime.SocketOwner = (*instance)(nil)

// SocketOwner implements runtime.SocketOwner from the host's side: the
// socket in the init's network namespace's table, its holder among the
// processes of the sandbox's cgroup (which code in the sandbox cannot
// leave: it has no cgroup filesystem to write), the holder's /proc exe
// link. The path is the one the kernel executed, as it reads in the
// sandbox's filesystem, which the sandbox's own root can arrange (a
// binary copied to any path it may write) — it names the file that ran,
// not its provenance.
func (i *instance) SocketOwner(proto string, local, remote netip.AddrPort) (string, error) {
	pid := i.Pid()
	if pid == 0 || !i.Alive() {
		return "", fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	pids, err := i.cg.Procs()
	if err != nil {
		return "", fmt.Errorf("sandbox %s processes: %w", i.spec.ID, err)
	}
	exe, err := hostproc.SocketOwner(pid, pids, proto, local, remote)
	if err != nil {
		return "", err
	}
	// Still the same init after the reads: the pid named this sandbox.
	if !i.Alive() {
		return "", fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	return exe, nil
}
