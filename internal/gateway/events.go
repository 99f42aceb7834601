package gateway

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/spacehq/space/api"
)

// How a link's events survive a sandbox that floods denials (so that it
// cannot erase its own trail):
//
//   - the ring keeps the last ringSize events; when it is full the oldest
//     denial (verdict deny, limit or drop) goes first, and an allow-class
//     event (allow, error, a summary) only when nothing else is left;
//   - denials are kept one by one up to denialRate a second (burst
//     denialBurst) per link; the rest are counted by protocol, verdict and
//     reason and reported by one summary event (protocol "summary",
//     verdict "limit") at most once a second — at the first event a second
//     after the first uncounted one, or from a timer, and when the link
//     closes — so a flood costs at most ~51 events a second;
//   - every event counts in the verdict counters (Info, the gateway's
//     counters), kept one by one or not; summaries do not;
//   - an event evicted from the ring is lost (dropped counts them); a
//     follower sees the gap in Seq (the audit follower records it).
const (
	// ringSize bounds the events a link keeps.
	ringSize = 1024
	// denialRate and denialBurst bound the denials a link keeps one by
	// one.
	denialRate  = 50
	denialBurst = 100
	// summaryEvery is how often, at most, the uncounted denials are
	// reported.
	summaryEvery = time.Second
	// summaryKeys bounds the (protocol, verdict, reason) kinds counted
	// between two summaries; the rest count under "other".
	summaryKeys = 32
	// summaryProtocol is the protocol of a summary event.
	summaryProtocol = "summary"
)

// eventRing is a bounded ring of one link's events with wake-ups for
// followers.
type eventRing struct {
	mu      sync.Mutex
	buf     []api.NetworkEvent // len ≤ ringSize, oldest first
	seq     uint64
	dropped int64 // events evicted from the ring: lost
	verdict map[string]int64
	changed chan struct{} // closed and replaced on every append
	closed  bool
	onAdd   func(api.NetworkEvent) // the gateway's counters

	denials *rate.Limiter
	every   time.Duration    // summaryEvery (tests shorten it)
	now     func() time.Time // time.Now (tests set the clock)
	// The denials not kept one by one since the last summary: how many,
	// by kind, since when (first); timer reports them if no event comes.
	uncounted int64
	byKind    map[string]int64
	first     time.Time
	timer     *time.Timer
}

func newEventRing(onAdd func(api.NetworkEvent)) *eventRing {
	return &eventRing{verdict: map[string]int64{}, changed: make(chan struct{}), onAdd: onAdd,
		denials: rate.NewLimiter(denialRate, denialBurst), every: summaryEvery, now: time.Now, byKind: map[string]int64{}}
}

// denial says whether ev is of the class that may be aggregated and is
// evicted first: a refusal (deny, limit, drop), not a summary.
func denial(ev api.NetworkEvent) bool {
	switch ev.Verdict {
	case api.VerdictDeny, api.VerdictLimit, api.VerdictDrop:
		return ev.Protocol != summaryProtocol
	}
	return false
}

func (r *eventRing) add(ev api.NetworkEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	now := r.now()
	if ev.Time.IsZero() {
		ev.Time = now.UTC()
	}
	r.countLocked(ev)
	keep := !denial(ev) || r.denials.AllowN(now, 1)
	if !keep {
		r.uncountLocked(ev, now)
	}
	if r.uncounted > 0 && now.Sub(r.first) >= r.every {
		r.summaryLocked(now)
	}
	if keep {
		r.appendLocked(ev)
	}
}

// aggregate records ev as a denial not kept one by one (a caller's own
// rate bound refused it): counted, and reported by the next summary.
func (r *eventRing) aggregate(ev api.NetworkEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	now := r.now()
	r.countLocked(ev)
	r.uncountLocked(ev, now)
	if now.Sub(r.first) >= r.every {
		r.summaryLocked(now)
	}
}

func (r *eventRing) countLocked(ev api.NetworkEvent) {
	r.verdict[ev.Verdict]++
	if r.onAdd != nil {
		r.onAdd(ev)
	}
}

