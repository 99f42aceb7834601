package sandbox

import (
	"context"
	"net"
	"os"

	"github.com/spacehq/space/api"
)

// Network is the manager's view of the network gateway: the process that
// serves every sandbox's virtual NIC and enforces its policy
// (internal/gateway; the real one is gwctl.Client, which implements this
// interface: this package imports nothing of the gateway).
type Network interface {
	// Attach hands the gateway one sandbox's NIC descriptor (the gateway
	// keeps its own copy; the caller may close nic) with the policy in
	// force. Attaching an id that is attached replaces its link.
	Attach(ctx context.Context, id string, nic *os.File, p api.NetworkPolicy) error
	// SetPolicy replaces the policy of an attached sandbox: new connections
	// see it at once, open ones it no longer allows are closed.
	SetPolicy(ctx context.Context, id string, p api.NetworkPolicy) error
	// Detach drops the sandbox's link and state. Idempotent.
	Detach(ctx context.Context, id string) error
	// Info returns the link's counters; ErrNotFound if id is not attached.
	Info(ctx context.Context, id string) (api.NetworkInfo, error)
	// Events calls fn for each recorded event with Seq > after, oldest
	// first; with follow it then waits for new ones until ctx ends or fn
	// returns an error.
	Events(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error
	// Attached lists the ids the gateway serves (reconcile re-attaches the
	// running sandboxes missing from it, after a gateway restart).
	Attached(ctx context.Context) ([]string, error)
	// DialSandbox opens a TCP connection to port on the sandbox's own
	// address, from the gateway's side of its link (ingress). The conn
	// supports CloseWrite. ErrNotFound if id is not attached;
	// ErrUnavailable if nothing listens on the port.
	DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error)
}
