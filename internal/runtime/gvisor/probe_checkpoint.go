package gvisor

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentclient"
)

// probeCheckpoint suspends and restores the probe's running sandbox the
// way Suspend and Restore do — quiesce the agent, pause, checkpoint
// --leave-running, delete, restore with
// the resume marker written, dial the agent again — so that the checkpoint
// verbs are offered only where they really work.
func probeCheckpoint(ctx context.Context, rs *runsc, id, dir string) error {
	agentDir := filepath.Join(dir, "agent")
	sock := filepath.Join(agentDir, agentSock)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	dialHealthy := func() error {
		conn, err := dialSocket(ctx, sock)
		if err != nil {
			return err
		}
		c, err := agentclient.New(conn)
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Health(ctx)
		return err
	}
	conn, err := dialSocket(ctx, sock)
	if err != nil {
		return err
	}
	c, err := agentclient.New(conn)
	if err != nil {
		return err
	}
	err = c.Quiesce(ctx)
	c.Close()
	if err != nil {
		return err
	}
	if err := waitGone(ctx, sock); err != nil {
		return err
	}
	image := filepath.Join(dir, "checkpoint")
	if _, err := rs.run(ctx, 0, "pause", id); err != nil {
		return err
	}
	if _, err := rs.run(ctx, checkpointTimeout, "checkpoint", "--leave-running", "--image-path", image, id); err != nil {
		return err
	}
	if err := rs.deleteForce(ctx, id); err != nil {
		return err
	}
	if err := writeResumeMarker(agentDir); err != nil {
		return err
	}
	if _, err := rs.run(ctx, restoreTimeout, "restore", "--detach", "--image-path", image, "--bundle", dir, id); err != nil {
		return err
	}
	for {
		if err := dialHealthy(); err == nil {
			return nil
		} else if ctx.Err() != nil {
			return fmt.Errorf("the restored agent never answered: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitGone waits until path no longer exists.
func waitGone(ctx context.Context, path string) error {
	ctx, cancel := context.WithTimeout(ctx, quiesceWait)
	defer cancel()
	for {
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); errors.Is(err, unix.ENOENT) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the agent did not quiesce: %s is still there", path)
		case <-time.After(time.Millisecond):
		}
	}
}
