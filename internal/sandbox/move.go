package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/template"
)

// movedRecord is the sandbox's record inside an exported directory.
const movedRecord = "sandbox.json"

// ExportSuspended copies suspended sandbox id — its record and its
// runtime's saved state — into dir (shared storage), so that another host
// can continue it (ImportSuspended). dir is complete or absent. The
// sandbox itself is untouched.
func (part *Verbs) ExportSuspended(ctx context.Context, id, dir string) error {
	m := part.m
	e := m.entry(id)
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	if sb.State != api.StateSuspended {
		return wrongState(id, sb.State, "export")
	}
	inst, rt, err := m.verbs.instance(ctx, e, sb)
	if err != nil {
		return err
	}
	mv, ok := rt.(runtime.Mover)
	if !ok {
		return runtime.NotSupported(rt.Name(), "move", "its suspended sandboxes cannot leave their host")
	}
	tmp := dir + ".rec"
	if err := mv.Export(ctx, inst, tmp); err != nil {
		return err
	}
	b, _ := json.Marshal(sb)
	if err := os.WriteFile(filepath.Join(tmp, movedRecord), b, 0o600); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	if err := os.Rename(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	return nil
}

// ImportSuspended makes the sandbox exported into dir a suspended sandbox
// of this host, with its id, record and state; a wake continues it. The
// template must be here (by digest), the runtime registered, and the id
// new to this host.
func (part *Verbs) ImportSuspended(ctx context.Context, dir string) (api.Sandbox, error) {
	m := part.m
	b, err := os.ReadFile(filepath.Join(dir, movedRecord))
	if err != nil {
		return api.Sandbox{}, fmt.Errorf("no exported sandbox in %s: %w", dir, errdefs.ErrNotFound)
	}
	var sb api.Sandbox
	if err := json.Unmarshal(b, &sb); err != nil || sb.ID == "" || sb.State != api.StateSuspended {
		return api.Sandbox{}, fmt.Errorf("the exported record in %s is not a suspended sandbox: %w", dir, errdefs.ErrInvalidArgument)
	}
	if _, err := m.cfg.DB.GetSandbox(ctx, sb.ID); err == nil {
		return api.Sandbox{}, fmt.Errorf("sandbox %s is already on this host: %w", sb.ID, errdefs.ErrConflict)
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return api.Sandbox{}, err
	}
	e := m.entry(sb.ID)
	e.mu.Lock()
	defer e.mu.Unlock()
	spec, rt, err := m.creates.spec(ctx, sb)
	if errors.Is(err, errdefs.ErrNotFound) && isBaseRef(sb.Template, m.cfg.BaseTemplateRef) {
		// Every host makes the base template itself, from the same
		// cache: the same content, so the same digest.
		if _, berr := m.cfg.Templates.EnsureBase(ctx, func(template.Progress) {}); berr != nil {
			return api.Sandbox{}, berr
		}
		spec, rt, err = m.creates.spec(ctx, sb)
	}
	if err != nil {
		return api.Sandbox{}, err
	}
	mv, ok := rt.(runtime.Mover)
	if !ok {
		return api.Sandbox{}, runtime.NotSupported(rt.Name(), "move", "its suspended sandboxes cannot leave their host")
	}
	inst, err := mv.Import(ctx, spec, dir)
	if err != nil {
		return api.Sandbox{}, err
	}
	sb.UpdatedAt = time.Now().UTC()
	sb.Error = ""
	sb.OperationID = ""
	if err := m.cfg.DB.PutSandbox(ctx, sb); err != nil {
		_ = inst.Destroy(context.WithoutCancel(ctx))
		return api.Sandbox{}, err
	}
	e.cmu.Lock()
	e.inst = inst
	e.cmu.Unlock()
	m.log.Info("imported a suspended sandbox", "sandbox", sb.ID, "from", dir)
	return sb, nil
}
