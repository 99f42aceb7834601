package clusterstore

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func beat(t *testing.T, s *Store, id string) {
	t.Helper()
	if err := s.Nodes().Heartbeat(context.Background(), NodeStatus{ID: id, Address: "https://" + id, MemFree: 1 << 30}); err != nil {
		t.Fatal(err)
	}
}

func TestSandboxDesiredAndObserved(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	beat(t, s, "n1")
	beat(t, s, "n2")
	req := api.CreateSandboxRequest{Template: "base:latest", Env: map[string]string{"A": "1"}}
	if err := s.Sandboxes().AddSandbox(ctx, "sb-1", "n1", "acme", req); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().AddSandbox(ctx, "sb-1", "n2", "acme", req); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second row with the same id: %v, want conflict", err)
	}
	if err := s.Sandboxes().AddSandbox(ctx, "sb-2", "nowhere", "", req); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("row on an unknown node: %v, want not found", err)
	}
	pending, err := s.Sandboxes().Pending(ctx, "n1")
	if err != nil || len(pending) != 1 {
		t.Fatalf("pending on n1 = %v, %v", pending, err)
	}
	p := pending[0]
	if p.ID != "sb-1" || p.Tenant != "acme" || p.Desired != DesiredRunning || p.Generation != 1 || p.Observed != 0 ||
		p.Status != nil || p.Request.Env["A"] != "1" {
		t.Fatalf("row = %+v", p)
	}
	if other, _ := s.Sandboxes().Pending(ctx, "n2"); len(other) != 0 {
		t.Fatalf("n2 sees n1's work: %v", other)
	}
	// n1 applies generation 1.
	st := api.Sandbox{ID: "sb-1", State: api.StateRunning, Runtime: "gvisor"}
	if err := s.Sandboxes().Report(ctx, "n1", "sb-1", 1, st); err != nil {
		t.Fatal(err)
	}
	if pending, _ := s.Sandboxes().Pending(ctx, "n1"); len(pending) != 0 {
		t.Fatalf("applied row still pending: %v", pending)
	}
	// Another node cannot overwrite it.
	if err := s.Sandboxes().Report(ctx, "n2", "sb-1", 1, api.Sandbox{State: api.StateError}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("report from the wrong node: %v", err)
	}
	// A late report of an older generation keeps observed where it is.
	if err := s.Sandboxes().SetDesired(ctx, "sb-1", DesiredPaused); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().Report(ctx, "n1", "sb-1", 1, st); err != nil {
		t.Fatal(err)
	}
	got, err := s.Sandboxes().GetSandbox(ctx, "sb-1")
	if err != nil || got.Generation != 2 || got.Observed != 1 || got.Desired != DesiredPaused || got.Status.Runtime != "gvisor" {
		t.Fatalf("after pause asked: %+v %v", got, err)
	}
	if err := s.Sandboxes().SetDesired(ctx, "sb-1", "exploded"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad desired state: %v", err)
	}
	if err := s.Sandboxes().SetDesired(ctx, "sb-none", DesiredDeleted); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("desired state of a missing sandbox: %v", err)
	}
	// Deletion: desired, then reported deleted → the row is gone.
	if err := s.Sandboxes().SetDesired(ctx, "sb-1", DesiredDeleted); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().Report(ctx, "n1", "sb-1", 3, api.Sandbox{ID: "sb-1", State: api.StateDeleted}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Sandboxes().GetSandbox(ctx, "sb-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleted sandbox's row: %v", err)
	}
}

