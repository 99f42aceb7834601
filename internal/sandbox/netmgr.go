package sandbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/store"
)

// How the manager drives the network gateway (Config.Network):
//
//   - the policy in force is resolved once, at create (the request's, else
//     the template's, else Config.DefaultNetwork), and kept in the sandbox
//     record (api.Sandbox.Network); SetNetwork replaces it;
//   - every time an instance that has a NIC (runtime.NICProvider) starts
//     running — boot, restore, fork child — attachNetwork hands its NIC to
//     the gateway (phase "network"); failing that fails the step;
//   - before an instance stops, suspends or is destroyed, detachNetwork
//     drops its link (errors are logged: the link dies with the NIC anyway);
//   - reconcileNetwork (on start and every netReconcileEvery) re-attaches
//     running sandboxes the gateway does not serve (a restarted gateway)
//     and detaches what it serves that is no longer running.
//
// A nil Config.Network disables networking: sandboxes get no link.

// netReconcileEvery is how often Run compares the gateway's links with the
// running sandboxes.
const netReconcileEvery = 5 * time.Second

// ClonePolicy returns a deep copy of p (no slice or map shared with p).
func ClonePolicy(p api.NetworkPolicy) api.NetworkPolicy {
	out := p
	out.AllowOut = slices.Clone(p.AllowOut)
	out.DenyOut = slices.Clone(p.DenyOut)
	out.AllowPrivate = slices.Clone(p.AllowPrivate)
	if p.Rules != nil {
		out.Rules = make([]api.HeaderRule, len(p.Rules))
		for i, r := range p.Rules {
			out.Rules[i] = api.HeaderRule{Domain: r.Domain, SetHeaders: maps.Clone(r.SetHeaders), RemoveHeaders: slices.Clone(r.RemoveHeaders)}
		}
	}
	return out
}

// validateNetwork is netpolicy.Validate (a variable for tests).
var validateNetwork = netpolicy.Validate

// validatePolicy checks p; its error wraps ErrInvalidArgument and names
// the field ("network.allow_out[2]: …").
func validatePolicy(p api.NetworkPolicy) error {
	if err := validateNetwork(p); err != nil {
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			err = fmt.Errorf("network: %w: %w", err, errdefs.ErrInvalidArgument)
		}
		return err
	}
	return nil
}

// policyOf is the policy in force for sb. A record without one predates
// networking: it gets none (no egress).
func policyOf(sb api.Sandbox) api.NetworkPolicy {
	if sb.Network == nil {
		return api.NetworkPolicy{}
	}
	return ClonePolicy(*sb.Network)
}

// linked reports whether a sandbox in state has a live instance that may
// hold a link (paused instances keep theirs).
func linked(state string) bool {
	return state == api.StateRunning || state == api.StatePaused
}

// attachNetwork gives the gateway the NIC of inst, which has just started
// running, with policy p (phase "network"). Nothing to do without a
// gateway or for an instance without a NIC.
func (part *Networking) attachNetwork(ctx context.Context, p *phases, inst runtime.Instance, pol api.NetworkPolicy) error {
	m := part.m
	if m.cfg.Network == nil {
		return nil
	}
	if _, ok := inst.(runtime.NICProvider); !ok {
		return nil
	}
	return p.run("network", func() error { return m.net.attachNIC(ctx, inst, pol) })
}

func (part *Networking) attachNIC(ctx context.Context, inst runtime.Instance, pol api.NetworkPolicy) error {
	m := part.m
	np, ok := inst.(runtime.NICProvider)
	if !ok || m.cfg.Network == nil {
		return nil
	}
	nic, err := np.NIC(ctx)
	if err != nil {
		return fmt.Errorf("opening the sandbox's network interface: %w", err)
	}
	defer nic.Close()
	if err := m.cfg.Network.Attach(ctx, inst.ID(), nic, pol); err != nil {
		return fmt.Errorf("attaching the sandbox to the network gateway: %w", err)
	}
	m.net.followNetwork(inst.ID(), 0)
	return m.secrets.brokerAtAttach(ctx, inst.ID(), pol)
}

