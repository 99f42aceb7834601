// Package forkutil is the skeleton of runtime.Forker that the runtimes
// with a fork share: check the children's ids, make every child, let the
// runtime snapshot its parent and copy the disk once for all of them,
// restore the children a few at a time, and on any failure destroy every
// child made so far. What a snapshot and a restore are stays with each
// runtime (gvisor: runsc checkpoint/restore; microvm: QEMU migration).
package forkutil

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

// Validate rejects a fork without children, a child id given twice and a
// child with the parent's id. Ids of sandboxes that already exist are
// refused when the child is made (Ops.New): that check must be atomic.
func Validate(parentID string, children []runtime.Spec) error {
	if len(children) == 0 {
		return fmt.Errorf("fork: no children: %w", errdefs.ErrInvalidArgument)
	}
	seen := map[string]bool{parentID: true}
	for _, c := range children {
		if seen[c.ID] {
			return fmt.Errorf("fork: child id %q given twice or the parent's: %w", c.ID, errdefs.ErrInvalidArgument)
		}
		seen[c.ID] = true
	}
	return nil
}

// Ops are one runtime's parts of a fork, for children of type C.
type Ops[C runtime.Instance] struct {
	// New makes one child's host state (its directory); an id that
	// exists already is an errdefs.ErrConflict. A child New returned is
	// destroyed (Instance.Destroy) if the fork fails.
	New func(spec runtime.Spec) (C, error)
	// Snapshot captures the parent into what the children restore from
	// and gives every child its copy of the disk. When it returns, with
	// or without an error, the parent must be running again.
	Snapshot func(ctx context.Context, kids []C) error
	// Restore brings one child up from the snapshot; up to Parallel run
	// at once.
	Restore func(ctx context.Context, kid C) error
	// Parallel bounds the concurrent Restore calls (at least 1).
	Parallel int
	// Log, if not nil, hears about children a rollback could not remove.
	Log *slog.Logger
}

// Run forks the sandbox parentID into children: Validate, New for each
// child in order, one Snapshot, then Restore for each child, at most
// ops.Parallel at a time. On any error every child made is destroyed and
// the error (all failed restores, joined) is returned. Callers call
// Validate themselves first when a bad request should cost the parent
// nothing (before quiescing or pausing it).
func Run[C runtime.Instance](ctx context.Context, parentID string, children []runtime.Spec, ops Ops[C]) (_ []runtime.Instance, err error) {
	if err := Validate(parentID, children); err != nil {
		return nil, err
	}
	kids := make([]C, 0, len(children))
	defer func() {
		if err == nil {
			return
		}
		for n, k := range kids {
			if derr := k.Destroy(context.WithoutCancel(ctx)); derr != nil && ops.Log != nil {
				ops.Log.Warn("fork: removing a child", "id", children[n].ID, "err", derr)
			}
		}
	}()
	for _, spec := range children {
		k, err := ops.New(spec)
		if err != nil {
			return nil, fmt.Errorf("fork sandbox %s: child %s: %w", parentID, spec.ID, err)
		}
		kids = append(kids, k)
	}
	if err := ops.Snapshot(ctx, kids); err != nil {
		return nil, fmt.Errorf("fork sandbox %s: %w", parentID, err)
	}
	errs := make([]error, len(kids))
	sem := make(chan struct{}, max(ops.Parallel, 1))
	var wg sync.WaitGroup
	for n, k := range kids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := ops.Restore(ctx, k); err != nil {
				errs[n] = fmt.Errorf("fork sandbox %s: child %s: %w", parentID, children[n].ID, err)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	out := make([]runtime.Instance, 0, len(kids))
	for _, k := range kids {
		out = append(out, k)
	}
	return out, nil
}
