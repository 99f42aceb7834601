package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// Suspend and restore.
//
// gVisor cannot save a socket bound on the host (the agent's channel) nor a
// connection accepted on one, so the agent must be quiet first: the manager
// calls its PathQuiesce, the agent closes its listener and sessions and
// removes its socket, and Suspend waits for the socket file to go. The
// agent listens again when the resume marker (agent.sock.resume, see
// internal/agent's ResumeSuffix) appears in its directory: Suspend writes it
// after a failed checkpoint, Restore before `runsc restore`, so that the
// restored agent finds it on its first look (it polls every 2 ms).
//
// The image is written to checkpoint.tmp/ and renamed to checkpoint/ once
// runsc has finished, so Suspended (the directory's presence) never sees a
// partial image, also after a server restart.

var (
	_ runtime.Suspender = (*instance)(nil)
	_ runtime.Forker    = (*instance)(nil)
)

const (
	// resumeMarker is agent.ResumeSuffix appended to agentSock (a test
	// checks that they agree).
	resumeMarker = agentSock + ".resume"
	// quiesceWait bounds the wait for a quiesced agent to remove its
	// socket (it closes sessions the host left open after 0.5 s).
	quiesceWait = 5 * time.Second
	// checkpointTimeout and restoreTimeout bound runsc; both scale with the
	// sandbox's memory (~1 GB/s here).
	checkpointTimeout = 2 * time.Minute
	restoreTimeout    = 2 * time.Minute
)

// Suspended implements runtime.Suspender.
func (i *instance) Suspended() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.ckpt.saved()
}

// Suspend implements runtime.Suspender. The agent must have been quiesced.
func (i *instance) Suspend(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.aliveLocked() {
		return fmt.Errorf("suspend sandbox %s: not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if i.ckpt.saved() {
		return fmt.Errorf("suspend sandbox %s: already holds a checkpoint: %w", i.spec.ID, errdefs.ErrConflict)
	}
	t0 := time.Now()
	if err := i.agent.waitQuiesced(ctx); err != nil {
		return fmt.Errorf("suspend sandbox %s: %w", i.spec.ID, err)
	}
	tQuiesced := time.Now()
	tmp := i.files.imageDir() + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return i.ckpt.failed(ctx, "suspend", err, i.exited)
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return i.ckpt.failed(ctx, "suspend", err, i.exited)
	}
	if err := i.ckpt.savePaused(ctx, tmp, false); err != nil {
		os.RemoveAll(tmp)
		return i.ckpt.failed(ctx, "suspend", err, i.exited)
	}
	if err := os.Rename(tmp, i.files.imageDir()); err != nil {
		os.RemoveAll(tmp)
		i.ckpt.resume(ctx)
		return i.ckpt.failed(ctx, "suspend", err, i.exited)
	}
	tCheckpoint := time.Now()
	// Still paused, nothing changed since the save: release the
	// container, its mounts and cgroups exactly as Stop does. The image
	// stays.
	if err := i.stopLocked(ctx); err != nil {
		return fmt.Errorf("suspend sandbox %s: saved, but stopping it: %w", i.spec.ID, err)
	}
	if pids := cgroupProcs(i.spec.ID); len(pids) > 0 {
		return fmt.Errorf("suspend sandbox %s: host processes %v remain", i.spec.ID, pids)
	}
	i.rt.log.Debug("sandbox suspended", "id", i.spec.ID, "quiesce_wait", tQuiesced.Sub(t0),
		"checkpoint", tCheckpoint.Sub(tQuiesced), "stop", time.Since(tCheckpoint))
	return nil
}

// writeResumeMarker creates the marker in the agent's directory. The
// directory is the sandbox's to write: whatever it planted under that name
// is removed first, and the file is created without following a symlink.
func writeResumeMarker(agentDir string) error {
	dfd, err := unix.Open(agentDir, unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("resume marker: %w", err)
	}
	defer unix.Close(dfd)
	_ = unix.Unlinkat(dfd, resumeMarker, 0)
	fd, err := unix.Openat(dfd, resumeMarker, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("resume marker: %w", err)
	}
	return unix.Close(fd)
}

func removeResumeMarker(agentDir string) {
	_ = os.Remove(filepath.Join(agentDir, resumeMarker))
}

