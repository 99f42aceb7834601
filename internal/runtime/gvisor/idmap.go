package gvisor

import (
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// Inside gVisor the agent runs in a user namespace of its own (package
// ginit) where root is uid confine.IDBase of the sentry, and through the
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
	return hostfs.OpenUserns([]string{agent, hostfs.HoldArg}, []string{},
		hostfs.IDMap{HostID: confine.IDBase, Size: confine.IDSize})
}

// mountIDMapped attaches at dst a read-only, id-mapped (per userns) view of
// the tree at src and everything mounted below it.
func mountIDMapped(src, dst string, userns int) error {
	return hostfs.MountIDMapped(src, dst, userns)
}
