package chunkstore

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const (
	kiB = 1 << 10
	miB = 1 << 20
)

// newSmall is a Store that cuts 16–256 KiB chunks (64 KiB on average), so
// the tests of everything but the chunking itself need little data.
func newSmall(b Backend, o Options) *Store {
	s := New(b, o)
	s.cut = chunking{min: 16 * kiB, max: 256 * kiB, avgBits: 16}
	return s
}

// scale is the data size for a test of the real chunking: n, or an eighth
// of it under the race detector.
func scale(n int) int {
	if raceEnabled {
		return n / 8
	}
	return n
}

// testBackend is a Backend with the test's ways to damage it.
type testBackend struct {
	Backend
	corrupt func(t *testing.T, key string) // flip a byte of the stored blob
	remove  func(t *testing.T, key string)
	dir     *Dir // nil for the in-memory fake
}

// backends are the implementations every Store test runs on.
var backends = []struct {
	name string
	new  func(t *testing.T) testBackend
}{
	{"dir", newDirTest},
	{"mem", newMemTest},
}

func forBackends(t *testing.T, fn func(t *testing.T, tb testBackend)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { fn(t, b.new(t)) })
	}
}

func newDirTest(t *testing.T) testBackend {
	d, err := NewDir(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return testBackend{
		Backend: d,
		dir:     d,
		corrupt: func(t *testing.T, key string) {
			p := filepath.Join(d.root, filepath.FromSlash(key))
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			b[len(b)/2] ^= 0x40
			if err := os.WriteFile(p, b, 0o600); err != nil {
				t.Fatal(err)
			}
		},
		remove: func(t *testing.T, key string) {
			if err := os.Remove(filepath.Join(d.root, filepath.FromSlash(key))); err != nil {
				t.Fatal(err)
			}
		},
	}
}

func newMemTest(t *testing.T) testBackend {
	m := NewMem().(*memBackend)
	return testBackend{
		Backend: m,
		corrupt: func(t *testing.T, key string) {
			m.mu.Lock()
			defer m.mu.Unlock()
			b, ok := m.blobs[key]
			if !ok {
				t.Fatalf("no blob %s", key)
			}
			b[len(b)/2] ^= 0x40
		},
		remove: func(t *testing.T, key string) {
			m.mu.Lock()
			defer m.mu.Unlock()
			if _, ok := m.blobs[key]; !ok {
				t.Fatalf("no blob %s", key)
			}
			delete(m.blobs, key)
		},
	}
}

// randomBytes returns n bytes from a seeded generator.
func randomBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), 1}).Read(b)
	return b
}

// sparseBytes is n bytes of zeros with a few 64 KiB islands of random data,
// as in a mostly empty disk image.
func sparseBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, 7))
	for range 5 {
		off := r.IntN(n - 64*kiB)
		copy(b[off:], randomBytes(seed+uint64(off), 64*kiB))
	}
	return b
}

// fakeClock is Options.Now for tests that expire leases.
type fakeClock struct{ ns atomic.Int64 }

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}

func (c *fakeClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

func put(t *testing.T, s *Store, data []byte) (Object, PutStats) {
	t.Helper()
	obj, st, err := s.Put(context.Background(), bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	return obj, st
}

func commit(t *testing.T, s *Store, name string, objs ...Object) {
	t.Helper()
	if err := s.Commit(context.Background(), name, Manifest{Objects: objs}); err != nil {
		t.Fatal(err)
	}
}

// named returns obj with a name, as a caller sets before Commit.
func named(name string, obj Object) Object {
	obj.Name = name
	return obj
}

// readAll reads obj through its Read method and returns what it got.
func readAll(t *testing.T, s *Store, obj Object) ([]byte, error) {
	t.Helper()
	r := s.Reader(context.Background(), obj)
	defer r.Close()
	return io.ReadAll(r)
}

// readBack streams obj (through its WriteTo) and compares it with want as
// it goes.
func readBack(s *Store, obj Object, want []byte) error {
	r := s.Reader(context.Background(), obj)
	defer r.Close()
	w := &compareWriter{want: want}
	if _, err := io.Copy(w, r); err != nil {
		return err
	}
	if w.off != len(want) {
		return fmt.Errorf("read %d bytes, want %d", w.off, len(want))
	}
	return nil
}

type compareWriter struct {
	want []byte
	off  int
}

func (w *compareWriter) Write(p []byte) (int, error) {
	if len(p) > len(w.want)-w.off || !bytes.Equal(p, w.want[w.off:w.off+len(p)]) {
		return 0, fmt.Errorf("bytes %d to %d differ from what was put", w.off, w.off+len(p))
	}
	w.off += len(p)
	return len(p), nil
}

// chunkKeys returns the keys of the chunks in b, sorted.
func chunkKeys(t *testing.T, b Backend) []string {
	t.Helper()
	var keys []string
	if err := b.List(context.Background(), chunkPrefix, func(in Info) error {
		keys = append(keys, in.Key)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	sort.Strings(keys)
	return keys
}

// keysOf returns the sorted, distinct chunk keys of objs.
func keysOf(objs ...Object) []string {
	var keys []string
	for _, id := range distinct(objs) {
		keys = append(keys, id.key())
	}
	sort.Strings(keys)
	return keys
}

// hookBackend calls before on each List of a prefix, then the real List;
// after runs once the real List has called fn for every key.
type hookBackend struct {
	Backend
	mu     sync.Mutex
	before map[string]func()
	after  map[string]func()
	// failDeletesAfter > 0 makes Delete fail once that many succeeded.
	failDeletesAfter int
	deletes          int
}

func (h *hookBackend) List(ctx context.Context, prefix string, fn func(Info) error) error {
	h.mu.Lock()
	before, after := h.before[prefix], h.after[prefix]
	h.mu.Unlock()
	if before != nil {
		before()
	}
	err := h.Backend.List(ctx, prefix, fn)
	if after != nil {
		after()
	}
	return err
}

func (h *hookBackend) Delete(ctx context.Context, key string) error {
	h.mu.Lock()
	if h.failDeletesAfter > 0 && h.deletes >= h.failDeletesAfter {
		h.mu.Unlock()
		return errCrash
	}
	h.deletes++
	h.mu.Unlock()
	return h.Backend.Delete(ctx, key)
}

var errCrash = errorString("simulated crash")

type errorString string

func (e errorString) Error() string { return string(e) }
