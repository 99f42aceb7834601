package gateway

import (
	"context"
	"sync"
	"time"

	"github.com/spacehq/space/api"
)

// ringSize bounds the events a link keeps; older ones are dropped (and
// counted) so a sandbox that floods attempts costs the gateway nothing more.
const ringSize = 1024

// eventRing is a bounded ring of one link's events with wake-ups for
// followers.
type eventRing struct {
	mu      sync.Mutex
	buf     []api.NetworkEvent // len ≤ ringSize, oldest first
	seq     uint64
	dropped int64
	verdict map[string]int64
	changed chan struct{} // closed and replaced on every append
	closed  bool
	onAdd   func(api.NetworkEvent) // the gateway's counters
}

func newEventRing(onAdd func(api.NetworkEvent)) *eventRing {
	return &eventRing{verdict: map[string]int64{}, changed: make(chan struct{}), onAdd: onAdd}
}

func (r *eventRing) add(ev api.NetworkEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.seq++
	ev.Seq = r.seq
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	r.verdict[ev.Verdict]++
	if r.onAdd != nil {
		r.onAdd(ev)
	}
	if len(r.buf) == ringSize {
		copy(r.buf, r.buf[1:])
		r.buf = r.buf[:ringSize-1]
		r.dropped++
	}
	r.buf = append(r.buf, ev)
	close(r.changed)
	r.changed = make(chan struct{})
}

// close wakes every follower for the last time.
func (r *eventRing) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.closed = true
		close(r.changed)
	}
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
// waiting for new ones until ctx ends, the ring closes or fn fails.
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