// Restore implements runtime.Suspender: the same bundle, the writable disk
// mounted again, `runsc restore` from the image; the image is removed once
// the agent's socket is back. On error the image stays (Restore may be
// retried) and nothing of the attempt runs.
func (i *instance) Restore(ctx context.Context) (err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.aliveLocked() {
		return fmt.Errorf("restore sandbox %s: running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	if !i.ckpt.saved() {
		return fmt.Errorf("restore sandbox %s: no checkpoint: %w", i.spec.ID, errdefs.ErrConflict)
	}
	t0 := time.Now()
	defer func() {
		if err != nil {
			i.stopLocked(context.WithoutCancel(ctx))
		}
	}()
	if err := i.files.mountRoot(i.spec.RootFS, i.rt.usernsFD); err != nil {
		return err
	}
	if err := writeResumeMarker(i.files.agentDir()); err != nil {
		return err
	}
	// A fresh namespace and TAP at the same path the bundle names: the
	// suspended sandbox's namespace ended with it.
	if err := prepareNIC(i.files.netnsPath(), i.spec.ID); err != nil {
		return err
	}
	tPrepared := time.Now()
	if err := i.restoreFrom(ctx, i.files.imageDir()); err != nil {
		return fmt.Errorf("restore sandbox %s: %w", i.spec.ID, err)
	}
	tRestored := time.Now()
	if err := i.agent.waitPolling(ctx, i.exited); err != nil {
		return err
	}
	removeResumeMarker(i.files.agentDir())
	if err := os.RemoveAll(i.files.imageDir()); err != nil {
		return fmt.Errorf("restore sandbox %s: removing its image: %w", i.spec.ID, err)
	}
	i.rt.log.Debug("sandbox restored", "id", i.spec.ID, "prepare", tPrepared.Sub(t0),
		"runsc_restore", tRestored.Sub(tPrepared), "agent_socket", time.Since(tRestored))
	return nil
}

// restoreFrom runs `runsc restore` of this instance's bundle from image and
// tracks the sandbox process.
func (i *instance) restoreFrom(ctx context.Context, image string) error {
	args := []string{"--detach", "--image-path", image, "--bundle", i.files.dir, "--pid-file", i.files.runscPid(), i.spec.ID}
	if err := i.rs.runReplacingStale(ctx, restoreTimeout, "restore", i.spec.ID, args...); err != nil {
		return err
	}
	_, _, err := i.trackSandboxLocked()
	return err
}

// checkpointer owns one sandbox's checkpoints through runsc: the suspend
// image in checkpoint/ (whether there is one, discarding it), pausing the
// sandbox and saving it with --leave-running, resuming it, and letting
// the agent listen again after a failed save. Restoring from an image is
// the instance's (it tracks the new sandbox process). Callers hold the
// instance's mu.
type checkpointer struct {
	rt    *Runtime
	rs    *runsc
	id    string
	files layout
	agent *agentChan
}

// saved reports whether a suspend image waits in checkpoint/.
func (c *checkpointer) saved() bool {
	fi, err := os.Lstat(c.files.imageDir())
	return err == nil && fi.IsDir()
}

// discard removes a suspended instance's image (Stop).
func (c *checkpointer) discard() error {
	for _, d := range []string{c.files.imageDir(), c.files.imageDir() + ".tmp"} {
		if err := os.RemoveAll(d); err != nil {
			return fmt.Errorf("sandbox %s: discarding its checkpoint: %w", c.id, err)
		}
	}
	return nil
}

// savePaused pauses the sandbox and saves it into image with
// --leave-running. Without --leave-running gVisor kills the sandbox after
// the save whether or not the save succeeded; with it a failed save leaves
// the sandbox as it was. Paused first, the sandbox stays paused after the
// save (runsc resumes only what it paused itself), so nothing — no disk
// write — happens between the image and what the caller does next. On
// error the sandbox is resumed.
//
// verifyPaused asks runsc whether the sandbox is still paused afterwards
// (one more runsc call): Fork does, since it copies the disk while the
// parent must not run; Suspend deletes the sandbox right away instead.
func (c *checkpointer) savePaused(ctx context.Context, image string, verifyPaused bool) (err error) {
	t0 := time.Now()
	if _, err := c.rs.run(ctx, 0, "pause", c.id); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			if rerr := c.resume(ctx); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}
	}()
	tPaused := time.Now()
	if _, err := c.rs.run(ctx, checkpointTimeout, "checkpoint", "--leave-running", "--image-path", image, c.id); err != nil {
		return err
	}
	tSaved := time.Now()
	defer func() {
		c.rt.log.Debug("checkpoint", "id", c.id, "pause", tPaused.Sub(t0), "save", tSaved.Sub(tPaused), "state", time.Since(tSaved))
	}()
	if !verifyPaused {
		return nil
	}
	st, err := c.rs.state(ctx, c.id)
	if err != nil {
		return err
	}
	if st.Status != "paused" {
		return fmt.Errorf("runsc left the container %s after checkpoint --leave-running, not paused: the image may not match its disk", st.Status)
	}
	return nil
}

// resume lets the paused sandbox run again.
func (c *checkpointer) resume(ctx context.Context) error {
	_, err := c.rs.run(context.WithoutCancel(ctx), 0, "resume", c.id)
	return err
}

// failed lets the agent listen again after a failed checkpoint
// (the sandbox kept running) and returns runsc's error.
func (c *checkpointer) failed(ctx context.Context, verb string, err error, exited <-chan struct{}) error {
	err = fmt.Errorf("%s sandbox %s: %w", verb, c.id, err)
	if rerr := c.agent.resume(ctx, exited); rerr != nil {
		return errors.Join(err, fmt.Errorf("and its agent did not listen again: %w", rerr))
	}
	return err
}
