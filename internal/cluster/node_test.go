package cluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv/pgtest"
)

// fakeLocal is a node's sandbox manager in memory.
type fakeLocal struct {
	mu      sync.Mutex
	sbs     map[string]api.Sandbox
	refuse  map[string]error // verb → error
	applied []string
}

var _ Local = (*fakeLocal)(nil)

func (f *fakeLocal) List(context.Context) ([]api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []api.Sandbox
	for _, sb := range f.sbs {
		out = append(out, sb)
	}
	return out, nil
}

func (f *fakeLocal) Apply(_ context.Context, id, verb string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.applied = append(f.applied, id+":"+verb)
	if err := f.refuse[verb]; err != nil {
		return err
	}
	sb, ok := f.sbs[id]
	if !ok {
		return fmt.Errorf("no sandbox %s", id)
	}
	to := map[string]string{api.OpPause: api.StatePaused, api.OpResume: api.StateRunning, api.OpWake: api.StateRunning, api.OpSuspend: api.StateSuspended}[verb]
	if verb == api.OpDelete {
		delete(f.sbs, id)
		return nil
	}
	sb.State, sb.UpdatedAt = to, time.Now()
	f.sbs[id] = sb
	return nil
}

func (f *fakeLocal) put(id, state string, created time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sbs[id] = api.Sandbox{ID: id, State: state, CreatedAt: created, UpdatedAt: created}
}

func (f *fakeLocal) has(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.sbs[id]
	return ok
}

func newNodeEnv(t *testing.T) (*clusterstore.Store, *fakeLocal, *Node) {
	t.Helper()
	s, err := clusterstore.Open(context.Background(), pgtest.Shared(t).NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.Nodes().Heartbeat(context.Background(), clusterstore.NodeStatus{ID: "n1", Address: "https://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	local := &fakeLocal{sbs: map[string]api.Sandbox{}, refuse: map[string]error{}}
	n := &Node{ID: "n1", Store: s.Sandboxes(), Local: local, Log: quiet, OrphanGrace: 200 * time.Millisecond, started: time.Now(), reported: map[string]string{}}
	return s, local, n
}

func row(t *testing.T, s *clusterstore.Store, id string) clusterstore.Sandbox {
	t.Helper()
	r, err := s.Sandboxes().GetSandbox(context.Background(), id)
	if err != nil {
		t.Fatalf("row %s: %v", id, err)
	}
	return r
}

// The node applies what replicas desire and reports what it has, with the
// generation it applied.
func TestNodeAppliesDesiredState(t *testing.T) {
	s, local, n := newNodeEnv(t)
	ctx := context.Background()
	local.put("a", api.StateRunning, time.Now())
	if err := s.Sandboxes().AddSandbox(ctx, "a", "n1", "", api.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if r := row(t, s, "a"); r.Observed != 1 || r.State != api.StateRunning || r.Status == nil {
		t.Fatalf("after the first pass: %+v", r)
	}
	for _, c := range []struct{ desired, state string }{
		{clusterstore.DesiredPaused, api.StatePaused},
		{clusterstore.DesiredRunning, api.StateRunning},
		{clusterstore.DesiredSuspended, api.StateSuspended},
		{clusterstore.DesiredRunning, api.StateRunning},
	} {
		if err := s.Sandboxes().SetDesired(ctx, "a", c.desired); err != nil {
			t.Fatal(err)
		}
		if err := n.Reconcile(ctx); err != nil {
			t.Fatal(err)
		}
		r := row(t, s, "a")
		if r.State != c.state || r.Observed != r.Generation {
			t.Fatalf("desired %s: row %+v", c.desired, r)
		}
	}
	// A verb the runtime refuses: reported as the sandbox's error, and the
	// row is no longer pending (no retry storm).
	local.refuse[api.OpSuspend] = errors.New("runtime native cannot suspend")
	if err := s.Sandboxes().SetDesired(ctx, "a", clusterstore.DesiredSuspended); err != nil {
		t.Fatal(err)
	}
	if err := n.Reconcile(ctx); err == nil {
		t.Fatal("a refused verb was not an error of the pass")
	}
	r := row(t, s, "a")
	if r.Observed != r.Generation || !strings.Contains(r.StateReason, "cannot suspend") || r.State != api.StateRunning {
		t.Fatalf("refused suspend: %+v", r)
	}
	if pending, _ := s.Sandboxes().Pending(ctx, "n1"); len(pending) != 0 {
		t.Fatalf("still pending after a refusal: %v", pending)
	}
	if err := s.Sandboxes().SetDesired(ctx, "a", clusterstore.DesiredDeleted); err != nil {
		t.Fatal(err)
	}
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if local.has("a") {
		t.Fatal("desired deletion did not delete")
	}
	if _, err := s.Sandboxes().GetSandbox(ctx, "a"); err == nil {
		t.Fatal("a deleted sandbox kept its row")
	}
	// A row for a sandbox this node does not have is reported as such.
	if err := s.Sandboxes().AddSandbox(ctx, "ghost", "n1", "", api.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if g := row(t, s, "ghost"); g.State != api.StateError || !strings.Contains(g.StateReason, "not on node n1") {
		t.Fatalf("ghost row: %+v", g)
	}
}

// A sandbox made since the node started that never gets a row is deleted
// after the grace; one older than the node process is left alone.
func TestNodeDeletesOrphansOnlyItsOwnRecentOnes(t *testing.T) {
	_, local, n := newNodeEnv(t)
	ctx := context.Background()
	local.put("old", api.StateRunning, n.started.Add(-time.Hour))
	local.put("new", api.StateRunning, time.Now())
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if !local.has("new") {
		t.Fatal("an orphan was deleted inside its grace")
	}
	time.Sleep(250 * time.Millisecond)
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if local.has("new") {
		t.Fatal("an orphan past its grace survived")
	}
	if !local.has("old") {
		t.Fatal("a sandbox older than the node process was deleted for lack of a row")
	}
}

// Run reacts to a replica's write through NOTIFY well before its poll.
func TestNodeRunWakesOnNotify(t *testing.T) {
	s, local, n := newNodeEnv(t)
	n.Poll = time.Hour
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	local.put("b", api.StateRunning, time.Now())
	time.Sleep(200 * time.Millisecond) // Run's first pass and its LISTEN
	if err := s.Sandboxes().AddSandbox(ctx, "b", "n1", "", api.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for row(t, s, "b").Observed != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the node did not apply a notified row within 5 s (poll is an hour)")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A sandbox deleted on the node without a replica asking, and one that
// went while the node process was down, are reported deleted: their rows go.
func TestNodeReportsDeletionsItWasNotAskedFor(t *testing.T) {
	s, local, n := newNodeEnv(t)
	ctx := context.Background()
	for _, id := range []string{"c", "d"} {
		local.put(id, api.StateRunning, time.Now())
		if err := s.Sandboxes().AddSandbox(ctx, id, "n1", "", api.CreateSandboxRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	local.mu.Lock()
	delete(local.sbs, "c")
	local.mu.Unlock()
	if err := n.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Sandboxes().GetSandbox(ctx, "c"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("directly deleted sandbox: row %+v %v", r, err)
	}
	// The node process restarts; "d" went while it was down.
	local.mu.Lock()
	delete(local.sbs, "d")
	local.mu.Unlock()
	restarted := &Node{ID: "n1", Store: s.Sandboxes(), Local: local, Log: quiet, started: time.Now(), reported: map[string]string{}}
	if err := restarted.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Sandboxes().GetSandbox(ctx, "d"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("sandbox gone while the node was down: row %+v %v", r, err)
	}
}
