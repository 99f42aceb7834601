package chunkstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestGCDeletesExactlyTheUnreferenced(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		clk := newFakeClock()
		s := newSmall(tb, Options{Now: clk.Now})
		dataA := randomBytes(20, 768*kiB)
		dataB := append(bytes.Clone(dataA[:384*kiB]), randomBytes(21, 384*kiB)...) // shares chunks with A
		a, _ := put(t, s, dataA)
		b, _ := put(t, s, dataB)
		c, _ := put(t, s, randomBytes(22, 256*kiB)) // never committed
		d, _ := put(t, s, randomBytes(23, 256*kiB)) // committed, then deleted
		commit(t, s, "a", named("disk", a))
		commit(t, s, "b", named("disk", b))
		commit(t, s, "d", named("disk", d))
		if err := s.Delete(ctx, "d"); err != nil {
			t.Fatal(err)
		}
		if shared := len(keysOf(a)) + len(keysOf(b)) - len(keysOf(a, b)); shared == 0 {
			t.Fatal("a and b share no chunk; the test needs some")
		}
		all := keysOf(a, b, c, d)
		if got := chunkKeys(t, tb); !slices.Equal(got, all) {
			t.Fatalf("before GC: %d chunks, want %d", len(got), len(all))
		}

		// Leases still run: nothing is deleted.
		st, err := s.GC(ctx)
		if err != nil {
			t.Fatal(err)
		}
		unref := len(all) - len(keysOf(a, b))
		if st.Deleted != 0 || st.Spared != unref || st.Manifests != 2 || st.Referenced != len(keysOf(a, b)) {
			t.Fatalf("GC within the lease: %+v, want %d spared", st, unref)
		}

		clk.Advance(2 * time.Hour)
		st, err = s.GC(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got := chunkKeys(t, tb); !slices.Equal(got, keysOf(a, b)) || st.Deleted != unref {
			t.Fatalf("after GC: %d chunks left (want %d), stats %+v", len(got), len(keysOf(a, b)), st)
		}
		t.Logf("GC: %+v", st)

		if err := s.Delete(ctx, "b"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.GC(ctx); err != nil {
			t.Fatal(err)
		}
		if got := chunkKeys(t, tb); !slices.Equal(got, keysOf(a)) {
			t.Fatalf("after deleting b: %d chunks, want a's %d", len(got), len(keysOf(a)))
		}
		m, err := s.Open(ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		if err := readBack(s, m.Objects[0], dataA); err != nil {
			t.Fatalf("a after GC: %v", err)
		}
		if err := s.Delete(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if st, err := s.GC(ctx); err != nil || len(chunkKeys(t, tb)) != 0 {
			t.Fatalf("after deleting everything: %+v %v, %d chunks left", st, err, len(chunkKeys(t, tb)))
		}
	})
}

// TestGCSparesACommitDuringGC commits a Put's object while a GC is between
// its mark and its sweep. Leases are made to expire at once, so what
// protects the chunks is Commit's hold and the running GC's spare set.
func TestGCSparesACommitDuringGC(t *testing.T) {
	for _, pause := range []string{"before listing chunks", "after listing chunks"} {
		t.Run(pause, func(t *testing.T) {
			forBackends(t, func(t *testing.T, tb testBackend) {
				ctx := context.Background()
				paused, resume := make(chan struct{}), make(chan struct{})
				hook := func() { close(paused); <-resume }
				hb := &hookBackend{Backend: tb, before: map[string]func(){}, after: map[string]func(){}}
				if pause == "before listing chunks" {
					hb.before[chunkPrefix] = hook
				} else {
					hb.after[chunkPrefix] = hook
				}
				s := newSmall(hb, Options{LeaseTTL: time.Nanosecond})
				data := randomBytes(30, 512*kiB)
				obj, _ := put(t, s, data)
				time.Sleep(time.Millisecond) // the lease has run out

				type result struct {
					st  GCStats
					err error
				}
				done := make(chan result)
				go func() {
					st, err := s.GC(ctx)
					done <- result{st, err}
				}()
				<-paused
				commit(t, s, "late", named("disk", obj))
				close(resume)
				r := <-done
				if r.err != nil {
					t.Fatal(r.err)
				}
				if r.st.Deleted != 0 || r.st.Spared != len(keysOf(obj)) {
					t.Fatalf("GC during the commit: %+v", r.st)
				}
				m, err := s.Open(ctx, "late")
				if err != nil {
					t.Fatal(err)
				}
				if err := readBack(s, m.Objects[0], data); err != nil {
					t.Fatalf("committed during GC, then: %v", err)
				}
			})
		})
	}
}

// TestCommitAfterLeaseRanOut: a GC that swept a Put's chunks before its
// Commit makes the Commit fail naming a chunk; no manifest appears.
func TestCommitAfterLeaseRanOut(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		clk := newFakeClock()
		s := newSmall(tb, Options{Now: clk.Now})
		obj, _ := put(t, s, randomBytes(31, 384*kiB))
		clk.Advance(2 * time.Hour)
		if st, err := s.GC(ctx); err != nil || st.Deleted != len(keysOf(obj)) {
			t.Fatalf("GC: %+v %v", st, err)
		}
		err := s.Commit(ctx, "slow", Manifest{Objects: []Object{named("disk", obj)}})
		var ce *ChunkError
		if !errors.Is(err, ErrMissing) || !errors.As(err, &ce) || ce.Manifest != "slow" {
			t.Fatalf("Commit after its chunks were swept: %v", err)
		}
		if names, _ := s.List(ctx); len(names) != 0 {
			t.Fatalf("visible: %v", names)
		}
	})
}

