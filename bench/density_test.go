package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
)

// procsOf lists the pids in a sandbox's cgroup (v1 pids hierarchy or v2).
func procsOf(id string) []int {
	for _, p := range []string{"/sys/fs/cgroup/pids/space/" + id + "/cgroup.procs", "/sys/fs/cgroup/space/" + id + "/cgroup.procs"} {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		var out []int
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
		return out
	}
	return nil
}

// TestIdleDensity creates SPACE_BENCH_IDLE (default 1000) idle sandboxes and
// reports host memory per sandbox three ways: RSS and PSS of every process in
// the sandboxes' cgroups, and the drop of MemAvailable (which also counts
// kernel memory: mounts, namespaces, page cache). Opt-in: SPACE_BENCH=1.
func TestIdleDensity(t *testing.T) {
	if os.Getenv("SPACE_BENCH") != "1" {
		t.Skip("benchmark; run with SPACE_BENCH=1 (make bench)")
	}
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("SPACE_BENCH_IDLE")); err == nil && v > 0 {
		n = v
	}
	h := start(t)
	ctx := context.Background()
	before := testenv.MemInfo("MemAvailable")
	var ids []string
	var mu sync.Mutex
	var failed atomic.Int64
	var firstErr atomic.Value
	t0 := time.Now()
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			sb, err := h.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native", Limits: api.Limits{MemoryMiB: 64, DiskMiB: 64, Pids: 64}})
			if err != nil {
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
				return
			}
			mu.Lock()
			ids = append(ids, sb.ID)
			mu.Unlock()
		}()
	}
	wg.Wait()
	elapsed := time.Since(t0)
	time.Sleep(2 * time.Second) // let agents settle into idle
	var rss, pss, procs int64
	for _, id := range ids {
		for _, pid := range procsOf(id) {
			r, p := testenv.Rollup(pid)
			rss += r
			pss += p
			procs++
		}
	}
	after := testenv.MemInfo("MemAvailable")
	ok := int64(len(ids))
	if ok == 0 {
		t.Fatalf("no sandbox started: %v", firstErr.Load())
	}
	fmt.Printf("idle density: %d/%d sandboxes running (%d failed; first error: %v) in %s\n", ok, n, failed.Load(), firstErr.Load(), elapsed.Round(time.Millisecond))
	fmt.Printf("  processes: %d; per sandbox: RSS %.2f MiB, PSS %.2f MiB, MemAvailable drop %.2f MiB\n",
		procs, float64(rss)/1024/float64(ok), float64(pss)/1024/float64(ok), float64(before-after)/1024/float64(ok))
	// Still alive and answering after all were created?
	res, err := h.client.Exec(ctx, ids[0], api.ExecRequest{Cmd: []string{"true"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("first sandbox no longer answers: %v", err)
	}
}
