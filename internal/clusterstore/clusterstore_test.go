package clusterstore

import (
	"context"
	"errors"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv/pgtest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	pgtest.StopShared()
	os.Exit(code)
}

func open(t *testing.T) (*Store, string) {
	t.Helper()
	dsn := pgtest.Shared(t).NewDatabase(t)
	s, err := Open(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, dsn
}

// exec runs raw SQL on the test database, as another replica or an
// operator would.
func exec(t *testing.T, dsn, q string, args ...any) {
	t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

func TestMigrationsOnceUnderConcurrentReplicas(t *testing.T) {
	dsn := pgtest.Shared(t).NewDatabase(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	stores := make([]*Store, 4)
	for i := range stores {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stores[i], errs[i] = Open(ctx, dsn)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("replica %d: %v", i, err)
		}
		defer stores[i].Close()
	}
	v, err := stores[0].SchemaVersion(ctx)
	if err != nil || v != len(migrations) {
		t.Fatalf("schema version %d, %v; want %d", v, err, len(migrations))
	}
	// Reopening applies nothing and keeps the version.
	s, err := Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	var rows int
	if err := stores[1].pool.QueryRow(ctx, `SELECT count(*) FROM space_schema`).Scan(&rows); err != nil || rows != len(migrations) {
		t.Fatalf("space_schema has %d rows (%v), want one per migration (%d)", rows, err, len(migrations))
	}
}

func TestNewerSchemaIsRefused(t *testing.T) {
	_, dsn := open(t)
	exec(t, dsn, `INSERT INTO space_schema (version) VALUES ($1)`, len(migrations)+1)
	_, err := Open(context.Background(), dsn)
	if !errors.Is(err, ErrSchemaTooNew) {
		t.Fatalf("open of a newer schema: %v, want ErrSchemaTooNew", err)
	}
}

func TestOpenRejectsBadDSN(t *testing.T) {
	for _, dsn := range []string{"", "postgres://[::1"} {
		if _, err := Open(context.Background(), dsn); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Open(%q) = %v, want invalid argument", dsn, err)
		}
	}
}

func TestHeartbeatAndLost(t *testing.T) {
	s, dsn := open(t)
	ctx := context.Background()
	for _, id := range []string{"n1", "n2"} {
		if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: id, Address: "https://127.0.0.1:1", MemFree: 1 << 30, CPUs: 2}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: "n3"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("heartbeat without address: %v", err)
	}
	if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: "n3", Address: "x", MemFree: -1}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("heartbeat with negative memory: %v", err)
	}
	if lost, err := s.Nodes().MarkLost(ctx, time.Minute); err != nil || len(lost) != 0 {
		t.Fatalf("fresh nodes marked lost: %v %v", lost, err)
	}
	// n1 stops beating: its last heartbeat is 90 s old by the database clock.
	exec(t, dsn, `UPDATE nodes SET heartbeat_at = now() - interval '90 seconds' WHERE id = 'n1'`)
	lost, err := s.Nodes().MarkLost(ctx, time.Minute)
	if err != nil || len(lost) != 1 || lost[0] != "n1" {
		t.Fatalf("lost = %v, %v; want [n1]", lost, err)
	}
	// A second caller (another replica) finds nothing new.
	if again, err := s.Nodes().MarkLost(ctx, time.Minute); err != nil || len(again) != 0 {
		t.Fatalf("second MarkLost = %v, %v", again, err)
	}
	nodes, err := s.Nodes().Nodes(ctx)
	if err != nil || len(nodes) != 2 {
		t.Fatalf("nodes %v %v", nodes, err)
	}
	if n := nodes[0]; n.ID != "n1" || n.State != NodeLost || n.StateReason == "" {
		t.Fatalf("n1 = %+v, want lost with a reason", n)
	}
	t.Logf("reason: %s", nodes[0].StateReason)
	if nodes[1].State != NodeReady {
		t.Fatalf("n2 = %+v, want ready", nodes[1])
	}
	// n1 comes back: ready again, reason cleared.
	if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: "n1", Address: "https://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	nodes, _ = s.Nodes().Nodes(ctx)
	if nodes[0].State != NodeReady || nodes[0].StateReason != "" {
		t.Fatalf("n1 after beating again = %+v", nodes[0])
	}
	if _, err := s.Nodes().MarkLost(ctx, 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("zero window: %v", err)
	}
}

