package sandbox

import (
	"errors"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
)

// fakeCounters are the counters the fake runtime reports: CPU time runs
// at rate cores from start (a restart moves start and resets it).
type fakeCounters struct {
	mu    sync.Mutex
	start time.Time
	rate  float64
	st    runtime.Stats
}

func (c *fakeCounters) stats(string) runtime.Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.st
	s.CPUNanos = int64(float64(time.Since(c.start).Nanoseconds()) * c.rate)
	return s
}

func (c *fakeCounters) set(f func(*fakeCounters)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f(c)
}

// TestStatsRateAndLimits drives Manager.Stats over counters it controls:
// the CPU rate from a first 200 ms double sample, then since the previous
// sample, the reuse of a too recent one, a counter reset, the limits, the
// clamps, and a stopped sandbox's zeros without waking it.
func TestStatsRateAndLimits(t *testing.T) {
	c := &fakeCounters{start: time.Now(), rate: 0.5}
	h := newHarnessWith(t, fakeruntime.Options{Stats: c.stats})
	sb := h.create(api.CreateSandboxRequest{Limits: api.Limits{CPUs: 0.5, MemoryMiB: 64, DiskMiB: 32, Pids: 40}})
	c.set(func(c *fakeCounters) {
		c.st = runtime.Stats{MemoryBytes: 10 << 20, MemoryCacheBytes: 99 << 20, Pids: 3, DiskUsedBytes: 1 << 40}
	})
	near := func(got, want float64) bool { return math.Abs(got-want) < 15 }

	t0 := time.Now()
	st, err := h.m.Stats(h.ctx(), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t0); took < cpuFirstWindow {
		t.Fatalf("first sample took %v: no second sample was taken", took)
	}
	// 0.5 cores busy of a 0.5-core limit: 100 %.
	if !near(st.CPUUsedPct, 100) || st.CPUCount != 0.5 {
		t.Fatalf("first sample: %.1f%% of %g", st.CPUUsedPct, st.CPUCount)
	}
	if st.SandboxID != sb.ID || st.State != api.StateRunning || st.MemTotalBytes != 64<<20 || st.MemUsedBytes != 10<<20 ||
		st.MemCacheBytes != 10<<20 || st.Pids != 3 || st.PidsMax != 40 || st.DiskTotalBytes != 32<<20 || st.DiskUsedBytes != 32<<20 {
		t.Fatalf("sample: %+v", st)
	}
	if st.CPUSeconds <= 0 {
		t.Fatalf("cpu seconds: %+v", st)
	}

	// Right away again: the window would be tiny; the last rate is reused
	// and nothing waits.
	t0 = time.Now()
	st2, err := h.m.Stats(h.ctx(), sb.ID)
	if err != nil || time.Since(t0) > cpuFirstWindow/2 || st2.CPUUsedPct != st.CPUUsedPct {
		t.Fatalf("immediate second sample: %v, took %v, %.1f%% (first %.1f%%)", err, time.Since(t0), st2.CPUUsedPct, st.CPUUsedPct)
	}
	// The counter now runs at 0.05 cores from start, so it went back: a
	// reset (as after a restart), which takes a fresh double sample.
	c.set(func(c *fakeCounters) { c.rate = 0.05 })
	time.Sleep(time.Second)
	if st, err = h.m.Stats(h.ctx(), sb.ID); err != nil || !near(st.CPUUsedPct, 10) {
		t.Fatalf("after a counter reset: %v %.1f%%", err, st.CPUUsedPct)
	}
	time.Sleep(700 * time.Millisecond)
	t0 = time.Now()
	if st, err = h.m.Stats(h.ctx(), sb.ID); err != nil || !near(st.CPUUsedPct, 10) || time.Since(t0) > cpuFirstWindow/2 {
		t.Fatalf("a sample 0.7 s after the last: %v %.1f%% in %v", err, st.CPUUsedPct, time.Since(t0))
	}

	// Unknown and malformed ids (malformed ones name nothing: not found).
	for _, id := range []string{"sb-nope", "../x"} {
		if _, err := h.m.Stats(h.ctx(), id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("stats of %q: %v", id, err)
		}
	}

	// Stopped: state, limits and zeros; still stopped afterwards.
	h.verb(sb.ID, api.OpStop)
	st, err = h.m.Stats(h.ctx(), sb.ID)
	if err != nil || st.State != api.StateStopped || st.CPUUsedPct != 0 || st.MemUsedBytes != 0 || st.Pids != 0 ||
		st.DiskUsedBytes != 0 || st.MemTotalBytes != 64<<20 || st.CPUCount != 0.5 {
		t.Fatalf("stopped: %v %+v", err, st)
	}
	if s := h.state(sb.ID); s != api.StateStopped {
		t.Fatalf("stats woke the sandbox: %s", s)
	}
}
