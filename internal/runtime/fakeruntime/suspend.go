package fakeruntime

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// The optional abilities (see Options). REMINDER: none of them keeps a
// process or its memory; they only exercise the manager's state machine.

var (
	_ runtime.Suspender = (*suspendInstance)(nil)
	_ runtime.Forker    = (*forkInstance)(nil)
	_ runtime.Suspender = (*suspendForkInstance)(nil)
	_ runtime.Forker    = (*suspendForkInstance)(nil)
)

// resumeSuffix names the marker a quiesced space-agent waits for before
// it listens again (internal/agent: ResumeSuffix).
const resumeSuffix = ".resume"

func (i *Instance) imagePath() string { return filepath.Join(i.dir, "suspended") }

// resumeAgent lets a quiesced agent listen again, as a real runtime does
// after a failed checkpoint or for a fork's parent.
func (i *Instance) resumeAgent() error {
	return os.WriteFile(i.sock()+resumeSuffix, nil, 0o600)
}

// waitQuiet waits until a quiesced agent has closed its host connections
// (it removes its socket file then), as a real runtime must before a
// checkpoint: the agent's own quiesce runs after it has answered.
func (i *Instance) waitQuiet(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for {
		if _, err := os.Lstat(i.sock()); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("fake instance %s: the agent did not quiesce: %w", i.id, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

type suspendInstance struct{ *Instance }

// Suspend stops the agent and leaves the "image" marker. A fault leaves
// the instance running and lets its agent listen again.
func (s *suspendInstance) Suspend(ctx context.Context) error {
	if err := s.waitQuiet(ctx); err != nil {
		s.resumeAgent()
		return err
	}
	if f, ok := s.rt.takeFault("suspend"); ok {
		if err := s.resumeAgent(); err != nil {
			return err
		}
		return f.err
	}
	if !s.Alive() {
		return fmt.Errorf("fake instance %s is not running: %w", s.id, errdefs.ErrConflict)
	}
	if err := s.kill(ctx); err != nil {
		return err
	}
	return os.WriteFile(s.imagePath(), []byte("no memory: see package doc\n"), 0o600)
}

// Restore starts a fresh agent (nothing of the old processes survives) and
// removes the marker. A fault keeps the marker unless it discards the image.
func (s *suspendInstance) Restore(ctx context.Context) error {
	if f, ok := s.rt.takeFault("restore"); ok {
		if f.discardImage {
			os.Remove(s.imagePath())
		}
		return f.err
	}
	if !s.Suspended() {
		return fmt.Errorf("fake instance %s has no image: %w", s.id, errdefs.ErrNotFound)
	}
	if err := s.Start(ctx); err != nil {
		return err
	}
	return os.Remove(s.imagePath())
}

func (s *suspendInstance) Suspended() bool {
	_, err := os.Stat(s.imagePath())
	return err == nil
}

type forkInstance struct{ *Instance }

// Fork creates each child on a copy of the parent's files and starts a
// fresh agent in it; the parent's agent is told to listen again. A fault
// (or any error) leaves no child behind.
func (f *forkInstance) Fork(ctx context.Context, children []runtime.Spec) (_ []runtime.Instance, err error) {
	return fork(ctx, f.Instance, children)
}

func fork(ctx context.Context, parent *Instance, children []runtime.Spec) (out []runtime.Instance, err error) {
	defer func() {
		if rerr := parent.resumeAgent(); rerr != nil && err == nil {
			err = rerr
		}
		if err != nil {
			for _, c := range out {
				c.Destroy(context.Background())
			}
			out = nil
		}
	}()
	if err := parent.waitQuiet(ctx); err != nil {
		return nil, err
	}
	if fault, ok := parent.rt.takeFault("fork"); ok {
		return nil, fault.err
	}
	if !parent.Alive() {
		return nil, fmt.Errorf("fake instance %s is not running: %w", parent.id, errdefs.ErrConflict)
	}
	for _, spec := range children {
		if _, err := os.Stat(parent.rt.dir(spec.ID)); err == nil {
			return out, fmt.Errorf("fake instance %s exists: %w", spec.ID, errdefs.ErrConflict)
		}
		inst, err := parent.rt.Create(ctx, spec)
		if err != nil {
			return out, err
		}
		out = append(out, inst)
		child := filepath.Join(parent.rt.dir(spec.ID), "root")
		if b, err := exec.CommandContext(ctx, "cp", "-a", "--", filepath.Join(parent.dir, "root")+"/.", child).CombinedOutput(); err != nil {
			return out, fmt.Errorf("copying the parent's files: %v: %s", err, b)
		}
		if err := inst.Start(ctx); err != nil {
			return out, err
		}
	}
	return out, nil
}

type suspendForkInstance struct{ suspendInstance }

func (s *suspendForkInstance) Fork(ctx context.Context, children []runtime.Spec) ([]runtime.Instance, error) {
	if s.Suspended() {
		return nil, errors.New("a suspended fake instance cannot fork")
	}
	return fork(ctx, s.Instance, children)
}
