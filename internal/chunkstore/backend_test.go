package chunkstore

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"slices"
	"sort"
	"sync"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

// TestBackendContract is the suite every Backend passes.
func TestBackendContract(t *testing.T) {
	forBackends(t, func(t *testing.T, b testBackend) {
		ctx := context.Background()
		created, err := b.PutIfAbsent(ctx, "chunks/aa/one", []byte("first"))
		if err != nil || !created {
			t.Fatalf("PutIfAbsent: %v %v", created, err)
		}
		created, err = b.PutIfAbsent(ctx, "chunks/aa/one", []byte("second"))
		if err != nil || created {
			t.Fatalf("PutIfAbsent of an existing key: %v %v", created, err)
		}
		got, err := b.Get(ctx, "chunks/aa/one")
		if err != nil || string(got) != "first" {
			t.Fatalf("Get: %q %v; an existing key was replaced", got, err)
		}
		got[0] = 'X'
		if again, _ := b.Get(ctx, "chunks/aa/one"); string(again) != "first" {
			t.Fatal("Get returned the stored slice")
		}
		if in, err := b.Stat(ctx, "chunks/aa/one"); err != nil || in.Size != 5 || in.Key != "chunks/aa/one" {
			t.Fatalf("Stat: %+v %v", in, err)
		}
		if _, err := b.Get(ctx, "chunks/aa/none"); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("Get of a missing key: %v", err)
		}
		if _, err := b.Stat(ctx, "chunks/zz/none"); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("Stat of a missing key: %v", err)
		}

		for _, k := range []string{"chunks/ab/two", "manifests/m.json", "manifestsX/y"} {
			if _, err := b.PutIfAbsent(ctx, k, []byte(k)); err != nil {
				t.Fatal(err)
			}
		}
		list := func(prefix string) []string {
			var keys []string
			if err := b.List(ctx, prefix, func(in Info) error {
				keys = append(keys, in.Key)
				return nil
			}); err != nil {
				t.Fatalf("List(%q): %v", prefix, err)
			}
			sort.Strings(keys)
			return keys
		}
		for prefix, want := range map[string][]string{
			"chunks/":     {"chunks/aa/one", "chunks/ab/two"},
			"chunks/a":    {"chunks/aa/one", "chunks/ab/two"},
			"chunks/ab/":  {"chunks/ab/two"},
			"manifests/":  {"manifests/m.json"},
			"manifests":   {"manifests/m.json", "manifestsX/y"},
			"nothing/":    nil,
			"chunks/zz/t": nil,
		} {
			if got := list(prefix); !slices.Equal(got, want) {
				t.Errorf("List(%q) = %v, want %v", prefix, got, want)
			}
		}
		stop := errors.New("stop")
		if err := b.List(ctx, "chunks/", func(Info) error { return stop }); err != stop {
			t.Errorf("List does not return fn's error: %v", err)
		}

		if err := b.Delete(ctx, "chunks/ab/two"); err != nil {
			t.Fatal(err)
		}
		if err := b.Delete(ctx, "chunks/ab/two"); err != nil {
			t.Fatalf("Delete of a missing key: %v", err)
		}
		if _, err := b.Stat(ctx, "chunks/ab/two"); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("after Delete: %v", err)
		}

		for _, k := range []string{"", "/a", "a/", "a//b", "../a", "a/../b", "a/./b", ".tmp-x", "a/.tmp-y", "a\\b", "a\x00b"} {
			if _, err := b.PutIfAbsent(ctx, k, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("PutIfAbsent(%q): %v", k, err)
			}
			if _, err := b.Get(ctx, k); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Get(%q): %v", k, err)
			}
			if _, err := b.Stat(ctx, k); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Stat(%q): %v", k, err)
			}
			if err := b.Delete(ctx, k); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Delete(%q): %v", k, err)
			}
		}
	})
}

// TestBackendPutIfAbsentRace: of concurrent writers of one key exactly one
// creates it, and readers see one writer's whole blob.
func TestBackendPutIfAbsentRace(t *testing.T) {
	forBackends(t, func(t *testing.T, b testBackend) {
		ctx := context.Background()
		const n = 8
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			winners []int
		)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				created, err := b.PutIfAbsent(ctx, "manifests/race.json", bytes.Repeat([]byte{byte(i)}, 64*kiB))
				if err != nil {
					t.Error(err)
				}
				if created {
					mu.Lock()
					winners = append(winners, i)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		if len(winners) != 1 {
			t.Fatalf("%d writers created the key", len(winners))
		}
		got, err := b.Get(ctx, "manifests/race.json")
		if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{byte(winners[0])}, 64*kiB)) {
			t.Fatalf("read %d bytes, not writer %d's blob: %v", len(got), winners[0], err)
		}
	})
}
