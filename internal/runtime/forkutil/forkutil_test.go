package forkutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// kid is a fake child; host records what happened to all of them.
type kid struct {
	id   string
	host *host
}

type host struct {
	mu        sync.Mutex
	made      []string
	destroyed []string
	restored  []string
	snapshots int
}

func (k *kid) ID() string                                   { return k.id }
func (k *kid) Start(context.Context) error                  { return nil }
func (k *kid) Alive() bool                                  { return true }
func (k *kid) DialAgent(context.Context) (net.Conn, error)  { return nil, errors.New("fake") }
func (k *kid) Stop(context.Context) error                   { return nil }
func (k *kid) Stats(context.Context) (runtime.Stats, error) { return runtime.Stats{}, nil }
func (k *kid) Exited() <-chan struct{}                      { return nil }
func (k *kid) Destroy(context.Context) error {
	k.host.mu.Lock()
	defer k.host.mu.Unlock()
	k.host.destroyed = append(k.host.destroyed, k.id)
	return nil
}

// ops makes a fork whose New fails for newFails and whose Restore fails
// for restoreFails.
func (h *host) ops(newFails, restoreFails string) Ops[*kid] {
	return Ops[*kid]{
		New: func(s runtime.Spec) (*kid, error) {
			if s.ID == newFails {
				return nil, fmt.Errorf("sandbox %s already exists: %w", s.ID, errdefs.ErrConflict)
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			h.made = append(h.made, s.ID)
			return &kid{id: s.ID, host: h}, nil
		},
		Snapshot: func(_ context.Context, kids []*kid) error {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.snapshots++
			return nil
		},
		Restore: func(_ context.Context, k *kid) error {
			if k.id == restoreFails {
				return errors.New("restore failed")
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			h.restored = append(h.restored, k.id)
			return nil
		},
		Parallel: 2,
	}
}

func specs(ids ...string) []runtime.Spec {
	var out []runtime.Spec
	for _, id := range ids {
		out = append(out, runtime.Spec{ID: id})
	}
	return out
}

func TestValidate(t *testing.T) {
	for _, c := range []struct {
		name string
		kids []runtime.Spec
		ok   bool
	}{
		{"none", nil, false},
		{"one", specs("a"), true},
		{"several", specs("a", "b", "c"), true},
		{"twice", specs("a", "b", "a"), false},
		{"parent's id", specs("a", "p"), false},
	} {
		err := Validate("p", c.kids)
		if c.ok != (err == nil) || (err != nil && !errors.Is(err, errdefs.ErrInvalidArgument)) {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}

func TestRun(t *testing.T) {
	ctx := context.Background()
	h := &host{}
	out, err := Run(ctx, "p", specs("a", "b", "c"), h.ops("", ""))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, k := range out {
		ids = append(ids, k.ID())
	}
	slices.Sort(h.restored)
	if !slices.Equal(ids, []string{"a", "b", "c"}) || !slices.Equal(h.restored, ids) || h.snapshots != 1 || len(h.destroyed) != 0 {
		t.Fatalf("children %v, restored %v, %d snapshots, destroyed %v", ids, h.restored, h.snapshots, h.destroyed)
	}
}

// TestRunDuplicate: a child id given twice is refused before anything is
// made.
func TestRunDuplicate(t *testing.T) {
	h := &host{}
	_, err := Run(context.Background(), "p", specs("a", "b", "a"), h.ops("", ""))
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Run: %v", err)
	}
	if len(h.made) != 0 || h.snapshots != 0 {
		t.Fatalf("made %v, %d snapshots", h.made, h.snapshots)
	}
}

// TestRunRollback: whichever step fails for the k-th child, every child
// made is destroyed and the error says which child.
func TestRunRollback(t *testing.T) {
	ctx := context.Background()
	all := []string{"a", "b", "c", "d"}
	for k, id := range all {
		h := &host{}
		_, err := Run(ctx, "p", specs(all...), h.ops(id, ""))
		if !errors.Is(err, errdefs.ErrConflict) || !containsID(err, id) {
			t.Errorf("New of child %d fails: %v", k, err)
		}
		if !slices.Equal(h.made, all[:k]) || !slices.Equal(h.destroyed, all[:k]) || h.snapshots != 0 || len(h.restored) != 0 {
			t.Errorf("New of child %d fails: made %v, destroyed %v, %d snapshots, restored %v", k, h.made, h.destroyed, h.snapshots, h.restored)
		}

		h = &host{}
		_, err = Run(ctx, "p", specs(all...), h.ops("", id))
		if err == nil || !containsID(err, id) {
			t.Errorf("Restore of child %d fails: %v", k, err)
		}
		slices.Sort(h.destroyed)
		if !slices.Equal(h.destroyed, all) || len(h.restored) != len(all)-1 {
			t.Errorf("Restore of child %d fails: destroyed %v, restored %v", k, h.destroyed, h.restored)
		}
	}
	h := &host{}
	ops := h.ops("", "")
	ops.Snapshot = func(context.Context, []*kid) error { return errors.New("checkpoint failed") }
	if _, err := Run(ctx, "p", specs(all...), ops); err == nil || len(h.destroyed) != len(all) || len(h.restored) != 0 {
		t.Errorf("Snapshot fails: %v, destroyed %v, restored %v", err, h.destroyed, h.restored)
	}
}

func containsID(err error, id string) bool {
	return err != nil && strings.Contains(err.Error(), "child "+id+":")
}

// TestRunParallel: restores run concurrently, never more than Parallel.
func TestRunParallel(t *testing.T) {
	const parallel, n = 3, 10
	h := &host{}
	ops := h.ops("", "")
	ops.Parallel = parallel
	var cur, peak atomic.Int32
	full := make(chan struct{})
	var once sync.Once
	ops.Restore = func(ctx context.Context, k *kid) error {
		c := cur.Add(1)
		defer cur.Add(-1)
		for {
			p := peak.Load()
			if c <= p || peak.CompareAndSwap(p, c) {
				break
			}
		}
		if c == parallel {
			once.Do(func() { close(full) })
		}
		// Hold on until the bound was reached once (or it never will).
		select {
		case <-full:
		case <-time.After(5 * time.Second):
		}
		time.Sleep(time.Millisecond)
		return nil
	}
	if _, err := Run(context.Background(), "p", specs(idsN(n)...), ops); err != nil {
		t.Fatal(err)
	}
	if p := peak.Load(); p != parallel {
		t.Fatalf("peak concurrency %d, want %d", p, parallel)
	}
}

func idsN(n int) []string {
	var out []string
	for i := 0; i < n; i++ {
		out = append(out, fmt.Sprintf("c%d", i))
	}
	return out
}
