package sandbox

import (
	"context"
	"crypto/rand"
	"fmt"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// seedBytes is the size of the entropy the host hands a restored or forked
// agent (agentproto.Restored wants at least 32).
const seedBytes = 64

func suspender(sb api.Sandbox, inst runtime.Instance) (runtime.Suspender, error) {
	sp, ok := inst.(runtime.Suspender)
	if !ok {
		return nil, runtime.NotSupported(sb.Runtime, "suspend", "its instances cannot save their state")
	}
	return sp, nil
}

// doSuspend saves a running (or paused) sandbox to disk; the caller holds
// e.mu. The agent is quiesced first (runtimes may be unable to save its host
// connections); if the checkpoint fails the instance is still running, so
// the agent is reconnected and the sandbox stays running.
func (part *Verbs) doSuspend(ctx context.Context, p *phases, id string) error {
	m := part.m
	e := m.entry(id)
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	switch sb.State {
	case api.StateSuspended:
		return nil
	case api.StateRunning, api.StatePaused:
	default:
		return wrongState(id, sb.State, "suspend")
	}
	inst, _, err := m.verbs.instance(ctx, e, sb)
	if err != nil {
		return err
	}
	sp, err := suspender(sb, inst)
	if err != nil {
		return err
	}
	if sb.State == api.StatePaused {
		// A frozen agent cannot quiesce: thaw first. If the checkpoint
		// then fails the sandbox is left running, not paused again.
		pz, err := pauser(sb, inst)
		if err != nil {
			return err
		}
		if err := p.run("thaw", func() error { return pz.Resume(ctx) }); err != nil {
			return err
		}
		m.setState(id, api.StateRunning, "", "")
	}
	c, err := m.verbs.liveClient(ctx, p, e, inst)
	if err != nil {
		return err
	}
	if err := p.run("quiesce", func() error { return c.Quiesce(ctx) }); err != nil {
		// The client stays: if the agent dropped it after all, the next
		// request sees a dead session and re-dials.
		return fmt.Errorf("the sandbox's agent did not quiesce (the sandbox keeps running): %w", err)
	}
	m.verbs.dropClient(e)
	e.expectExit.Store(true)
	m.net.detachNetwork(id, "suspend")
	if err := p.run("checkpoint", func() error { return sp.Suspend(ctx) }); err != nil {
		e.expectExit.Store(false)
		if nerr := m.net.attachNetwork(ctx, p, inst, policyOf(sb)); nerr != nil {
			m.log.Warn("network link did not come back after a failed checkpoint; reconcile retries", "sandbox", id, "err", nerr)
		}
		if rerr := p.run("reconnect", func() error { return m.creates.connect(ctx, e, inst) }); rerr != nil {
			m.log.Warn("agent did not come back after a failed checkpoint; the next request re-dials", "sandbox", id, "err", rerr)
		}
		return fmt.Errorf("checkpoint failed (the sandbox keeps running): %w", err)
	}
	_, err = m.setState(id, api.StateSuspended, "", "")
	return err
}

// liveClient returns the sandbox's agent client, dialling (phase
// agent_ready) when there is none or its session died.
func (part *Verbs) liveClient(ctx context.Context, p *phases, e *entry, inst runtime.Instance) (*agentClient, error) {
	m := part.m
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c != nil {
		select {
		case <-c.Done():
		default:
			return c, nil
		}
	}
	if err := p.run("agent_ready", func() error { return m.creates.connect(ctx, e, inst) }); err != nil {
		return nil, err
	}
	e.cmu.RLock()
	defer e.cmu.RUnlock()
	return e.client, nil
}

// doRestore continues a suspended sandbox (restore, wake, start); the caller
// holds e.mu and has checked the state is suspended. On failure the sandbox
// stays suspended while its image exists, else it becomes stopped with the
// reason.
func (part *Verbs) doRestore(ctx context.Context, p *phases, e *entry, sb api.Sandbox) error {
	m := part.m
	inst, _, err := m.verbs.instance(ctx, e, sb)
	if err != nil {
		return err
	}
	sp, err := suspender(sb, inst)
	if err != nil {
		return err
	}
	// failed settles the record after a failed step: the image decides.
	failed := func(what string, err error) error {
		e.expectExit.Store(true)
		m.verbs.dropClient(e)
		if sp.Suspended() {
			m.setState(sb.ID, api.StateSuspended, what+": "+err.Error(), "")
			return fmt.Errorf("%s (the sandbox stays suspended): %w", what, err)
		}
		m.verbs.stopInstance(context.Background(), inst, "lost suspend image")
		m.cmds.markCommandsExited(sb.ID, "the sandbox's suspended image was lost")
		m.setState(sb.ID, api.StateStopped, what+" and the suspended image is gone: "+err.Error()+"; its disk is kept and start boots it afresh", "")
		return fmt.Errorf("%s; the suspended image is gone, the sandbox is stopped: %w", what, err)
	}
	if !sp.Suspended() {
		return failed("nothing to restore", fmt.Errorf("the runtime has no saved image of sandbox %s: %w", sb.ID, errdefs.ErrNotFound))
	}
	m.setState(sb.ID, api.StateStarting, "", "")
	e.expectExit.Store(false)
	if err := p.run("restore", func() error { return sp.Restore(ctx) }); err != nil {
		return failed("restore failed", err)
	}
	if err := m.net.attachNetwork(ctx, p, inst, policyOf(sb)); err != nil {
		return failed("the restored sandbox's network link failed", err)
	}
	if err := p.run("agent_ready", func() error { return m.creates.connect(ctx, e, inst) }); err != nil {
		return failed("the restored agent did not answer", err)
	}
	m.creates.watchExit(e, inst)
	e.lastActive.Store(time.Now().UnixNano())
	if _, err := m.secrets.secretsReady(ctx, p, e, sb); err != nil {
		// Its memory is worth more than its trust store: keep it running.
		m.log.Warn("installing the restored sandbox's CA failed", "sandbox", sb.ID, "err", err)
	}
	if err := p.run("reseed", func() error { return m.verbs.reseed(ctx, e, "") }); err != nil {
		// The same sandbox continues; only its entropy refresh failed.
		// Say so, but do not throw its memory away.
		m.setState(sb.ID, api.StateRunning, "", "")
		return fmt.Errorf("restored, but the agent refused the reseed: %w", err)
	}
	_, err = m.setState(sb.ID, api.StateRunning, "", "")
	return err
}

// reseed tells the agent of e it was restored or forked: fresh host entropy,
// the host clock, and (for a fork child) its new hostname.
func (part *Verbs) reseed(ctx context.Context, e *entry, hostname string) error {
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c == nil {
		return fmt.Errorf("no agent connection: %w", errdefs.ErrUnavailable)
	}
	seed := make([]byte, seedBytes)
	if _, err := rand.Read(seed); err != nil {
		return err
	}
	return c.Restored(ctx, agentproto.Restored{Seed: seed, Hostname: hostname, TimeUnixNano: time.Now().UnixNano()})
}
