package sandbox

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// SetCreated hears of every sandbox a caller makes — creates and a fork's
// children — and a refusal deletes the sandbox and fails the call.
func TestCreatedHookHearsCreatesAndForkChildren(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	var mu sync.Mutex
	var heard []string
	refuse := ""
	h.m.creates.SetCreated(func(ctx context.Context, sb api.Sandbox, op api.Operation, req api.CreateSandboxRequest) error {
		mu.Lock()
		defer mu.Unlock()
		if sb.Labels["refuse"] != "" || refuse == sb.ID {
			return errors.New("no row for you")
		}
		heard = append(heard, sb.ID+"/"+op.Kind)
		return nil
	})
	parent := h.create(api.CreateSandboxRequest{})
	op, err := h.m.verbs.Fork(h.ctx(), parent.ID, api.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	h.wait(op)
	mu.Lock()
	want := []string{parent.ID + "/" + api.OpCreate, op.Children[0] + "/" + api.OpFork, op.Children[1] + "/" + api.OpFork}
	if !slices.Equal(heard, want) {
		t.Fatalf("heard %v, want %v", heard, want)
	}
	mu.Unlock()

	_, _, err = h.m.creates.Create(h.ctx(), api.CreateSandboxRequest{Labels: map[string]string{"refuse": "1"}})
	if err == nil || err.Error() != "no row for you" {
		t.Fatalf("a refused create: %v", err)
	}
	// The refused sandbox is deleted (after its create, which the delete
	// waits for).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		all, _ := h.m.List(h.ctx(), "", map[string]string{"refuse": "1"})
		if len(all) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a refused sandbox is left: %+v", all)
		}
	}
	h.m.creates.SetCreated(nil)
	sb := h.create(api.CreateSandboxRequest{Labels: map[string]string{"refuse": "1"}})
	if _, err := h.m.Get(h.ctx(), sb.ID); errors.Is(err, errdefs.ErrNotFound) {
		t.Fatal("with no hook a create is its own business")
	}
}

// A runtime that cannot move its suspended sandboxes refuses to export
// them, and only a suspended sandbox is exported.
func TestExportRefusals(t *testing.T) {
	h := newHarnessWith(t, suspendFork)
	sb := h.create(api.CreateSandboxRequest{})
	dir := t.TempDir()
	if err := h.m.verbs.ExportSuspended(h.ctx(), sb.ID, dir+"/x"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("export of a running sandbox: %v", err)
	}
	op, err := h.m.verbs.Lifecycle(h.ctx(), sb.ID, api.OpSuspend, false)
	if err != nil {
		t.Fatal(err)
	}
	h.wait(op)
	if err := h.m.verbs.ExportSuspended(h.ctx(), sb.ID, dir+"/x"); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Fatalf("export on a runtime that cannot move: %v", err)
	}
	if _, err := h.m.verbs.ImportSuspended(h.ctx(), dir+"/nothing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("import of nothing: %v", err)
	}
}
