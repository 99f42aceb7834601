package runtime

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestProbeCache(t *testing.T) {
	dir := t.TempDir()
	key := "k1"
	disk := ProbeDisk{
		Key: func() (string, error) { return key, nil },
		Files: func(k string) []string {
			return []string{filepath.Join(dir, "a", "probe.json"), filepath.Join(dir, "b-"+k+".json")}
		},
	}
	calls := 0
	ok := func(context.Context) (Capabilities, bool) {
		calls++
		return Capabilities{Available: true, Strength: 7}, true
	}

	// Measured once, memoized, kept in every file.
	var p ProbeCache
	if c := p.Get(context.Background(), disk, ok); !c.Available || c.Details["probe_cached"] != "" {
		t.Fatalf("first Get: %+v", c)
	}
	p.Get(context.Background(), disk, ok)
	if calls != 1 {
		t.Fatalf("measured %d times, want 1", calls)
	}
	for _, f := range disk.Files(key) {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("not kept: %v", err)
		}
	}

	// Another process (a new cache) reads the kept result.
	var p2 ProbeCache
	if c := p2.Get(context.Background(), disk, ok); c.Strength != 7 || c.Details["probe_cached"] != "true" || calls != 1 {
		t.Fatalf("kept result: %+v (measured %d times)", c, calls)
	}
	// From the second file when the first is gone.
	os.Remove(disk.Files(key)[0])
	var p3 ProbeCache
	if c := p3.Get(context.Background(), disk, ok); c.Details["probe_cached"] != "true" || calls != 1 {
		t.Fatalf("kept result from the second file: %+v (measured %d times)", c, calls)
	}

	// Another key: measured again.
	key = "k2"
	var p4 ProbeCache
	if c := p4.Get(context.Background(), disk, ok); c.Details["probe_cached"] != "" || calls != 2 {
		t.Fatalf("after a key change: %+v (measured %d times)", c, calls)
	}

	// A failure is memoized but never kept; a result that is not final is
	// not memoized either.
	key = "k3"
	fail := func(context.Context) (Capabilities, bool) {
		calls++
		return Capabilities{Reason: "no"}, true
	}
	var p5 ProbeCache
	p5.Get(context.Background(), disk, fail)
	p5.Get(context.Background(), disk, fail)
	if calls != 3 {
		t.Fatalf("a failure measured %d times in one cache, want once", calls-2)
	}
	if _, err := os.Stat(disk.Files(key)[1]); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a failed result was kept: %v", err)
	}
	cut := func(context.Context) (Capabilities, bool) {
		calls++
		return Capabilities{Reason: "cancelled"}, false
	}
	var p6 ProbeCache
	p6.Get(context.Background(), disk, cut)
	if c := p6.Get(context.Background(), disk, ok); !c.Available || calls != 5 {
		t.Fatalf("after a result that was not final: %+v (measured %d times, want 5)", c, calls)
	}

	// No disk: memoized only.
	var p7 ProbeCache
	p7.Get(context.Background(), ProbeDisk{}, ok)
	if c := p7.Get(context.Background(), ProbeDisk{}, ok); c.Details["probe_cached"] != "" || calls != 6 {
		t.Fatalf("without disk: %+v (measured %d times)", c, calls)
	}
}

func TestProbeKey(t *testing.T) {
	f := filepath.Join(t.TempDir(), "bin")
	if err := os.WriteFile(f, []byte("a"), 0o600); err != nil {
		t.Fatal(err)
	}
	k1, err := ProbeKey("x=1\n", f)
	if err != nil {
		t.Fatal(err)
	}
	if k, _ := ProbeKey("x=1\n", f); k != k1 {
		t.Fatal("ProbeKey is not stable")
	}
	if k, _ := ProbeKey("x=2\n", f); k == k1 {
		t.Fatal("ProbeKey ignores params")
	}
	if err := os.WriteFile(f, []byte("ab"), 0o600); err != nil {
		t.Fatal(err)
	}
	if k, _ := ProbeKey("x=1\n", f); k == k1 {
		t.Fatal("ProbeKey ignores a changed file")
	}
	if _, err := ProbeKey("", filepath.Join(t.TempDir(), "none")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}
