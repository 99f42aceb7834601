package gateway

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
)

func ringEvents(r *eventRing) []api.NetworkEvent {
	var out []api.NetworkEvent
	_ = r.follow(context.Background(), 0, false, func(ev api.NetworkEvent) error {
		out = append(out, ev)
		return nil
	})
	return out
}

func hasSeq(evs []api.NetworkEvent, seq uint64) bool {
	for _, ev := range evs {
		if ev.Seq == seq {
			return true
		}
	}
	return false
}

// TestEventRingEvictsDenialsFirst: a full ring makes room by evicting its
// oldest denial; an allow-class event goes only when nothing else is left.
// Every eviction counts as dropped.
func TestEventRingEvictsDenialsFirst(t *testing.T) {
	r := newEventRing(nil)
	r.denials = rate.NewLimiter(rate.Inf, 1)                                                           // eviction alone
	r.add(api.NetworkEvent{Protocol: "tcp", Verdict: api.VerdictAllow})                                // seq 1
	r.add(api.NetworkEvent{Protocol: "tcp", Verdict: api.VerdictError})                                // seq 2
	r.add(api.NetworkEvent{Protocol: summaryProtocol, Verdict: api.VerdictLimit, Reason: "n further"}) // seq 3
	for range ringSize - 3 {
		r.add(api.NetworkEvent{Protocol: "dns", Verdict: api.VerdictDeny}) // seq 4..1024
	}
	r.add(api.NetworkEvent{Protocol: "dns", Verdict: api.VerdictAllow}) // seq 1025
	evs := ringEvents(r)
	if len(evs) != ringSize || !hasSeq(evs, 1) || !hasSeq(evs, 2) || !hasSeq(evs, 3) || hasSeq(evs, 4) || !hasSeq(evs, 5) || !hasSeq(evs, 1025) {
		t.Fatalf("after one eviction: %d events, first %+v", len(evs), evs[:4])
	}
	for i := 1; i < len(evs); i++ {
		if evs[i].Seq <= evs[i-1].Seq {
			t.Fatalf("out of order at %d: %d after %d", i, evs[i].Seq, evs[i-1].Seq)
		}
	}
	// Denials keep going first while any is left.
	for range ringSize - 4 {
		r.add(api.NetworkEvent{Protocol: "tcp", Verdict: api.VerdictAllow})
	}
	evs = ringEvents(r)
	for _, ev := range evs {
		if denial(ev) {
			t.Fatalf("a denial survived while allow-class events were added: %+v", ev)
		}
	}
	if !hasSeq(evs, 1) || !hasSeq(evs, 2) || !hasSeq(evs, 3) {
		t.Fatal("an allow-class event was evicted while denials were left")
	}
	// Nothing but allow-class: the oldest goes. Then the one denial goes
	// first, newest as it is.
	r.add(api.NetworkEvent{Protocol: "udp", Verdict: api.VerdictDrop})
	drop := r.seq
	evs = ringEvents(r)
	if hasSeq(evs, 1) || !hasSeq(evs, 2) || !hasSeq(evs, drop) || len(evs) != ringSize {
		t.Fatalf("all allow-class: oldest not evicted (first %+v)", evs[0])
	}
	r.add(api.NetworkEvent{Protocol: "tcp", Verdict: api.VerdictAllow})
	evs = ringEvents(r)
	if hasSeq(evs, drop) || !hasSeq(evs, 2) {
		t.Fatal("an allow-class event was evicted while a denial was left")
	}
	_, dropped := r.counts()
	if want := int64(r.seq) - ringSize; dropped != want {
		t.Fatalf("dropped %d, want %d", dropped, want)
	}
}

// summed is the number of denials the summaries in evs report.
func summed(t *testing.T, evs []api.NetworkEvent) (n int64, summaries int) {
	t.Helper()
	for _, ev := range evs {
		if ev.Protocol != summaryProtocol {
			continue
		}
		var k int64
		if _, err := fmt.Sscanf(ev.Reason, "%d further denials not recorded individually", &k); err != nil {
			t.Fatalf("summary %q: %v", ev.Reason, err)
		}
		n += k
		summaries++
	}
	return n, summaries
}