// TestGCConcurrentWithCheckpoints runs Put, Commit, read and Delete in
// several goroutines against a GC loop (run with -race). Data is drawn from
// a small pool, so Puts keep finding chunks GC is about to delete.
func TestGCConcurrentWithCheckpoints(t *testing.T) {
	base := randomBytes(40, 384*kiB)
	pool := [][]byte{
		base,
		append(bytes.Clone(base[:192*kiB]), randomBytes(41, 192*kiB)...),
		randomBytes(42, 384*kiB),
		sparseBytes(43, 384*kiB),
		randomBytes(44, 384*kiB),
		append(bytes.Clone(base[192*kiB:]), randomBytes(45, 192*kiB)...),
	}
	// "leases hold": the clock stands still, so every Put's lease outlives
	// the test and no Commit may fail. "leases run out": each GC moves the
	// clock on by a third of the lease, so chunks of deleted manifests are
	// swept while other Puts find them again. "no leases": they expire at
	// once, and only Commit's holds protect anything.
	for _, leases := range []string{"leases hold", "leases run out", "no leases"} {
		t.Run(leases, func(t *testing.T) {
			forBackends(t, func(t *testing.T, tb testBackend) {
				ctx := context.Background()
				clk := newFakeClock()
				o := Options{Now: clk.Now}
				if leases == "no leases" {
					o = Options{LeaseTTL: time.Nanosecond}
				}
				s := newSmall(tb, o)
				var deleted atomic.Int64
				const workers, rounds = 3, 6
				var (
					wg        sync.WaitGroup
					mu        sync.Mutex
					committed = map[string][]byte{}
					failed    int
				)
				stop := make(chan struct{})
				gcDone := make(chan error)
				go func() {
					for {
						select {
						case <-stop:
							gcDone <- nil
							return
						default:
						}
						st, err := s.GC(ctx)
						if err != nil {
							gcDone <- err
							return
						}
						deleted.Add(int64(st.Deleted))
						if leases == "leases run out" {
							clk.Advance(20 * time.Minute)
						}
						time.Sleep(200 * time.Microsecond) // keep the CPU for the writers too
					}
				}()
				for w := range workers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						last := ""
						// Past the set rounds until some GC has deleted
						// something, so the run tests the sweep.
						for i := 0; i < rounds || leases != "leases hold" && deleted.Load() == 0 && i < 100; i++ {
							data := pool[(w+i)%len(pool)]
							obj, _, err := s.Put(ctx, bytes.NewReader(data))
							if err != nil {
								t.Error(err)
								return
							}
							name := fmt.Sprintf("w%d-%d", w, i)
							err = s.Commit(ctx, name, Manifest{Objects: []Object{named("disk", obj)}})
							if errors.Is(err, ErrMissing) && leases != "leases hold" {
								mu.Lock()
								failed++
								mu.Unlock()
								continue
							}
							if err != nil {
								t.Error(err)
								return
							}
							m, err := s.Open(ctx, name)
							if err != nil {
								t.Error(err)
								return
							}
							if err := readBack(s, m.Objects[0], data); err != nil {
								t.Errorf("%s read back wrong: %v", name, err)
								return
							}
							mu.Lock()
							committed[name] = data
							mu.Unlock()
							// Each worker keeps its latest checkpoint only.
							if last != "" {
								if err := s.Delete(ctx, last); err != nil {
									t.Error(err)
								}
								mu.Lock()
								delete(committed, last)
								mu.Unlock()
							}
							last = name
						}
					}()
				}
				wg.Wait()
				close(stop)
				if err := <-gcDone; err != nil {
					t.Fatal(err)
				}
				if leases == "leases hold" && failed != 0 {
					t.Fatalf("%d commits failed with leases on", failed)
				}
				// Every committed manifest still reads back whole.
				for name, data := range committed {
					m, err := s.Open(ctx, name)
					if err != nil {
						t.Fatal(err)
					}
					if err := readBack(s, m.Objects[0], data); err != nil {
						t.Fatalf("%s after the GCs: %v", name, err)
					}
				}
				t.Logf("%d manifests kept, %d commits refused for swept chunks, %d chunks deleted during the run",
					len(committed), failed, deleted.Load())
				if leases != "leases hold" && deleted.Load() == 0 {
					t.Fatal("no GC deleted anything during the run: the test tested nothing")
				}
				// And when nothing is referenced any more, nothing stays.
				for name := range committed {
					if err := s.Delete(ctx, name); err != nil {
						t.Fatal(err)
					}
				}
				clk.Advance(2 * time.Hour)
				if _, err := s.GC(ctx); err != nil {
					t.Fatal(err)
				}
				if left := chunkKeys(t, tb); len(left) != 0 {
					t.Fatalf("%d chunks left with no manifest", len(left))
				}
			})
		})
	}
}

