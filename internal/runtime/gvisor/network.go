package gvisor

import (
	"context"
	"fmt"
	"os"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

// The sandbox's NIC under gVisor.
//
// Each start (and restore, and fork child) gets a network namespace of its
// own, made by the runtime and pinned by a bind mount on <dir>/netns, with
// the TAP eth0 in it configured by hostnet.CreateTAP. The OCI bundle names
// that namespace, and runsc (--network=sandbox) starts the sentry in it and
// scrapes it (runsc/sandbox/network.go, createInterfacesAndRoutesFromNS):
// every link that is up and has an address becomes a link of the sentry's
// netstack with the same MAC, MTU, addresses, routes and default gateway;
// runsc then deletes the addresses from the kernel's device (so the
// namespace's kernel never answers for the sandbox) and hands the sentry an
// AF_PACKET socket bound to the device (ETH_P_ALL). What the sentry sends
// on that socket is transmitted by the TAP, i.e. read on the TAP's
// descriptor; what is written on the descriptor is received by the device
// and seen by the packet socket. The loopback link is copied only if it
// is up, which CreateTAP does too.
//
// So NIC only attaches (hostnet.OpenTAP): putting the addresses back on
// the device would make the kernel a second stack on the link. The
// namespace dies with the sandbox: Stop unmounts the pin (hostfs.UnmountAll
// over the instance directory, as Sweep's Destroy does) and the sentry, the
// last process in it, is gone; a TAP descriptor the gateway still holds
// keeps it until closed.

// prepareNIC makes a fresh namespace with the configured TAP at p (the
// netnsPath of sandbox id), replacing whatever a previous start left there.
func prepareNIC(p, id string) error {
	if err := hostnet.RemoveNetNS(p); err != nil {
		return err
	}
	if err := hostnet.NewNetNS(p); err != nil {
		return fmt.Errorf("sandbox %s: %w", id, err)
	}
	tap, err := hostnet.CreateTAP(p)
	if err != nil {
		return fmt.Errorf("sandbox %s NIC: %w", id, err)
	}
	// The device is persistent: it stays, unattached, for runsc to find
	// and for NIC to attach to.
	return tap.Close()
}

// NIC implements runtime.NICProvider: a new descriptor of the TAP in the
// sandbox's namespace, without touching its configuration (the sentry's
// stack owns the addresses).
func (i *instance) NIC(ctx context.Context) (*os.File, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.aliveLocked() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	return hostnet.OpenTAP(i.files.netnsPath())
}