// A lost node's sandboxes are lost with the node's reason, except those
// being deleted; the node's return and next report bring them back.
func TestLostNodeLosesItsSandboxes(t *testing.T) {
	s, dsn := open(t)
	ctx := context.Background()
	beat(t, s, "n1")
	beat(t, s, "n2")
	for id, node := range map[string]string{"a": "n1", "b": "n1", "c": "n2", "d": "n1"} {
		if err := s.Sandboxes().AddSandbox(ctx, id, node, "", api.CreateSandboxRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sandboxes().SetDesired(ctx, "d", DesiredDeleted); err != nil {
		t.Fatal(err)
	}
	exec(t, dsn, `UPDATE nodes SET heartbeat_at = now() - interval '1 minute' WHERE id = 'n1'`)
	lost, err := s.Nodes().MarkLost(ctx, 10*time.Second)
	if err != nil || len(lost) != 1 {
		t.Fatalf("lost %v %v", lost, err)
	}
	for id, want := range map[string]string{"a": StateLost, "b": StateLost, "c": "creating", "d": "creating"} {
		sb, err := s.Sandboxes().GetSandbox(ctx, id)
		if err != nil || sb.State != want {
			t.Errorf("sandbox %s: %+v %v, want %s", id, sb, err, want)
		}
		if want == StateLost && sb.StateReason == "" {
			t.Errorf("sandbox %s lost without a reason", id)
		}
	}
	a, _ := s.Sandboxes().GetSandbox(ctx, "a")
	t.Logf("reason: %s", a.StateReason)
	beat(t, s, "n1")
	if err := s.Sandboxes().Report(ctx, "n1", "a", 1, api.Sandbox{ID: "a", State: api.StateRunning}); err != nil {
		t.Fatal(err)
	}
	if a, _ := s.Sandboxes().GetSandbox(ctx, "a"); a.State != api.StateRunning || a.StateReason != "" {
		t.Fatalf("after the node's report: %+v", a)
	}
}

// A replica's write wakes the node it placed on, and only it.
func TestListenWakesTheNode(t *testing.T) {
	s, _ := open(t)
	beat(t, s, "n1")
	beat(t, s, "n2")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	woke := make(chan struct{}, 16)
	done := make(chan error, 1)
	go func() { done <- s.Sandboxes().Listen(ctx, "n1", func() { woke <- struct{}{} }) }()
	select { // the wake after connecting
	case <-woke:
	case <-time.After(5 * time.Second):
		t.Fatal("no wake after LISTEN")
	}
	if err := s.Sandboxes().AddSandbox(ctx, "x", "n2", "", api.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().AddSandbox(ctx, "y", "n1", "", api.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-woke:
	case <-time.After(5 * time.Second):
		t.Fatal("n1 not woken by a sandbox placed on it")
	}
	select {
	case <-woke:
		t.Fatal("n1 woken twice (once for n2's sandbox?)")
	case <-time.After(300 * time.Millisecond):
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Listen returned %v", err)
	}
}

// A lost node's sandbox is claimed for a move by exactly one replica, and
// the move settles forward or back.
func TestMoveClaimsOnceAndSettles(t *testing.T) {
	s, dsn := open(t)
	ctx := context.Background()
	for _, n := range []string{"n1", "n2", "n3"} {
		beat(t, s, n)
	}
	for _, id := range []string{"a", "b"} {
		if err := s.Sandboxes().AddSandbox(ctx, id, "n1", "", api.CreateSandboxRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sandboxes().ClaimMove(ctx, "a", "n1", "n2"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("claiming a sandbox that is not lost: %v", err)
	}
	exec(t, dsn, `UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id = 'n1'`)
	if _, err := s.Nodes().MarkLost(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().ClaimMove(ctx, "a", "n1", "n2"); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().ClaimMove(ctx, "a", "n1", "n3"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a second claim: %v", err)
	}
	if r, _ := s.Sandboxes().GetSandbox(ctx, "a"); r.Node != "n2" || r.State != StateMoving {
		t.Fatalf("claimed row %+v", r)
	}
	if err := s.Sandboxes().EndMove(ctx, "a", "n1", "n2", nil); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Sandboxes().GetSandbox(ctx, "a"); r.Node != "n2" || r.State != api.StateSuspended {
		t.Fatalf("moved row %+v", r)
	}
	if err := s.Sandboxes().ClaimMove(ctx, "b", "n1", "n3"); err != nil {
		t.Fatal(err)
	}
	if err := s.Sandboxes().EndMove(ctx, "b", "n1", "n3", errors.New("no space")); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Sandboxes().GetSandbox(ctx, "b"); r.Node != "n1" || r.State != StateLost || r.StateReason != "moving to n3 failed: no space" {
		t.Fatalf("a failed move's row %+v", r)
	}
}
