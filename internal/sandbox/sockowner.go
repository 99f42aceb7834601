package sandbox

import (
	"context"
	"net/netip"

	"github.com/spacehq/space/internal/runtime"
)

// SocketOwner names the executable of sandbox id that holds the TCP
// connection local→remote (the sandbox's view: its address and port, the
// peer it dialled), where its runtime can see it from the host without
// trusting the sandbox (runtime.SocketOwner: native). It returns "" where
// the runtime cannot tell, the sandbox has no live instance here, or no
// process holds the socket (any more): the caller then knows nothing, and
// never fills the field from anything else.
func (part *Networking) SocketOwner(ctx context.Context, id string, local, remote netip.AddrPort) string {
	m := part.m
	e := m.peek(id)
	if e == nil {
		return ""
	}
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	so, ok := inst.(runtime.SocketOwner)
	if !ok || ctx.Err() != nil {
		return ""
	}
	exe, err := so.SocketOwner("tcp", local, remote)
	if err != nil {
		m.log.Debug("no executable for a connection", "sandbox", id, "local", local, "remote", remote, "err", err)
		return ""
	}
	return exe
}
