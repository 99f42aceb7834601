package sandbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/template"
)

// SnapshotSource prefixes the Source of templates made by Snapshot; the
// rest is the sandbox id.
const SnapshotSource = "snapshot:"

// Snapshot saves the filesystem of running sandbox id as a new template
// tagged tag, which new sandboxes start from. The sandbox runs on
// undisturbed: a fork of it (memory and disk) is stopped, its writable
// layer applied to a copy of the sandbox's template, and the fork deleted.
// It needs a runtime that can fork and export a sandbox's changes (gvisor);
// others are refused with errdefs.ErrNotSupported, saying which is
// missing. Memory is not part of the template: a sandbox created from it
// boots fresh.
func (part *Verbs) Snapshot(ctx context.Context, id, tag string) (_ api.Template, err error) {
	m := part.m
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.Template{}, err
	}
	if _, err := template.ParseTag(tag); err != nil {
		return api.Template{}, err
	}
	if err := m.cfg.Tenants.ClaimTag(ctx, tag); err != nil {
		return api.Template{}, err
	}
	if sb.State != api.StateRunning {
		return api.Template{}, wrongState(id, sb.State, "snapshot")
	}
	op, err := m.verbs.forkAndTell(ctx, id, api.ForkRequest{Count: 1}, false)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotSupported) {
			return api.Template{}, fmt.Errorf("a snapshot copies the running sandbox by forking it, and %w", err)
		}
		return api.Template{}, err
	}
	if op, err = m.verbs.Wait(ctx, op.ID); err != nil {
		return api.Template{}, err
	}
	if op.State != api.OpSucceeded || len(op.Children) != 1 {
		for _, c := range op.Children {
			m.builds.deleteStepSandbox(c)
		}
		return api.Template{}, fmt.Errorf("forking sandbox %s for its snapshot: %w", id, OpError(op))
	}
	child := op.Children[0]
	defer func() {
		if derr := m.builds.deleteStepSandbox(child); derr != nil {
			m.log.Error("deleting a snapshot's fork", "sandbox", child, "err", derr)
		}
	}()
	e := m.entry(child)
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	exp, ok := inst.(runtime.ChangeExporter)
	if !ok {
		return api.Template{}, fmt.Errorf("runtime %s cannot export a sandbox's filesystem changes, so it cannot snapshot: %w", sb.Runtime, errdefs.ErrNotSupported)
	}
	stop, err := m.verbs.systemLifecycle(ctx, child, api.OpStop, true)
	if err != nil {
		return api.Template{}, fmt.Errorf("stopping the snapshot's fork: %w", err)
	}
	if stop, err = m.verbs.Wait(ctx, stop.ID); err != nil {
		return api.Template{}, err
	}
	if stop.State != api.OpSucceeded {
		return api.Template{}, fmt.Errorf("stopping the snapshot's fork: %w", OpError(stop))
	}
	// Nothing starts the fork again while its disk is read.
	e.mu.Lock()
	defer e.mu.Unlock()
	ch, err := exp.Changes(ctx)
	if err != nil {
		return api.Template{}, fmt.Errorf("reading the sandbox's changes: %w", err)
	}
	defer func() {
		if rerr := ch.Release(); rerr != nil && err == nil {
			err = fmt.Errorf("releasing the sandbox's changes: %w", rerr)
		}
	}()
	parent, err := m.cfg.Templates.Get(ctx, sb.TemplateDigest)
	if err != nil {
		return api.Template{}, fmt.Errorf("the sandbox's template: %w", err)
	}
	t, err := m.cfg.Templates.Derive(ctx, sb.TemplateDigest, template.DeriveOptions{
		Config: parent.Config, Source: SnapshotSource + id, Tags: []string{tag},
		Layer: api.TemplateLayer{CreatedBy: "snapshot of sandbox " + id},
		Apply: func(ctx context.Context, t *template.Tree) error {
			return t.ApplyUpperDir(ctx, template.Upper{Dir: ch.Dir, OpaqueXattr: ch.OpaqueXattr, IDBase: ch.IDBase})
		},
	})
	if err != nil {
		return api.Template{}, err
	}
	return t, m.cfg.Tenants.OwnTag(ctx, tag)
}

// SnapshotOf is the sandbox a template was snapshotted from, if it was.
func SnapshotOf(t api.Template) (string, bool) {
	return strings.CutPrefix(t.Source, SnapshotSource)
}