// TestGCAfterCrashMidSweep: a GC that dies after a few deletes leaves the
// committed data whole, and the next one (a restarted server's) finishes.
func TestGCAfterCrashMidSweep(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		clk := newFakeClock()
		hb := &hookBackend{Backend: tb}
		s := newSmall(hb, Options{Now: clk.Now})
		keep := randomBytes(50, 512*kiB)
		kept, _ := put(t, s, keep)
		commit(t, s, "keep", named("disk", kept))
		gone, _ := put(t, s, randomBytes(51, 768*kiB))
		commit(t, s, "gone", named("disk", gone))
		if err := s.Delete(ctx, "gone"); err != nil {
			t.Fatal(err)
		}
		clk.Advance(2 * time.Hour)
		hb.failDeletesAfter = hb.deletes + 2
		st, err := s.GC(ctx)
		if !errors.Is(err, errCrash) || st.Deleted != 2 {
			t.Fatalf("crashing GC: %+v %v", st, err)
		}

		s2 := New(tb, Options{}) // restarted: no leases
		st, err = s2.GC(ctx)
		if err != nil || st.Deleted != len(keysOf(gone))-2 {
			t.Fatalf("GC after the crash: %+v %v", st, err)
		}
		if got := chunkKeys(t, tb); !slices.Equal(got, keysOf(kept)) {
			t.Fatalf("%d chunks left, want %d", len(got), len(keysOf(kept)))
		}
		m, err := s2.Open(ctx, "keep")
		if err != nil {
			t.Fatal(err)
		}
		if err := readBack(s2, m.Objects[0], keep); err != nil {
			t.Fatalf("kept data: %v", err)
		}
		if st, err := s2.GC(ctx); err != nil || st.Deleted != 0 {
			t.Fatalf("GC again: %+v %v", st, err)
		}
	})
}

