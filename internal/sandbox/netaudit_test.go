package sandbox

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/store"
)

// lossyNetwork is a FakeNetwork whose event stream never shows the seqs in
// lost: what a follower sees of a gateway ring that evicted them before it
// read them.
type lossyNetwork struct {
	*FakeNetwork
	mu   sync.Mutex
	lost map[uint64]bool
}

func (n *lossyNetwork) Events(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	return n.FakeNetwork.Events(ctx, id, after, follow, func(ev api.NetworkEvent) error {
		n.mu.Lock()
		skip := n.lost[ev.Seq]
		n.mu.Unlock()
		if skip {
			return nil
		}
		return fn(ev)
	})
}

// netAuditManager is a Manager with only what network audit needs: a
// store, the network and a memory sink.
func netAuditManager(t *testing.T, netw Network) (*Manager, *audit.Memory) {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	rec := &audit.Memory{}
	m := New(Config{DB: db, Network: netw, Audit: rec, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	t.Cleanup(func() {
		m.Close()
		db.Close()
	})
	return m, rec
}

// networkRecords waits for n network records and returns them.
func networkRecords(t *testing.T, rec *audit.Memory, n int) []audit.Event {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var out []audit.Event
		for _, e := range rec.Events() {
			if e.Kind == audit.KindNetwork {
				out = append(out, e)
			}
		}
		if len(out) >= n {
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d network records, want %d: %+v", len(out), n, out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// shape is a record in short: "seq N" for an event, "lost A..B (N)" for a
// loss.
func shape(t *testing.T, e audit.Event) string {
	t.Helper()
	if e.Action != "events_lost" {
		return fmt.Sprintf("seq %v", e.Detail["link_seq"])
	}
	if !strings.HasPrefix(e.Result, "network events lost: ") || e.Detail["verdict"] != api.VerdictError {
		t.Errorf("loss record does not say so: %+v", e)
	}
	return fmt.Sprintf("lost %v..%v (%v)", e.Detail["first_seq"], e.Detail["link_seq"], e.Detail["lost"])
}

// TestNetAuditRecordsLostEvents: a follower that finds a gap in the link's
// numbering records the loss (how many, which link seqs) before the next
// event, whether the gap is in the middle, at the start of a new link's
// stream, or right where a resumed follower takes over; a stream without
// gaps records none.
func TestNetAuditRecordsLostEvents(t *testing.T) {
	cases := []struct {
		name  string
		after uint64
		lost  []uint64
		n     int // events pushed (seq 1..n)
		want  []string
	}{
		{"none", 0, nil, 3, []string{"seq 1", "seq 2", "seq 3"}},
		{"middle", 0, []uint64{2, 3, 6}, 7, []string{"seq 1", "lost 2..3 (2)", "seq 4", "seq 5", "lost 6..6 (1)", "seq 7"}},
		{"start of a new link", 0, []uint64{1, 2, 3}, 5, []string{"lost 1..3 (3)", "seq 4", "seq 5"}},
		{"resumed", 4, []uint64{5, 6}, 8, []string{"lost 5..6 (2)", "seq 7", "seq 8"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			netw := &lossyNetwork{FakeNetwork: NewFakeNetwork(), lost: map[uint64]bool{}}
			for _, s := range c.lost {
				netw.lost[s] = true
			}
			m, rec := netAuditManager(t, netw)
			const id = "sb-lossylossylos1"
			for i := range c.n {
				netw.Push(id, api.NetworkEvent{Time: time.Now().UTC(), Protocol: "dns", Name: fmt.Sprintf("n%d.example", i+1), Verdict: api.VerdictDeny})
			}
			m.net.followNetwork(id, c.after)
			networkRecords(t, rec, len(c.want)) // they come
			time.Sleep(50 * time.Millisecond)   // and nothing more does
			recs := networkRecords(t, rec, len(c.want))
			var got []string
			for _, e := range recs {
				got = append(got, shape(t, e))
				if e.Sandbox != id {
					t.Errorf("record of %q", e.Sandbox)
				}
			}
			if strings.Join(got, ", ") != strings.Join(c.want, ", ") {
				t.Fatalf("records %v, want %v", got, c.want)
			}
		})
	}
}