// TestEventRingAggregatesDenials: denials beyond 50/s (burst 100) are
// counted, not kept; one summary at most a second reports them (at the
// next event after a second, from the timer, or at close); allow-class
// events are never held back; the verdict counters count everything.
func TestEventRingAggregatesDenials(t *testing.T) {
	clock := time.Unix(1_700_000_000, 0)
	r := newEventRing(nil)
	r.now = func() time.Time { return clock }
	r.every = time.Hour // the timer stays out of this part
	for range 1000 {
		r.add(api.NetworkEvent{Protocol: "dns", Verdict: api.VerdictDeny, Reason: "name not allowed"})
	}
	for range 20 {
		r.add(api.NetworkEvent{Protocol: "udp", Verdict: api.VerdictDrop, Reason: "udp is not forwarded"})
	}
	r.add(api.NetworkEvent{Protocol: "tcp", Verdict: api.VerdictAllow})
	evs := ringEvents(r)
	if len(evs) != denialBurst+1 || evs[len(evs)-1].Verdict != api.VerdictAllow {
		t.Fatalf("kept %d events, want the burst of %d denials and the allow", len(evs), denialBurst)
	}
	if n, _ := summed(t, evs); n != 0 {
		t.Fatal("a summary before a second passed")
	}
	r.every = time.Second
	clock = clock.Add(time.Second)
	r.add(api.NetworkEvent{Protocol: "dns", Verdict: api.VerdictDeny, Reason: "name not allowed"})
	evs = ringEvents(r)
	n, k := summed(t, evs)
	if n != 920 || k != 1 {
		t.Fatalf("summaries: %d reporting %d denials, want 1 reporting 920", k, n)
	}
	sum := evs[len(evs)-2]
	if sum.Protocol != summaryProtocol || !strings.Contains(sum.Reason, "dns deny (name not allowed) ×900") ||
		!strings.Contains(sum.Reason, "udp drop (udp is not forwarded) ×20") || evs[len(evs)-1].Protocol != "dns" {
		t.Fatalf("summary then the new denial expected: %+v", evs[len(evs)-2:])
	}
	if v, _ := r.counts(); v[api.VerdictDeny] != 1001 || v[api.VerdictDrop] != 20 || v[api.VerdictAllow] != 1 || v[api.VerdictLimit] != 0 {
		t.Fatalf("verdict counters %v", v)
	}

	// The timer reports without another event, the close what is left.
	r2 := newEventRing(nil)
	r2.every = 50 * time.Millisecond
	for range 150 {
		r2.add(api.NetworkEvent{Protocol: "dns", Verdict: api.VerdictDeny, Reason: "name not allowed"})
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if n, _ := summed(t, ringEvents(r2)); n >= 50 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no summary from the timer")
		}
		time.Sleep(10 * time.Millisecond)
	}
	r2.aggregate(api.NetworkEvent{Protocol: "icmp", Verdict: api.VerdictDrop, Reason: "icmp is not forwarded"})
	r2.close()
	evs = ringEvents(r2)
	if n, _ := summed(t, evs); n != 51 || evs[len(evs)-1].Protocol != summaryProtocol {
		t.Fatalf("after close: summaries report %d denials (want 51); last %+v", n, evs[len(evs)-1])
	}
}