// TestReaderHoldsItsChunks: an open Reader's chunks survive a GC after the
// manifest was deleted, until it is closed.
func TestReaderHoldsItsChunks(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		clk := newFakeClock()
		s := newSmall(tb, Options{Now: clk.Now})
		data := randomBytes(60, 384*kiB)
		obj, _ := put(t, s, data)
		commit(t, s, "cp", named("disk", obj))
		m, _ := s.Open(ctx, "cp")
		r := s.Reader(ctx, m.Objects[0])
		if err := s.Delete(ctx, "cp"); err != nil {
			t.Fatal(err)
		}
		clk.Advance(2 * time.Hour)
		if st, err := s.GC(ctx); err != nil || st.Deleted != 0 {
			t.Fatalf("GC during a read: %+v %v", st, err)
		}
		var got bytes.Buffer
		if _, err := got.ReadFrom(r); err != nil || !bytes.Equal(got.Bytes(), data) {
			t.Fatalf("read: %v", err)
		}
		r.Close()
		if st, err := s.GC(ctx); err != nil || st.Deleted != len(keysOf(obj)) {
			t.Fatalf("GC after Close: %+v %v", st, err)
		}
	})
}

// TestCrashLeftoversIgnoredAndCleaned: temporary files a killed server
// left (a half-written chunk, a half-written manifest, one linked but not
// yet removed) are never listed and GC removes them once old; a young one,
// perhaps a write in progress, stays.
func TestCrashLeftoversIgnoredAndCleaned(t *testing.T) {
	ctx := context.Background()
	tb := newDirTest(t)
	s := newSmall(tb.dir, Options{}) // the Dir itself: a wrapper would hide its TempCleaner
	data := randomBytes(70, 512*kiB)
	obj, _ := put(t, s, data)
	commit(t, s, "cp", named("disk", obj))
	chunks := chunkKeys(t, tb)

	root := tb.dir.root
	old := time.Now().Add(-2 * time.Hour)
	write := func(rel string, b []byte, mtime time.Time) string {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, mtime, mtime); err != nil {
			t.Fatal(err)
		}
		return p
	}
	halfChunk := write("chunks/ab/.tmp-123", randomBytes(71, 1000), old)
	halfManifest := write("manifests/.tmp-456", []byte(`{"format":1,"name":"half","obj`), old)
	fresh := write("chunks/cd/.tmp-789", []byte("in progress"), time.Now())
	linked := filepath.Join(root, filepath.FromSlash(obj.Chunks[0].ID.key()))
	linkedTmp := filepath.Join(filepath.Dir(linked), ".tmp-999")
	if err := os.Link(linked, linkedTmp); err != nil {
		t.Fatal(err)
	}

	if got := chunkKeys(t, tb); !slices.Equal(got, chunks) {
		t.Fatalf("temporary files listed: %v", got)
	}
	if names, err := s.List(ctx); err != nil || !slices.Equal(names, []string{"cp"}) {
		t.Fatalf("List: %v %v", names, err)
	}
	if _, err := tb.Get(ctx, "chunks/ab/.tmp-123"); err == nil {
		t.Fatal("a temporary file is readable by key")
	}

	// The linked leftover shares the chunk's inode: age it through the chunk.
	if err := os.Chtimes(linked, old, old); err != nil {
		t.Fatal(err)
	}
	st, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.TempRemoved != 3 || st.Deleted != 0 {
		t.Fatalf("GC: %+v, want 3 temporary files removed", st)
	}
	for _, p := range []string{halfChunk, halfManifest, linkedTmp} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("%s still there: %v", p, err)
		}
	}
	if _, err := os.Lstat(fresh); err != nil {
		t.Fatalf("a young temporary file was removed: %v", err)
	}
	m, err := s.Open(ctx, "cp")
	if err != nil {
		t.Fatal(err)
	}
	if err := readBack(s, m.Objects[0], data); err != nil {
		t.Fatalf("data after cleaning: %v", err)
	}
}
