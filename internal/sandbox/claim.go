package sandbox

import (
	"context"
	"fmt"
	"reflect"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
)

// claim tries to serve the create pl plans, whose record sb is built
// (everything but its id), from a warm pool. handled false: no pool
// matched or it had no member (a miss, counted) — the caller creates cold.
// A member whose record became the caller's is the caller's sandbox; its
// id is the member's, drawn by the same generator and never shown before.
func (part *WarmPools) claim(ctx context.Context, pl *createPlan, sb api.Sandbox) (_ api.Sandbox, op api.Operation, handled bool, err error) {
	m := part.m
	// Secrets and header rules need placeholders, a CA and a broker
	// config at create: such a create is served cold (DECISIONS.md). So is
	// one whose template is built on first need: no pool holds it yet.
	if pl.tmpl == nil || len(pl.req.Secrets) > 0 || len(sb.Network.Rules) > 0 || sb.Labels[BuildLabel] != "" {
		return sb, op, false, nil
	}
	p := m.pools.match(sb.TemplateDigest, sb.Runtime, sb.Limits)
	if p == nil {
		return sb, op, false, nil
	}
	mb, ok := m.pools.take(p)
	if !ok {
		m.pools.count(p, false)
		return sb, op, false, nil
	}
	sb.ID = mb.id
	op, written, err := m.creates.persist(ctx, &sb)
	if err != nil {
		if !written {
			m.pools.giveBack(p, mb)
		}
		return api.Sandbox{}, api.Operation{}, true, err
	}
	m.pools.count(p, true)
	start := pl.tmpl.Config.Start
	m.ops.start(op, func(ctx context.Context, ph *phases) error { return m.warm.doClaim(ctx, ph, sb.ID, mb, start) })
	return sb, op, true, nil
}

// doClaim personalises claimed member mb, whose record is now the
// caller's: resume, health, the caller's network policy, a fresh entropy
// seed and clock, then the template's start command with the caller's
// env. A member that fails before anything of the caller's ran in it is
// destroyed and the sandbox created cold under the same id.
func (part *WarmPools) doClaim(ctx context.Context, p *phases, id string, mb member, start *api.StartCommand) error {
	m := part.m
	e := m.entry(id)
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	err = p.run("claim_pool", func() error {
		if inst == nil || !inst.Alive() {
			return fmt.Errorf("pool member %s is not running", id)
		}
		if mb.paused {
			pz, ok := inst.(runtime.Pauser)
			if !ok {
				return fmt.Errorf("pool member %s is paused on a runtime without pause", id)
			}
			if err := pz.Resume(ctx); err != nil {
				return err
			}
			if err := m.creates.connect(ctx, e, inst); err != nil {
				return err
			}
		}
		// Made at background CPU weight; the caller's sandbox competes as
		// any other does.
		if fg, ok := inst.(runtime.Foregrounder); ok {
			if err := fg.Foreground(); err != nil {
				return fmt.Errorf("raising the pool member's CPU weight: %w", err)
			}
		}
		e.cmu.RLock()
		c := e.client
		e.cmu.RUnlock()
		if c == nil {
			return fmt.Errorf("pool member %s has no agent connection", id)
		}
		if m.cfg.Network != nil && !reflect.DeepEqual(policyOf(sb), ClonePolicy(m.cfg.DefaultNetwork)) {
			if _, ok := inst.(runtime.NICProvider); ok {
				if err := m.cfg.Network.SetPolicy(ctx, id, ClonePolicy(policyOf(sb))); err != nil {
					return fmt.Errorf("applying the sandbox's network policy: %w", err)
				}
			}
		}
		// Its own entropy and the clock, as a fork child gets (the
		// hostname is its id already: rewriting /etc/hostname would cost
		// a synced write). The answer is the member's health check.
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return m.verbs.reseed(rctx, e, "")
	})
	if err != nil {
		m.log.Warn("claimed pool member failed; creating the sandbox cold", "sandbox", id, "err", err)
		m.pools.recount(sb)
		e.expectExit.Store(true)
		m.verbs.dropClient(e)
		if inst != nil {
			m.verbs.destroyInstance(context.Background(), inst, "failed pool claim")
		}
		e.cmu.Lock()
		e.inst = nil
		e.cmu.Unlock()
		return m.creates.doCreate(ctx, p, id, false, nil)
	}
	if start != nil {
		e.cmu.RLock()
		c := e.client
		e.cmu.RUnlock()
		if err := m.cmds.startFromTemplate(ctx, p, c, sb, start); err != nil {
			m.verbs.dropClient(e)
			e.expectExit.Store(true)
			m.verbs.destroyInstance(context.Background(), inst, "failed create")
			m.setState(id, api.StateError, err.Error(), "")
			return err
		}
	}
	e.lastActive.Store(time.Now().UnixNano())
	_, err = m.setState(id, api.StateRunning, "", "")
	return err
}

// recount turns the hit counted for a claim whose member failed into a
// miss.
func (ps *pools) recount(sb api.Sandbox) {
	if p := ps.match(sb.TemplateDigest, sb.Runtime, sb.Limits); p != nil {
		ps.mu.Lock()
		p.hits--
		ps.mu.Unlock()
		ps.count(p, false)
	}
}