// TestEventsDenialFloodKeepsAllowed: a sandbox floods denied names (tens
// of thousands of queries, as fast as the gateway reads them) and in the
// middle makes one allowed connection and one allowed query: both stay in
// the link's events, the denials are kept up to the rate and counted in
// summaries beyond it, and nothing is unaccounted for.
func TestEventsDenialFloodKeepsAllowed(t *testing.T) {
	lim := DefaultLimits
	lim.DNSPerSecond = 1e6 // denials by policy, not refusals by rate
	pol := api.NetworkPolicy{AllowOut: []string{"allowed.test", "127.0.0.2/32"}, AllowPrivate: []string{"127.0.0.0/8"}}
	f := newFixture(t, pol, lim)
	fd := f.attachRaw(t, "flood", pol)
	sb := gatewaytest.NewSandboxStack(t, fd) // the same NIC: its stack and raw frames share it

	const n = 30000
	frames := make([][]byte, 256)
	for i := range frames {
		frames[i] = udpFrame(uint16(20000+i), packQuery(t, uint16(i), fmt.Sprintf("leak%d.denied.test", i)))
	}
	middle, resume := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		for i := range n {
			// The stack made the descriptor non-blocking: wait out a
			// full socket.
			_, err := unix.Write(fd, frames[i%len(frames)])
			for err == unix.EAGAIN {
				time.Sleep(50 * time.Microsecond)
				_, err = unix.Write(fd, frames[i%len(frames)])
			}
			if err != nil {
				done <- err
				return
			}
			if i%64 == 63 {
				time.Sleep(200 * time.Microsecond) // room for the stack's own packets
			}
			if i == n/2 {
				// The allowed traffic goes between the two halves (so
				// that it is not itself lost to the flood's queue).
				close(middle)
				<-resume
			}
		}
		done <- nil
	}()
	select {
	case <-middle:
	case err := <-done:
		t.Fatalf("flood ended early: %v", err)
	}
	body, err := sb.Get(ip2, f.port, "x")
	if err != nil || !strings.Contains(body, "127.0.0.2:") {
		t.Fatalf("allowed connection during the flood: %q %v", body, err)
	}
	// The first half's datagrams may still fill the link's DNS queue (a
	// busy machine): a datagram past it is dropped unanswered, and a
	// resolver asks again, as this does. What must hold is that the
	// answered query's event is kept.
	for try := 1; ; try++ {
		rc, ips, err := sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA)
		if err == nil && rc == dnsmessage.RCodeSuccess && len(ips) == 1 {
			break
		}
		if try == 4 {
			t.Fatalf("allowed query during the flood: %v %v %v", rc, ips, err)
		}
	}
	close(resume)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the timer's summary of the last second

	var evs []api.NetworkEvent
	if err := f.g.Events(context.Background(), "flood", 0, false, func(ev api.NetworkEvent) error {
		evs = append(evs, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	info, err := f.g.Info("flood")
	if err != nil {
		t.Fatal(err)
	}
	var gotConn, gotDNS bool
	var kept int64
	for _, ev := range evs {
		switch {
		case ev.Verdict == api.VerdictAllow && ev.IP == "127.0.0.2" && (ev.Protocol == "http" || ev.Protocol == "tcp"):
			gotConn = true
		case ev.Verdict == api.VerdictAllow && ev.Protocol == "dns" && ev.Name == "allowed.test" && len(ev.Answers) == 1:
			gotDNS = true
		case denial(ev):
			kept++
		}
	}
	suppressed, summaries := summed(t, evs)
	v := info.Stats.Verdicts
	denials := v[api.VerdictDeny] + v[api.VerdictLimit] + v[api.VerdictDrop]
	t.Logf("%d frames; %d events in the ring (seq up to %d), %d denials kept, %d summaries reporting %d, %d evicted; verdicts %v",
		n, len(evs), evs[len(evs)-1].Seq, kept, summaries, suppressed, info.Stats.EventsDropped, v)
	if !gotConn {
		t.Error("the allowed connection made during the flood is not in the events")
	}
	if !gotDNS {
		t.Error("the allowed query answered during the flood is not in the events")
	}
	if summaries == 0 || suppressed < 1000 {
		t.Errorf("the flood's denials are not summarised: %d summaries reporting %d", summaries, suppressed)
	}
	if kept+suppressed+info.Stats.EventsDropped != denials {
		t.Errorf("denials unaccounted for: %d kept + %d summarised + %d evicted != %d counted", kept, suppressed, info.Stats.EventsDropped, denials)
	}
}
