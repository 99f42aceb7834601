package sandbox

import (
	"context"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"sync"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// FakeNetwork is an in-memory Network for tests: it records every call,
// keeps the attached ids with their policies, and serves the events a test
// pushes with Push. It holds no descriptor (Attach checks the NIC is open
// and leaves closing it to the caller, as the contract says). Safe for
// concurrent use.
type FakeNetwork struct {
	mu       sync.Mutex
	attached map[string]api.NetworkPolicy
	events   map[string][]api.NetworkEvent
	changed  chan struct{} // closed and replaced on every Push
	calls    []NetCall
	failNext map[string]error  // by method: the next call fails
	targets  map[uint16]string // DialSandbox: port → local address
}

// NetCall is one recorded call of FakeNetwork.
type NetCall struct {
	Method string // "attach", "set_policy", "detach", "dial"
	ID     string
	Policy api.NetworkPolicy // attach, set_policy
}

var _ Network = (*FakeNetwork)(nil)

// NewFakeNetwork returns an empty FakeNetwork.
func NewFakeNetwork() *FakeNetwork {
	return &FakeNetwork{attached: map[string]api.NetworkPolicy{}, events: map[string][]api.NetworkEvent{},
		changed: make(chan struct{}), failNext: map[string]error{}, targets: map[uint16]string{}}
}

// FailNext makes the next call of method ("attach", "set_policy",
// "detach", "info", "events", "attached", "dial") fail with err.
func (f *FakeNetwork) FailNext(method string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failNext[method] = err
}

func (f *FakeNetwork) fault(method string) error {
	err := f.failNext[method]
	delete(f.failNext, method)
	return err
}

func (f *FakeNetwork) Attach(ctx context.Context, id string, nic *os.File, p api.NetworkPolicy) error {
	if nic == nil {
		return fmt.Errorf("attach %s: no NIC: %w", id, errdefs.ErrInvalidArgument)
	}
	if _, err := nic.Stat(); err != nil {
		return fmt.Errorf("attach %s: NIC descriptor is not open: %w", id, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.fault("attach"); err != nil {
		return err
	}
	p = ClonePolicy(p)
	f.calls = append(f.calls, NetCall{Method: "attach", ID: id, Policy: p})
	f.attached[id] = p
	return nil
}

func (f *FakeNetwork) SetPolicy(ctx context.Context, id string, p api.NetworkPolicy) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.fault("set_policy"); err != nil {
		return err
	}
	if _, ok := f.attached[id]; !ok {
		return fmt.Errorf("sandbox %s is not attached: %w", id, errdefs.ErrNotFound)
	}
	p = ClonePolicy(p)
	f.calls = append(f.calls, NetCall{Method: "set_policy", ID: id, Policy: p})
	f.attached[id] = p
	return nil
}

func (f *FakeNetwork) Detach(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.fault("detach"); err != nil {
		return err
	}
	f.calls = append(f.calls, NetCall{Method: "detach", ID: id})
	delete(f.attached, id)
	return nil
}

func (f *FakeNetwork) Info(ctx context.Context, id string) (api.NetworkInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.fault("info"); err != nil {
		return api.NetworkInfo{}, err
	}
	p, ok := f.attached[id]
	if !ok {
		return api.NetworkInfo{}, fmt.Errorf("sandbox %s is not attached: %w", id, errdefs.ErrNotFound)
	}
	st := api.NetworkStats{Verdicts: map[string]int64{}}
	for _, ev := range f.events[id] {
		st.Verdicts[ev.Verdict]++
		st.BytesOut += ev.BytesOut
		st.BytesIn += ev.BytesIn
		if ev.Protocol == "dns" {
			st.DNSQueries++
		}
	}
	return api.NetworkInfo{Policy: ClonePolicy(p), Stats: st, Attached: true}, nil
}

func (f *FakeNetwork) Events(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	f.mu.Lock()
	err := f.fault("events")
	f.mu.Unlock()
	if err != nil {
		return err
	}
	for {
		f.mu.Lock()
		var batch []api.NetworkEvent
		for _, ev := range f.events[id] {
			if ev.Seq > after {
				batch = append(batch, ev)
			}
		}
		changed := f.changed
		f.mu.Unlock()
		for _, ev := range batch {
			if err := fn(ev); err != nil {
				return err
			}
			after = ev.Seq
		}
		if !follow {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

func (f *FakeNetwork) Attached(ctx context.Context) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.fault("attached"); err != nil {
		return nil, err
	}
	return slices.Sorted(maps.Keys(f.attached)), nil
}

// Push records ev for sandbox id (whether or not it is attached), giving it
// the next sequence number of that sandbox's link (numbered per sandbox, as
// the gateway does: a follower takes a gap for lost events), and wakes
// followers. It returns the event as
// stored.
func (f *FakeNetwork) Push(id string, ev api.NetworkEvent) api.NetworkEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev.Seq = uint64(len(f.events[id])) + 1
	f.events[id] = append(f.events[id], ev)
	close(f.changed)
	f.changed = make(chan struct{})
	return ev
}

// Policy returns the policy id is attached with.
func (f *FakeNetwork) Policy(id string) (api.NetworkPolicy, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.attached[id]
	return ClonePolicy(p), ok
}

// Calls returns the recorded calls, oldest first; with id non-empty only
// that sandbox's.
func (f *FakeNetwork) Calls(id string) []NetCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []NetCall
	for _, c := range f.calls {
		if id == "" || c.ID == id {
			out = append(out, c)
		}
	}
	return out
}

// Forget drops id's link without recording a call: what a restarted
// gateway that lost its links looks like.
func (f *FakeNetwork) Forget(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.attached, id)
}

// Serve makes DialSandbox of port (any sandbox) dial addr, a local TCP
// address standing in for the service in the sandbox.
func (f *FakeNetwork) Serve(port uint16, addr string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.targets[port] = addr
}

// DialSandbox dials the address Serve configured for port (the sandbox need
// not be attached: the fake runtime's NIC carries nothing). A port without
// one is ErrUnavailable, as a port nothing listens on is.
func (f *FakeNetwork) DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error) {
	f.mu.Lock()
	err := f.fault("dial")
	addr, ok := f.targets[port]
	if err == nil {
		f.calls = append(f.calls, NetCall{Method: "dial", ID: id})
	}
	f.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("nothing listens on port %d in the sandbox: %w", port, errdefs.ErrUnavailable)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}
