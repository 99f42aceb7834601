package cluster

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv/pgtest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	pgtest.StopShared()
	os.Exit(code)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// A node that stops beating is marked lost by a replica's watch within
// the window (plus one check interval), and only that node.
func TestStoppedNodeIsLostWithinWindow(t *testing.T) {
	s, err := clusterstore.Open(context.Background(), pgtest.Shared(t).NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	status := func(id string) StatusFunc {
		return func(context.Context) (clusterstore.NodeStatus, error) {
			return clusterstore.NodeStatus{ID: id, Address: "https://127.0.0.1:1", MemFree: 1 << 30, CPUs: 2}, nil
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	alive, err := Beat(ctx, s.Nodes(), 100*time.Millisecond, status("alive"), quiet)
	if err != nil {
		t.Fatal(err)
	}
	dyingCtx, kill := context.WithCancel(ctx)
	dying, err := Beat(dyingCtx, s.Nodes(), 100*time.Millisecond, status("dying"), quiet)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var lost []string
	lostAt := make(chan time.Time, 4)
	const window = 1 * time.Second
	watch, err := WatchLost(ctx, s.Nodes(), window, func(ids []string) {
		mu.Lock()
		lost = append(lost, ids...)
		mu.Unlock()
		lostAt <- time.Now()
	}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	kill()
	<-dying
	stopped := time.Now()
	select {
	case at := <-lostAt:
		// Last beat ≤ 100 ms before the stop; marked once older than the
		// window, seen at the next check (window/4).
		if d := at.Sub(stopped); d > window+window/4+500*time.Millisecond {
			t.Fatalf("marked lost %v after the last beat, window %v", d, window)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stopped node was never marked lost")
	}
	time.Sleep(window) // the live node must stay ready past another window
	mu.Lock()
	if len(lost) != 1 || lost[0] != "dying" {
		t.Fatalf("lost = %v, want [dying]", lost)
	}
	mu.Unlock()
	nodes, err := s.Nodes().Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		want := map[string]string{"alive": clusterstore.NodeReady, "dying": clusterstore.NodeLost}[n.ID]
		if n.State != want {
			t.Errorf("node %s is %s (%s), want %s", n.ID, n.State, n.StateReason, want)
		}
	}
	cancel()
	<-alive
	<-watch
}

func TestBeatRefusesBadStart(t *testing.T) {
	ctx := context.Background()
	if _, err := Beat(ctx, nil, 0, nil, quiet); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("zero interval: %v", err)
	}
	if _, err := WatchLost(ctx, nil, 0, nil, quiet); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("zero window: %v", err)
	}
	bad := func(context.Context) (clusterstore.NodeStatus, error) {
		return clusterstore.NodeStatus{}, errors.New("no meminfo")
	}
	if _, err := Beat(ctx, nil, time.Second, bad, quiet); err == nil {
		t.Fatal("a node whose first status fails started beating")
	}
}