// detachNetwork drops sandbox id's link. A failure is logged: the link
// goes with the NIC when the instance stops, and reconcile detaches what
// is left.
func (part *Networking) detachNetwork(id, during string) {
	m := part.m
	if m.cfg.Network == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// What the link counted outlives it (the gateway forgets at Detach).
	if gi, err := m.cfg.Network.Info(ctx, id); err == nil {
		sum := api.NetworkSummary{EndedAt: time.Now().UTC(), During: during, Stats: gi.Stats}
		if err := m.cfg.DB.AddNetworkSummary(ctx, id, sum); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			m.log.Warn("recording a network summary failed", "sandbox", id, "err", err)
		}
	}
	if err := m.cfg.Network.Detach(ctx, id); err != nil {
		m.log.Warn("detaching sandbox from the network gateway failed; reconcile will retry", "sandbox", id, "during", during, "err", err)
	}
}

// reconcileNetwork makes the gateway's links match the running sandboxes:
// a running (or paused) sandbox it does not serve is attached again with
// its policy (a restarted gateway gets its links back this way), and an id
// it serves that is not running is detached. A sandbox an operation holds
// is left to that operation.
func (part *Networking) reconcileNetwork(ctx context.Context) {
	m := part.m
	if m.cfg.Network == nil {
		return
	}
	ids, err := m.cfg.Network.Attached(ctx)
	if err != nil {
		m.log.Warn("listing the network gateway's links failed", "err", err)
		return
	}
	attached := map[string]bool{}
	for _, id := range ids {
		attached[id] = true
	}
	m.net.followAttached(ctx, attached)
	sbs, err := m.cfg.DB.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		m.log.Warn("reconciling network links: listing sandboxes", "err", err)
		return
	}
	known := map[string]bool{}
	for _, sb := range sbs {
		known[sb.ID] = true
		if attached[sb.ID] == linked(sb.State) {
			continue
		}
		m.net.reconcileLink(ctx, sb.ID, attached[sb.ID])
	}
	for _, id := range ids {
		if !known[id] && !m.recon.stillKnown(ctx, id) {
			m.log.Info("detaching a network link no sandbox owns", "sandbox", id)
			m.net.detachNetwork(id, "reconcile of an unknown sandbox")
		}
	}
}

// reconcileLink re-checks one sandbox under its lock and attaches or
// detaches it. Skipped while an operation holds the sandbox. isAttached
// may be stale by an operation that ran meanwhile; acting on it then is
// harmless (an attach replaces a link, a detach is idempotent).
func (part *Networking) reconcileLink(ctx context.Context, id string, isAttached bool) {
	m := part.m
	e := m.entry(id)
	if !e.mu.TryLock() {
		return
	}
	defer e.mu.Unlock()
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		m.net.detachNetwork(id, "reconcile of a deleted sandbox")
		return
	}
	if err != nil {
		return
	}
	switch {
	case linked(sb.State) && !isAttached:
		inst, _, err := m.verbs.instance(ctx, e, sb)
		if err != nil || !inst.Alive() {
			return // the exit watcher or the next reconcile settles it
		}
		if _, ok := inst.(runtime.NICProvider); !ok {
			return
		}
		if err := m.net.attachNIC(ctx, inst, policyOf(sb)); err != nil {
			m.log.Warn("re-attaching a running sandbox to the network gateway failed; will retry", "sandbox", id, "err", err)
			return
		}
		m.log.Info("re-attached a running sandbox to the network gateway", "sandbox", id)
	case !linked(sb.State) && isAttached:
		m.log.Info("detaching the network link of a sandbox that is not running", "sandbox", id, "state", sb.State)
		m.net.detachNetwork(id, "reconcile of a sandbox that is not running")
	}
}

// SetNetwork replaces the network policy of sandbox id: it is validated,
// stored with the sandbox, and applied to its live link at once (new
// connections see it, open ones it no longer allows are closed). A stopped
// or suspended sandbox gets it when it next runs.
func (part *Networking) SetNetwork(ctx context.Context, id string, p api.NetworkPolicy) (api.Sandbox, error) {
	m := part.m
	if err := ValidID(id); err != nil {
		return api.Sandbox{}, err
	}
	if err := validatePolicy(p); err != nil {
		return api.Sandbox{}, err
	}
	if err := m.secrets.checkPolicySecrets(ctx, id, p); err != nil {
		return api.Sandbox{}, err
	}
	if _, err := m.Get(ctx, id); err != nil {
		return api.Sandbox{}, err
	}
	// Under the sandbox's lock, so a start in flight attaches either the
	// old policy before this or the new one after it, never loses it.
	return m.updateRecord(ctx, id, "change the network policy of", func(sb *api.Sandbox) (bool, error) {
		if err := m.tenancy.bound(ctx, TenantOf(*sb), p); err != nil {
			return false, err
		}
		p = ClonePolicy(p)
		sb.Network = &p
		return true, nil
	}, func(e *entry, sb api.Sandbox) error {
		return m.net.applyNetwork(ctx, e, sb, p)
	})
}

