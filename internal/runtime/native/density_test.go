package native_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/testenv"
)

// descendants is pid and every process below it, from /proc/*/task/*/children.
func descendants(pid int) []int {
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", out[i]))
		for _, f := range tasks {
			data, _ := os.ReadFile(f)
			for _, c := range strings.Fields(string(data)) {
				if n, err := strconv.Atoi(c); err == nil {
					out = append(out, n)
				}
			}
		}
	}
	return out
}

// hostTraces counts what sandboxes leave on the host: mounts and loop
// devices backed by files under dir, and sandbox cgroups.
func hostTraces(t testing.TB, dir string) (mounts, loops, cgroups int) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	real, _ := filepath.EvalSymlinks(dir)
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && (strings.HasPrefix(f[4], dir+"/") || strings.HasPrefix(f[4], real+"/")) {
			mounts++
		}
	}
	backs, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, b := range backs {
		data, _ := os.ReadFile(b)
		if p := strings.TrimSpace(string(data)); strings.HasPrefix(p, dir+"/") || strings.HasPrefix(p, real+"/") {
			loops++
		}
	}
	ents, _ := os.ReadDir("/sys/fs/cgroup/memory/space")
	if len(ents) == 0 {
		ents, _ = os.ReadDir("/sys/fs/cgroup/space")
	}
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), "dens-") {
			cgroups++
		}
	}
	return mounts, loops, cgroups
}

// TestDensity starts SPACE_BENCH_N (default 1000) idle sandboxes with small
// limits, checks each answers Health, reports the host memory they cost and
// checks that destroying them leaves nothing behind. Opt-in: SPACE_BENCH=1.
func TestDensity(t *testing.T) {
	if os.Getenv("SPACE_BENCH") != "1" {
		t.Skip("density benchmark: set SPACE_BENCH=1")
	}
	n := 1000
	if s := os.Getenv("SPACE_BENCH_N"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	rt, spec := benchRuntime(t)
	spec.Limits = api.Limits{CPUs: 1, MemoryMiB: 64, Pids: 64, DiskMiB: 64}
	dir := rt.(*native.Runtime).DataDir()
	ctx := context.Background()

	// Warm the template and the disk pool outside the measurement.
	warm := spec
	warm.ID = "dens-warm"
	if inst, err := rt.Create(ctx, warm); err != nil {
		t.Fatal(err)
	} else if err := inst.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	availBefore := testenv.MemInfo("MemAvailable")

	insts := make([]runtime.Instance, n)
	var mu sync.Mutex
	var startErr error
	var started atomic.Int64
	var total durations
	t0 := time.Now()
	work := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range work {
				s := spec
				s.ID = fmt.Sprintf("dens-%d", k)
				ts := time.Now()
				inst, err := rt.Create(ctx, s)
				if err == nil {
					insts[k] = inst
					err = inst.Start(ctx)
				}
				if err == nil {
					var c interface{ Close() error }
					c, err = firstHealth(ctx, inst)
					if err == nil {
						c.Close()
					}
				}
				mu.Lock()
				total = append(total, time.Since(ts))
				if err != nil && startErr == nil {
					startErr = fmt.Errorf("sandbox %d (after %d started): %w", k, started.Load(), err)
				}
				mu.Unlock()
				if err == nil {
					started.Add(1)
				}
			}
		}()
	}
	for k := 0; k < n; k++ {
		mu.Lock()
		failed := startErr != nil
		mu.Unlock()
		if failed {
			break
		}
		work <- k
		if k%100 == 99 {
			t.Logf("%d started after %v", started.Load(), time.Since(t0).Round(time.Millisecond))
		}
	}
	close(work)
	wg.Wait()
	up := int(started.Load())
	t.Logf("started %d sandboxes in %v; create→healthy p50 %v p99 %v", up, time.Since(t0).Round(time.Millisecond),
		total.pct(0.5).Round(time.Microsecond), total.pct(0.99).Round(time.Microsecond))

	// Idle: let lazy ext4 init and the agents settle, then measure.
	time.Sleep(5 * time.Second)
	availAfter := testenv.MemInfo("MemAvailable")
	var rss, pss, procs int64
	healthy := 0
	for _, inst := range insts {
		if inst == nil {
			continue
		}
		for _, p := range descendants(inst.(interface{ Pid() int }).Pid()) {
			r, s := testenv.Rollup(p)
			rss += r
			pss += s
			procs++
		}
		hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if c, err := firstHealth(hctx, inst); err == nil {
			healthy++
			c.Close()
		}
		cancel()
	}
	if up > 0 {
		t.Logf("%d/%d healthy when idle; %d processes; per sandbox: RSS %d KiB, PSS %d KiB, MemAvailable drop %d KiB",
			healthy, up, procs, rss/int64(up), pss/int64(up), (availBefore-availAfter)/int64(up))
	}
	m, l, c := hostTraces(t, dir)
	t.Logf("host traces while up: %d mounts, %d loop devices, %d cgroups", m, l, c)

	td := time.Now()
	for _, inst := range insts {
		if inst != nil {
			if err := inst.Destroy(ctx); err != nil {
				t.Errorf("destroy %s: %v", inst.ID(), err)
			}
		}
	}
	t.Logf("destroyed %d in %v", up, time.Since(td).Round(time.Millisecond))
	if err := rt.(*native.Runtime).Close(); err != nil {
		t.Error(err)
	}
	if m, l, c := hostTraces(t, dir); m+l+c != 0 {
		t.Errorf("leaked after destroy: %d mounts, %d loop devices, %d cgroups", m, l, c)
	}
	left, _ := os.ReadDir(filepath.Join(dir, "sandboxes"))
	pool, _ := os.ReadDir(filepath.Join(dir, "pool"))
	if len(left)+len(pool) != 0 {
		t.Errorf("leaked %d sandbox dirs and %d pool entries", len(left), len(pool))
	}
	if startErr != nil {
		t.Fatalf("only %d of %d sandboxes started: %v", up, n, startErr)
	}
	if healthy != up {
		t.Fatalf("%d of %d sandboxes did not answer Health when idle", up-healthy, up)
	}
}
