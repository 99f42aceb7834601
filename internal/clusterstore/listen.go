package clusterstore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// listen calls wake at every notification on channel whose payload
// matches, and once after every (re)connect, until ctx ends (see Listen).
func listen(ctx context.Context, pool *pgxpool.Pool, channel string, match func(string) bool, wake func()) error {
	for ctx.Err() == nil {
		err := listenOnce(ctx, pool, channel, match, wake)
		if ctx.Err() != nil {
			break
		}
		_ = err // the caller's poll covers the gap; retry after a pause
		select {
		case <-ctx.Done():
		case <-time.After(500 * time.Millisecond):
		}
	}
	return ctx.Err()
}

func listenOnce(ctx context.Context, pool *pgxpool.Pool, channel string, match func(string) bool, wake func()) error {
	pooled, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// A LISTENing connection must not go back to the pool.
	conn := pooled.Hijack()
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		return err
	}
	wake()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if match(n.Payload) {
			wake()
		}
	}
}
