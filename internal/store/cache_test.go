package store

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// A cached read is the last write, whichever way the record changed, and
// each caller gets its own copy.
func TestSandboxCacheFollowsWrites(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	sb := sandbox("sb1", 0, api.StateCreating, map[string]string{"a": "1"})
	if err := d.PutSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	for _, state := range []string{api.StateRunning, api.StatePaused, api.StateRunning} {
		if _, err := d.GetSandbox(ctx, "sb1"); err != nil { // fills the cache
			t.Fatal(err)
		}
		sb.State = state
		sb.Labels = map[string]string{"state": state}
		if err := d.PutSandbox(ctx, sb); err != nil {
			t.Fatal(err)
		}
		got, err := d.GetSandbox(ctx, "sb1")
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, sb) {
			t.Fatalf("after a write of %s the read is %+v", state, got)
		}
	}

	// Changing what a read returned changes nothing stored or cached.
	got, _ := d.GetSandbox(ctx, "sb1")
	got.Env["A"] = "changed"
	got.Labels["state"] = "changed"
	got.Network.AllowOut[0] = "changed"
	again, _ := d.GetSandbox(ctx, "sb1")
	if again.Env["A"] != "b" || again.Labels["state"] != api.StateRunning || again.Network.AllowOut[0] != "pypi.org:443" {
		t.Fatalf("a caller's change reached the cache: %+v", again)
	}

	if err := d.DeleteSandbox(ctx, "sb1"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.GetSandbox(ctx, "sb1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a deleted sandbox reads %v, want ErrNotFound", err)
	}
	// A failed write leaves no trace in the cache either.
	if err := d.DeleteSandbox(ctx, "sb1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
	if _, err := d.GetSandbox(ctx, "sb1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after a failed delete: %v", err)
	}
}

// A read that began before a write never puts the older record back:
// readers and writers race, and afterwards every read is the last write.
func TestSandboxCacheConcurrentReadersAndWriters(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	sb := sandbox("sb1", 0, api.StateRunning, nil)
	if err := d.PutSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for r := 0; r < 4; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				d.sandboxes.put("sb1", nil) // force reads to miss and fill
				if _, err := d.GetSandbox(ctx, "sb1"); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	for i := 0; i < 200; i++ {
		sb.OperationID = fmt.Sprintf("op-%d", i)
		if err := d.PutSandbox(ctx, sb); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	got, err := d.GetSandbox(ctx, "sb1")
	if err != nil {
		t.Fatal(err)
	}
	if got.OperationID != "op-199" {
		t.Fatalf("cache kept %q after the last write op-199", got.OperationID)
	}
}

// The fill rule itself: a fill carrying the generation of before a write is
// dropped.
func TestRecordCacheStaleFillDropped(t *testing.T) {
	c := newRecordCache()
	_, gen, ok := c.get("x")
	if ok {
		t.Fatal("empty cache hit")
	}
	c.put("x", &api.Sandbox{ID: "x", State: "new"}) // a write lands while the read is in SQLite
	c.fill("x", api.Sandbox{ID: "x", State: "old"}, gen)
	if sb, _, _ := c.get("x"); sb.State != "new" {
		t.Fatalf("cache holds %q, want the write's record", sb.State)
	}
	c.put("x", nil)
	_, gen, _ = c.get("x")
	c.fill("x", api.Sandbox{ID: "x", State: "read"}, gen)
	if sb, _, ok := c.get("x"); !ok || sb.State != "read" {
		t.Fatalf("an undisturbed fill was dropped: %+v %v", sb, ok)
	}
}

// deepCopy shares nothing a caller could change with the original, and
// equals it.
func TestDeepCopySharesNothing(t *testing.T) {
	orig := sandbox("sb1", 0, api.StateRunning, map[string]string{"a": "1"})
	orig.PublicPorts = []int{80}
	want := sandbox("sb1", 0, api.StateRunning, map[string]string{"a": "1"})
	want.PublicPorts = []int{80}
	cp := deepCopy(orig)
	if !reflect.DeepEqual(cp, orig) {
		t.Fatalf("copy differs:\n%+v\n%+v", cp, orig)
	}
	cp.Env["A"] = "x"
	cp.Labels["a"] = "x"
	cp.PublicPorts[0] = 1
	cp.Idle.AfterSeconds = 1
	*cp.ExpiresAt = t0
	cp.Network.AllowOut[0] = "x"
	cp.Network.Rules[0].SetHeaders["X-Key"] = "x"
	cp.Network.Rules[0].Domain = "x"
	if !reflect.DeepEqual(orig, want) {
		t.Fatalf("a change to the copy reached the original:\n%+v", orig)
	}
}