func TestPlacePrefersTemplateThenFreeMemory(t *testing.T) {
	s, dsn := open(t)
	ctx := context.Background()
	beat := func(id string, mem int64, templates ...string) {
		t.Helper()
		if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: id, Address: "https://" + id, MemFree: mem, CPUs: 2, Templates: templates}); err != nil {
			t.Fatal(err)
		}
	}
	beat("big", 8<<30)
	beat("small-with-template", 2<<30, "sha256:aa")
	beat("tiny-with-template", 100<<20, "sha256:aa")
	place := func(digest string, mem int64) string {
		t.Helper()
		n, err := s.Nodes().Place(ctx, digest, mem, time.Minute)
		if err != nil {
			t.Fatalf("place %s %d: %v", digest, mem, err)
		}
		return n.ID
	}
	if got := place("sha256:aa", 1<<30); got != "small-with-template" {
		t.Fatalf("template locality: placed on %s", got)
	}
	if got := place("sha256:bb", 1<<30); got != "big" {
		t.Fatalf("free memory: placed on %s", got)
	}
	if got := place("sha256:aa", 4<<30); got != "big" {
		t.Fatalf("a node with the template but too little memory was chosen: %s", got)
	}
	if err := s.Nodes().Drain(ctx, "big", "maintenance"); err != nil {
		t.Fatal(err)
	}
	if got := place("sha256:bb", 1<<30); got != "small-with-template" {
		t.Fatalf("draining node chosen: %s", got)
	}
	// A node that beat too long ago is not chosen even before MarkLost ran.
	exec(t, dsn, `UPDATE nodes SET heartbeat_at = now() - interval '5 minutes' WHERE id = 'small-with-template'`)
	if got := place("sha256:aa", 50<<20); got != "tiny-with-template" {
		t.Fatalf("stale node chosen: %s", got)
	}
	if _, err := s.Nodes().Place(ctx, "sha256:aa", 64<<30, time.Minute); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("nothing fits: %v", err)
	}
	if err := s.Nodes().Drain(ctx, "nope", ""); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("drain unknown node: %v", err)
	}
}

// A burst of creates spreads over equal nodes: each placement charges the
// chosen node until its next heartbeat.
func TestPlaceSpreadsABurst(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	for _, id := range []string{"a", "b"} {
		if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: id, Address: "https://" + id, MemFree: 8 << 30, CPUs: 2, Templates: []string{"base:latest"}}); err != nil {
			t.Fatal(err)
		}
	}
	count := map[string]int{}
	var excluded []string
	for range 6 {
		n, err := s.Nodes().PlaceExcept(ctx, "base:latest", 512<<20, time.Minute, excluded)
		if err != nil {
			t.Fatal(err)
		}
		count[n.ID]++
	}
	if count["a"] != 3 || count["b"] != 3 {
		t.Fatalf("six placements on two equal nodes: %v", count)
	}
	if n, err := s.Nodes().PlaceExcept(ctx, "base:latest", 512<<20, time.Minute, []string{"a"}); err != nil || n.ID != "b" {
		t.Fatalf("placement excluding a: %+v %v", n, err)
	}
	nodes, _ := s.Nodes().Nodes(ctx)
	for _, n := range nodes {
		if n.MemFree >= 8<<30 || n.Sandboxes < 3 {
			t.Fatalf("node %s not charged: %+v", n.ID, n)
		}
	}
}

// A node with warm members of the template wins over one that only holds
// it, and each placement takes one member off until the next heartbeat.
func TestPlacePrefersAWarmMemberAndTakesIt(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	beat := func(id string, warm ...string) {
		t.Helper()
		if err := s.Nodes().Heartbeat(ctx, NodeStatus{ID: id, Address: "https://" + id, MemFree: 8 << 30, CPUs: 2,
			Templates: []string{"base:latest", "sha256:aa"}, Warm: warm}); err != nil {
			t.Fatal(err)
		}
	}
	beat("cold")
	beat("warm", "base:latest", "sha256:aa", "base:latest", "sha256:aa")
	var got []string
	for range 4 {
		n, err := s.Nodes().Place(ctx, "base:latest", 512<<20, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, n.ID)
	}
	// Two warm members by name: the first two placements take them; the
	// warm node then has more sandboxes, so the cold one is next.
	if got[0] != "warm" || got[1] != "warm" || got[2] != "cold" {
		t.Fatalf("placements %v; want warm, warm, cold, …", got)
	}
	nodes, err := s.Nodes().Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if n.ID == "warm" && !slices.Equal(n.Warm, []string{"sha256:aa", "sha256:aa"}) {
			t.Fatalf("warm members left on the row: %q", n.Warm)
		}
	}
	// A placement by digest now finds them.
	if n, err := s.Nodes().Place(ctx, "sha256:aa", 512<<20, time.Minute); err != nil || n.ID != "warm" {
		t.Fatalf("placement by digest: %+v %v", n, err)
	}
}

func TestPoolsAreSettings(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	spec := api.PoolSpec{Template: "base:latest", Runtime: "auto", Min: 1, Max: 2}
	if err := s.Settings().PutPool(ctx, "pool-1", spec); err != nil {
		t.Fatal(err)
	}
	spec.Max = 3
	if err := s.Settings().PutPool(ctx, "pool-1", spec); err != nil {
		t.Fatal(err)
	}
	st, err := s.Settings().Settings(ctx)
	if err != nil || len(st.Pools) != 1 || st.Pools["pool-1"].Max != 3 {
		t.Fatalf("pools %+v %v", st.Pools, err)
	}
	if err := s.Settings().DeletePool(ctx, "pool-1"); err != nil {
		t.Fatal(err)
	}
	if err := s.Settings().DeletePool(ctx, "pool-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleting a missing pool: %v", err)
	}
	if st, err := s.Settings().Settings(ctx); err != nil || len(st.Pools) != 0 {
		t.Fatalf("pools after delete %+v %v", st.Pools, err)
	}
}