// uncountLocked counts ev towards the next summary and makes sure one
// comes within r.every.
func (r *eventRing) uncountLocked(ev api.NetworkEvent, now time.Time) {
	if r.uncounted == 0 {
		r.first = now
		if r.timer == nil {
			r.timer = time.AfterFunc(r.every, r.tick)
		} else {
			r.timer.Reset(r.every)
		}
	}
	r.uncounted++
	reason := ev.Reason
	if len(reason) > 80 {
		reason = reason[:80] + "…"
	}
	kind := ev.Protocol + " " + ev.Verdict + " (" + reason + ")"
	if _, ok := r.byKind[kind]; !ok && len(r.byKind) >= summaryKeys {
		kind = "other"
	}
	r.byKind[kind]++
}

// tick is the timer's summary: the uncounted denials are reported even if
// no other event comes.
func (r *eventRing) tick() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.uncounted == 0 {
		return
	}
	now := r.now()
	if wait := r.every - now.Sub(r.first); wait > 0 {
		r.timer.Reset(wait)
		return
	}
	r.summaryLocked(now)
}

// summaryLocked appends the summary of the uncounted denials.
func (r *eventRing) summaryLocked(now time.Time) {
	kinds := make([]string, 0, len(r.byKind))
	for k := range r.byKind {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool {
		if a, b := r.byKind[kinds[i]], r.byKind[kinds[j]]; a != b {
			return a > b
		}
		return kinds[i] < kinds[j]
	})
	var top []string
	for i, k := range kinds {
		if i == 5 {
			top = append(top, fmt.Sprintf("%d more kinds", len(kinds)-i))
			break
		}
		top = append(top, fmt.Sprintf("%s ×%d", k, r.byKind[k]))
	}
	ev := api.NetworkEvent{Time: now.UTC(), Protocol: summaryProtocol, Verdict: api.VerdictLimit,
		Reason: fmt.Sprintf("%d further denials not recorded individually since %s: %s",
			r.uncounted, r.first.UTC().Format(time.RFC3339Nano), strings.Join(top, ", "))}
	r.uncounted = 0
	clear(r.byKind)
	r.appendLocked(ev)
}

// appendLocked numbers ev and appends it, evicting one event if the ring
// is full: the oldest denial, else the oldest event.
func (r *eventRing) appendLocked(ev api.NetworkEvent) {
	r.seq++
	ev.Seq = r.seq
	if len(r.buf) == ringSize {
		victim := 0
		for i := range r.buf {
			if denial(r.buf[i]) {
				victim = i
				break
			}
		}
		copy(r.buf[victim:], r.buf[victim+1:])
		r.buf = r.buf[:ringSize-1]
		r.dropped++
	}
	r.buf = append(r.buf, ev)
	close(r.changed)
	r.changed = make(chan struct{})
}

// close reports what is still uncounted and wakes every follower for the
// last time.
func (r *eventRing) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	if r.uncounted > 0 {
		r.summaryLocked(r.now())
	}
	if r.timer != nil {
		r.timer.Stop()
	}
	r.closed = true
	close(r.changed)
}

func (r *eventRing) counts() (map[string]int64, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := make(map[string]int64, len(r.verdict))
	for k, v := range r.verdict {
		m[k] = v
	}
	return m, r.dropped
}

// since returns the events with Seq > after, a channel closed at the next
// append, and whether the ring is closed.
func (r *eventRing) since(after uint64) ([]api.NetworkEvent, <-chan struct{}, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []api.NetworkEvent
	for i := range r.buf {
		if r.buf[i].Seq > after {
			out = append(out, r.buf[i:]...)
			break
		}
	}
	return out, r.changed, r.closed
}

// follow calls fn for every event after `after`; with follow it keeps
// waiting for new ones until ctx ends, the ring closes or fn fails. Seq
// has gaps where events were evicted before they were read.
func (r *eventRing) follow(ctx context.Context, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	for {
		evs, changed, closed := r.since(after)
		for _, ev := range evs {
			if err := fn(ev); err != nil {
				return err
			}
			after = ev.Seq
		}
		if !follow || closed {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}
