// Package cluster is what runs beside the sandbox manager in cluster mode:
// a node's heartbeat into the cluster store (Beat) and the replicas' watch
// for nodes that stopped beating (WatchLost). The state itself lives in
// internal/clusterstore; this package only decides when to write it.
package cluster

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
)

// Store is the part of the cluster store these loops use.
type Store interface {
	Heartbeat(ctx context.Context, st clusterstore.NodeStatus) error
	MarkLost(ctx context.Context, window time.Duration) ([]string, error)
}

var _ Store = (*clusterstore.NodeStore)(nil)

// StatusFunc reports a node's current status for its next heartbeat.
type StatusFunc func(ctx context.Context) (clusterstore.NodeStatus, error)

// Beat registers the node with one heartbeat now (so a bad address or an
// unreachable database fails the node's start) and then beats every
// interval until ctx ends. A failed beat is logged and retried at the next
// tick: the node keeps serving its sandboxes while the database is away,
// and replicas mark it lost if that lasts longer than their window.
func Beat(ctx context.Context, s Store, interval time.Duration, status StatusFunc, log *slog.Logger) (<-chan struct{}, error) {
	if interval <= 0 {
		return nil, fmt.Errorf("heartbeat interval %v must be positive: %w", interval, errdefs.ErrInvalidArgument)
	}
	if log == nil {
		log = slog.Default()
	}
	beat := func() error {
		st, err := status(ctx)
		if err != nil {
			return fmt.Errorf("node status: %w", err)
		}
		return s.Heartbeat(ctx, st)
	}
	if err := beat(); err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if err := beat(); err != nil && ctx.Err() == nil {
					log.Warn("cluster heartbeat failed", "err", err)
				}
			}
		}
	}()
	return done, nil
}

// WatchLost marks nodes lost once their last heartbeat is older than
// window, checking every window/4, and calls onLost with the ids this
// replica marked (every replica runs it; each node is reported once).
func WatchLost(ctx context.Context, s Store, window time.Duration, onLost func([]string), log *slog.Logger) (<-chan struct{}, error) {
	if window <= 0 {
		return nil, fmt.Errorf("heartbeat window %v must be positive: %w", window, errdefs.ErrInvalidArgument)
	}
	if log == nil {
		log = slog.Default()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(window / 4)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				ids, err := s.MarkLost(ctx, window)
				if err != nil {
					if ctx.Err() == nil {
						log.Warn("cluster lost-node check failed", "err", err)
					}
					continue
				}
				if len(ids) > 0 {
					log.Warn("nodes lost", "nodes", ids, "window", window)
					onLost(ids)
				}
			}
		}
	}()
	return done, nil
}