// applyNetwork applies policy p, just stored for sb, to its live link;
// the caller holds the sandbox's lock.
func (part *Networking) applyNetwork(ctx context.Context, e *entry, sb api.Sandbox, p api.NetworkPolicy) error {
	m := part.m
	if m.cfg.Network == nil || !linked(sb.State) {
		return nil
	}
	err := m.cfg.Network.SetPolicy(ctx, sb.ID, ClonePolicy(p))
	if err == nil {
		// Header rules may name secrets and add intercepted domains.
		if berr := m.secrets.secretsChanged(ctx, e, sb); berr != nil {
			m.log.Warn("updating the sandbox's brokered secrets after a policy change failed", "sandbox", sb.ID, "err", berr)
		}
	}
	switch {
	case err == nil, errors.Is(err, errdefs.ErrNotFound):
		// Not attached (no NIC, or a restarted gateway): the next attach
		// reads the stored policy.
		return nil
	default:
		// Fail closed: the old policy must not stay in force. Without a
		// link the sandbox reaches nothing until reconcile re-attaches it
		// with the stored policy.
		m.net.detachNetwork(sb.ID, "a policy update the gateway refused")
		return fmt.Errorf("the policy of sandbox %s is stored but the network gateway did not apply it (%v); its link was dropped and is re-attached with the new policy: %w",
			sb.ID, err, errdefs.ErrUnavailable)
	}
}

// NetworkInfo returns the policy in force for sandbox id and, while it is
// attached, its link's addresses and counters.
func (part *Networking) NetworkInfo(ctx context.Context, id string) (api.NetworkInfo, error) {
	m := part.m
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.NetworkInfo{}, err
	}
	info := api.NetworkInfo{Policy: policyOf(sb)}
	if info.History, err = m.cfg.DB.NetworkSummaries(ctx, id, 20); err != nil {
		return api.NetworkInfo{}, err
	}
	if m.cfg.Network == nil {
		return info, nil
	}
	info.Address, info.Gateway = hostnet.SandboxAddr, hostnet.GatewayAddr
	if !linked(sb.State) {
		return info, nil
	}
	gi, err := m.cfg.Network.Info(ctx, id)
	switch {
	case err == nil:
		info.Stats, info.Attached = gi.Stats, true
	case errors.Is(err, errdefs.ErrNotFound), errors.Is(err, errdefs.ErrUnavailable):
		// Not attached, or the gateway is restarting: Attached says so.
	default:
		return api.NetworkInfo{}, err
	}
	return info, nil
}

// NetworkEvents calls fn for each recorded network event of sandbox id with
// Seq > after, oldest first; with follow it then waits for new ones until
// ctx ends or fn fails. A sandbox without a link has no events.
func (part *Networking) NetworkEvents(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	m := part.m
	if _, err := m.Get(ctx, id); err != nil {
		return err
	}
	if m.cfg.Network == nil {
		return nil
	}
	err := m.cfg.Network.Events(ctx, id, after, follow, fn)
	if errors.Is(err, errdefs.ErrNotFound) || (err != nil && ctx.Err() != nil) {
		return nil
	}
	return err
}

// NetworkRestarted tells the manager the gateway was replaced (it lost every
// link): the running sandboxes are re-attached at once instead of at the
// next reconcile round.
func (part *Networking) NetworkRestarted() {
	m := part.m
	select {
	case m.netKick <- struct{}{}:
	default:
	}
}

// ValidatePolicy checks p as a sandbox's policy would be checked (tenant
// boundaries are policies too).
func ValidatePolicy(p api.NetworkPolicy) error { return validatePolicy(p) }
