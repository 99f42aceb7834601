package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
)

// Ingress: reaching a service that listens inside a sandbox. The bytes go
// through the sandbox's own NIC (Network.DialSandbox: the gateway dials
// the sandbox's address from its side of the link), so it works the same
// on every runtime and asks nothing of the agent.

// ValidPort checks a TCP port number given by a caller.
func ValidPort(port int) error {
	if port < 1 || port > 65535 {
		return fmt.Errorf("port must be 1..65535, got %d: %w", port, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Hold makes sure sandbox id is running — waking it, as exec does, when it
// is paused, stopped or suspended — and counts it as active (its idle
// policy waits) until release is called.
func (m *Manager) Hold(ctx context.Context, id string) (release func(), err error) {
	_, _, release, err = m.agent(ctx, id)
	return release, err
}

// DialPort opens a TCP connection to port of sandbox id: the policy
// decides it (a port action) before anything else, then it wakes the
// sandbox if needed and dials through its network link. Every way in to a
// sandbox's port (the host-routed and path-routed proxies, the raw tunnel,
// port-forward) comes through here, so this is where port ingress is
// decided: once per connection to the sandbox (the proxies keep idle
// upstream connections up to 30 s). The sandbox counts as active while
// the connection is open. A port nothing listens on is ErrUnavailable.
func (part *Networking) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	m := part.m
	if err := ValidPort(port); err != nil {
		return nil, err
	}
	if err := ValidID(id); err != nil {
		return nil, err
	}
	if m.cfg.Network == nil {
		return nil, fmt.Errorf("this server runs no network gateway, so sandbox ports cannot be reached: %w", errdefs.ErrUnavailable)
	}
	if err := m.Decide(ctx, id, actions.Action{Kind: actions.Port, Port: port}); err != nil {
		return nil, err
	}
	release, err := m.Hold(ctx, id)
	if err != nil {
		return nil, err
	}
	c, err := m.cfg.Network.DialSandbox(ctx, id, uint16(port))
	if err != nil {
		release()
		if errors.Is(err, errdefs.ErrNotFound) {
			// The sandbox exists (Hold found it): it is its link that is
			// missing (no NIC on this runtime, or a gateway restarting).
			return nil, fmt.Errorf("sandbox %s has no network link (yet): %v: %w", id, err, errdefs.ErrUnavailable)
		}
		return nil, err
	}
	return &heldConn{Conn: c, release: release}, nil
}

// heldConn releases its sandbox's activity hold when closed.
type heldConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *heldConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// CloseWrite half-closes the connection (the sandbox reads EOF).
func (c *heldConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// SetPortPublic records whether port of sandbox id is public (reachable
// through the server without the sandbox's access token) and returns the
// sandbox as stored. Making a port public is a port action the policy
// decides (so a refused port fails here, not only at its first
// connection); making it private again is not.
func (part *Networking) SetPortPublic(ctx context.Context, id string, port int, public bool) (api.Sandbox, error) {
	m := part.m
	if err := ValidPort(port); err != nil {
		return api.Sandbox{}, err
	}
	if err := ValidID(id); err != nil {
		return api.Sandbox{}, err
	}
	if public {
		if err := m.Decide(ctx, id, actions.Action{Kind: actions.Port, Port: port}); err != nil {
			return api.Sandbox{}, err
		}
	}
	return m.updateRecord(ctx, id, "change the ports of", func(sb *api.Sandbox) (bool, error) {
		if slices.Contains(sb.PublicPorts, port) == public {
			return false, nil
		}
		if public {
			sb.PublicPorts = append(slices.Clone(sb.PublicPorts), port)
			slices.Sort(sb.PublicPorts)
		} else {
			sb.PublicPorts = slices.DeleteFunc(slices.Clone(sb.PublicPorts), func(p int) bool { return p == port })
			if len(sb.PublicPorts) == 0 {
				sb.PublicPorts = nil
			}
		}
		return true, nil
	}, nil)
}
