package sandbox

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
)

// Network verdicts reach the audit log through one follower per attached
// link: a goroutine holding the gateway's event stream of that link
// (Network.Events with follow) and recording every event. It is started
// when the manager attaches a link (a new link numbers its events from 1)
// and ends by itself when the link closes (the gateway's ring drains to
// its end first) or the gateway goes away. After a server restart the
// links the gateway kept are followed again from the last link_seq the
// log holds for the sandbox (NetworkCursor), so nothing is recorded twice
// and what happened while the server was down is recorded late rather
// than lost (up to the gateway's 1024-event ring per link).
//
// Events the ring evicted before the follower read them leave a gap in the
// link's numbering; the follower records each gap as a loss record of its
// own ("network events lost: N (link_seq A..B)"), so the log says where it
// is incomplete. (The gateway evicts refusals before allow-class events and
// summarises refusals beyond its rate, so a gap holds only refusals unless
// the link made more than 1024 allow-class events the follower had not
// read yet.)

// networkCursor is the audit sink's resume point of a sandbox's link.
type networkCursor interface {
	NetworkCursor(ctx context.Context, sandbox string) (uint64, error)
}

type netFollower struct {
	last atomic.Uint64 // link seq of the last event recorded
	done chan struct{}
}

// followNetwork starts recording the verdicts of sandbox id's link from
// link seq after, replacing any follower of an older link (which ends by
// itself once that link's ring is drained).
func (part *Networking) followNetwork(id string, after uint64) {
	m := part.m
	if m.aud.auditOff() || m.cfg.Network == nil {
		return
	}
	f := &netFollower{done: make(chan struct{})}
	f.last.Store(after)
	tenant := m.aud.tenantOf(id)
	m.netAuditMu.Lock()
	if m.ctx.Err() != nil {
		m.netAuditMu.Unlock()
		return // closing: stopNetAudit is waiting
	}
	if m.netFollowers == nil {
		m.netFollowers = map[string]*netFollower{}
	}
	m.netFollowers[id] = f
	m.netWG.Add(1)
	m.netAuditMu.Unlock()
	go func() {
		defer m.netWG.Done()
		defer close(f.done)
		err := m.cfg.Network.Events(m.ctx, id, after, true, func(ev api.NetworkEvent) error {
			if last := f.last.Load(); ev.Seq > last+1 {
				m.cfg.Audit.Record(m.ctx, networkLoss(id, tenant, last+1, ev.Seq-1))
			}
			m.cfg.Audit.Record(m.ctx, networkEvent(id, tenant, ev))
			f.last.Store(ev.Seq)
			return nil
		})
		if err != nil && m.ctx.Err() == nil {
			m.log.Debug("network audit follower ended", "sandbox", id, "err", err)
		}
	}()
}

// followAttached resumes following the links the gateway serves that no
// live follower records (after a server restart, or a follower's stream
// broke while its link stayed). Called by reconcileNetwork.
func (part *Networking) followAttached(ctx context.Context, attached map[string]bool) {
	m := part.m
	if m.aud.auditOff() {
		return
	}
	// Forget the ended followers of links the gateway no longer serves.
	m.netAuditMu.Lock()
	for id, f := range m.netFollowers {
		select {
		case <-f.done:
			if !attached[id] {
				delete(m.netFollowers, id)
			}
		default:
		}
	}
	m.netAuditMu.Unlock()
	for id := range attached {
		// An operation attaching this sandbox right now starts its own
		// follower; leave it to it.
		e := m.entry(id)
		if !e.mu.TryLock() {
			continue
		}
		m.net.resumeFollower(ctx, id)
		e.mu.Unlock()
	}
}

// resumeFollower starts a follower of id's link unless a live one exists;
// the caller holds id's entry lock.
func (part *Networking) resumeFollower(ctx context.Context, id string) {
	m := part.m
	m.netAuditMu.Lock()
	f := m.netFollowers[id]
	m.netAuditMu.Unlock()
	var after uint64
	if f != nil {
		select {
		case <-f.done:
			after = f.last.Load()
		default:
			return // live
		}
	} else if c, ok := m.cfg.Audit.(networkCursor); ok {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		n, err := c.NetworkCursor(cctx, id)
		cancel()
		if err != nil {
			m.log.Warn("reading the audit log's network cursor", "sandbox", id, "err", err)
			return
		}
		after = n
	}
	m.net.followNetwork(id, after)
}

// networkEvent is the audit record of one gateway event.
func networkEvent(id, tenant string, ev api.NetworkEvent) audit.Event {
	target := ev.Name
	if ev.IP != "" {
		hp := ev.IP
		if ev.Port > 0 {
			hp = net.JoinHostPort(ev.IP, strconv.Itoa(ev.Port))
		}
		if target != "" {
			target += " " + hp
		} else {
			target = hp
		}
	}
	d := map[string]any{"protocol": ev.Protocol, "verdict": ev.Verdict, "link_seq": ev.Seq, "at": ev.Time}
	if ev.Name != "" {
		d["name"] = ev.Name
	}
	if ev.IP != "" {
		d["ip"] = ev.IP
	}
	if ev.Port > 0 {
		d["port"] = ev.Port
	}
	if ev.Reason != "" {
		d["reason"] = ev.Reason
	}
	if ev.BytesOut > 0 || ev.BytesIn > 0 {
		d["bytes_out"], d["bytes_in"] = ev.BytesOut, ev.BytesIn
	}
	if len(ev.Answers) > 0 {
		d["answers"] = ev.Answers
	}
	res := ev.Verdict
	if ev.Reason != "" && ev.Verdict != "allow" {
		res += ": " + ev.Reason
	}
	return audit.Event{Kind: audit.KindNetwork, Action: ev.Protocol, Sandbox: id, Target: target, Result: truncate(res, 256), Tenant: tenant, Detail: d}
}

// networkLoss is the audit record of the link's events from..to (link
// seq), which the gateway evicted before they were recorded. Its link_seq
// is to, so a follower resumed from the log's cursor after it goes on at
// the event that revealed the gap.
func networkLoss(id, tenant string, from, to uint64) audit.Event {
	n := to - from + 1
	res := fmt.Sprintf("network events lost: %d (link_seq %d..%d)", n, from, to)
	d := map[string]any{"protocol": "audit", "verdict": api.VerdictError, "reason": res,
		"lost": n, "first_seq": from, "link_seq": to}
	return audit.Event{Kind: audit.KindNetwork, Action: "events_lost", Sandbox: id, Result: res, Tenant: tenant, Detail: d}
}

// stopNetAudit waits for the followers to end (Close cancelled m.ctx,
// which ends their streams), so none records after the manager closed.
func (part *Networking) stopNetAudit() {
	m := part.m
	// Taking the lock orders this after any Add that saw m.ctx alive.
	m.netAuditMu.Lock()
	n := len(m.netFollowers)
	m.netAuditMu.Unlock()
	if n > 0 {
		m.netWG.Wait()
	}
}
