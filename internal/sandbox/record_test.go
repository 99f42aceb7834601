package sandbox

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
)

func TestUpdateRecord(t *testing.T) {
	h := newHarnessWith(t, fakeruntime.Options{})
	id := h.create(api.CreateSandboxRequest{}).ID
	stored := func() api.Sandbox {
		t.Helper()
		sb, err := h.m.cfg.DB.GetSandbox(h.ctx(), id)
		if err != nil {
			t.Fatal(err)
		}
		return sb
	}
	before := stored()

	// No change: nothing written, then still runs under the lock.
	thenRan := false
	sb, err := h.m.updateRecord(h.ctx(), id, "touch", func(*api.Sandbox) (bool, error) { return false, nil },
		func(e *entry, sb api.Sandbox) error {
			if e.mu.TryLock() {
				t.Error("then ran without the sandbox's lock")
				e.mu.Unlock()
			}
			thenRan = true
			return nil
		})
	if err != nil || !thenRan || !sb.UpdatedAt.Equal(before.UpdatedAt) || !stored().UpdatedAt.Equal(before.UpdatedAt) {
		t.Fatalf("no change: %v, then ran %v, updated %v (was %v)", err, thenRan, stored().UpdatedAt, before.UpdatedAt)
	}

	// A change is stamped and written; then sees the record as written.
	sb, err = h.m.updateRecord(h.ctx(), id, "touch", func(sb *api.Sandbox) (bool, error) {
		sb.PublicPorts = []int{8080}
		return true, nil
	}, func(_ *entry, sb api.Sandbox) error {
		if !slices.Equal(sb.PublicPorts, []int{8080}) {
			t.Errorf("then saw %v", sb.PublicPorts)
		}
		return nil
	})
	if err != nil || !slices.Equal(stored().PublicPorts, []int{8080}) || !sb.UpdatedAt.After(before.UpdatedAt) {
		t.Fatalf("change: %v, stored %v, updated %v", err, stored().PublicPorts, sb.UpdatedAt)
	}

	// change's error: nothing written, then not run.
	boom := errors.New("boom")
	if _, err := h.m.updateRecord(h.ctx(), id, "touch", func(sb *api.Sandbox) (bool, error) {
		sb.PublicPorts = nil
		return true, boom
	}, func(*entry, api.Sandbox) error { t.Error("then ran after change failed"); return nil }); !errors.Is(err, boom) {
		t.Fatalf("change error: %v", err)
	}
	if !slices.Equal(stored().PublicPorts, []int{8080}) {
		t.Fatalf("a failed change was written: %v", stored().PublicPorts)
	}

	// then's error comes back with the record as stored.
	sb, err = h.m.updateRecord(h.ctx(), id, "touch", func(*api.Sandbox) (bool, error) { return false, nil },
		func(*entry, api.Sandbox) error { return boom })
	if !errors.Is(err, boom) || sb.ID != id {
		t.Fatalf("then error: %v, record %q", err, sb.ID)
	}

	// A sandbox being deleted is refused, naming what could not be done.
	del := stored()
	del.State = api.StateDeleting
	if err := h.m.cfg.DB.PutSandbox(h.ctx(), del); err != nil {
		t.Fatal(err)
	}
	_, err = h.m.updateRecord(h.ctx(), id, "touch", func(*api.Sandbox) (bool, error) {
		t.Error("change ran on a sandbox being deleted")
		return false, nil
	}, nil)
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "cannot touch it") {
		t.Fatalf("deleting: %v", err)
	}

	if _, err := h.m.updateRecord(h.ctx(), "sb-nosuchsandbox1", "touch", func(*api.Sandbox) (bool, error) { return true, nil }, nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown id: %v", err)
	}
}

func TestSetPortPublic(t *testing.T) {
	h := newHarnessWith(t, fakeruntime.Options{})
	id := h.create(api.CreateSandboxRequest{}).ID
	for _, c := range []struct {
		port   int
		public bool
		want   []int
	}{
		{8080, true, []int{8080}},
		{3000, true, []int{3000, 8080}},
		{3000, true, []int{3000, 8080}},
		{8080, false, []int{3000}},
		{9999, false, []int{3000}},
		{3000, false, nil},
	} {
		sb, err := h.m.net.SetPortPublic(h.ctx(), id, c.port, c.public)
		if err != nil || !slices.Equal(sb.PublicPorts, c.want) || (c.want == nil) != (sb.PublicPorts == nil) {
			t.Fatalf("port %d public %v: %v %v, want %v", c.port, c.public, err, sb.PublicPorts, c.want)
		}
		if rec, _ := h.m.Get(h.ctx(), id); !slices.Equal(rec.PublicPorts, c.want) {
			t.Fatalf("port %d public %v: stored %v, want %v", c.port, c.public, rec.PublicPorts, c.want)
		}
	}
	if _, err := h.m.net.SetPortPublic(h.ctx(), id, 0, true); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("port 0: %v", err)
	}
}
