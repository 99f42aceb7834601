package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// TestPoolBench measures warm pools (issue 14) through the API:
//
//   - pool hit: create → operation done → exec `true` returned, per
//     runtime and idle mode (running, paused), SPACE_BENCH_POOL_N (200)
//     iterations on native and gvisor, SPACE_BENCH_POOL_MICROVM_N (10) on
//     microvm, interleaved with the raw tool doing the same work in the
//     same run (`bwrap --unshare-all true`; raw `runsc run` of /bin/true);
//     the pool is refilled between iterations, untimed, so each is a hit;
//   - host memory per idle member: PSS of its host processes and the drop
//     of MemAvailable over 3 members, next to the latency it buys;
//   - 100 concurrent creates from an empty native pool: none fails, and
//     the time until the pool is back at its target.
//
// SPACE_BENCH_POOL_RUNTIMES=native,gvisor limits the runtimes measured.
func TestPoolBench(t *testing.T) {
	requireBench(t)
	testenv.RequireRoot(t)
	rootfs := testenv.BaseRootfs(t)
	gv := newGVBench(t)
	s, c, _ := serve(t, server.NetworkOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	// Warm: imports the base template.
	if sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"}); err != nil {
		t.Fatal(err)
	} else if op, err := c.DeleteSandbox(ctx, sb.ID, true); err == nil {
		c.WaitOperation(ctx, op.ID)
	}
	// The raw runsc bundle runs /bin/true from a sandbox's own config.
	inst, ac, err := gv.start(ctx, newSpecID("w-"))
	if err != nil {
		t.Fatal(err)
	}
	ac.Close()
	trueBundle := gv.rawBundle(t, inst, "raw-true", []string{"/bin/true"})
	inst.Destroy(ctx)
	raws := map[string]func() error{
		"native": func() error { return bwrapTrue(rootfs) },
		"gvisor": func() error {
			rid := newSpecID("r-")
			defer gv.raw(ctx, "delete", "--force", rid)
			_, err := gv.raw(ctx, "run", "--bundle", trueBundle, rid)
			return err
		},
	}
	rawName := map[string]string{"native": "bwrap --unshare-all true", "gvisor": "runsc run true"}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		rt, mode           string
		n, hits            int
		hit, raw           samples
		create, claimPhase samples
		exec1              samples // the first exec of true, from the create's end
		exec2              samples // a second exec of true: the exec path alone, warm
		pssKiB, availKiB   int64
		members            int
		refill             float64
		rawLabel           string
	}
	for _, ri := range info.Runtimes {
		if only := os.Getenv("SPACE_BENCH_POOL_RUNTIMES"); only != "" && !slices.Contains(strings.Split(only, ","), ri.Name) {
			continue
		}
		if !ri.Available {
			fmt.Printf("pool bench: %s not available here: %s\n", ri.Name, ri.Reason)
			continue
		}
		n := envInt("SPACE_BENCH_POOL_N", 200)
		if ri.Name == "microvm" {
			n = envInt("SPACE_BENCH_POOL_MICROVM_N", 10)
		}
		modes := []string{api.PoolIdleRunning}
		if ri.Verbs[api.OpPause] {
			modes = append(modes, api.PoolIdlePaused)
		}
		for _, mode := range modes {
			r := row{rt: ri.Name, mode: mode, n: n, rawLabel: rawName[ri.Name]}
			spec := api.PoolSpec{Template: "base:latest", Runtime: ri.Name, Min: 0, Max: 0, IdleMode: mode}
			// Memory: MemAvailable with no member, then with 3.
			settle := func() { time.Sleep(2 * time.Second) }
			settle()
			avail0 := testenv.MemInfo("MemAvailable")
			spec.Min, spec.Max = 3, 3
			p, err := c.SetPool(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			waitReady(t, ctx, c, p.ID, 3)
			settle()
			r.availKiB = (avail0 - testenv.MemInfo("MemAvailable")) / 3
			members := s.Manager().WarmPools().PoolMembers(p.ID)
			for _, id := range members {
				pids := append(procsOf(id), hostProcs(id)...)
				slices.Sort(pids)
				r.pssKiB += pssKiB(slices.Compact(pids))
			}
			r.members = len(members)
			r.pssKiB /= int64(max(1, len(members)))
			spec.Min, spec.Max = 1, 1
			if _, err := c.SetPool(ctx, spec); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < n; i++ {
				waitReady(t, ctx, c, p.ID, 1)
				if raw := raws[ri.Name]; raw != nil {
					t0 := time.Now()
					if err := raw(); err != nil {
						t.Fatalf("raw %s: %v", ri.Name, err)
					}
					r.raw = append(r.raw, time.Since(t0))
				}
				t0 := time.Now()
				// One round trip, as the SDK's CreateSandboxAndWait makes it
				// (kept here for the operation's phases).
				resp, err := c.CreateSandboxWait(ctx, api.CreateSandboxRequest{Runtime: ri.Name}, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				op := &resp.Operation
				if !op.Done() {
					if op, err = c.WaitOperation(ctx, resp.Operation.ID); err != nil {
						t.Fatal(err)
					}
				}
				if op.State != api.OpSucceeded {
					t.Fatalf("create: %+v", op)
				}
				r.create = append(r.create, time.Since(t0))
				te := time.Now()
				res, err := c.Exec(ctx, resp.Sandbox.ID, api.ExecRequest{Cmd: []string{"true"}})
				if err != nil || res.ExitCode != 0 {
					t.Fatalf("exec: %v %+v", err, res)
				}
				r.hit = append(r.hit, time.Since(t0))
				r.exec1 = append(r.exec1, time.Since(te))
				t1 := time.Now()
				if _, err := c.Exec(ctx, resp.Sandbox.ID, api.ExecRequest{Cmd: []string{"true"}}); err != nil {
					t.Fatal(err)
				}
				r.exec2 = append(r.exec2, time.Since(t1))
				for _, ph := range op.Phases {
					if ph.Name == "claim_pool" {
						r.hits++
						r.claimPhase = append(r.claimPhase, time.Duration(ph.DurationMS*float64(time.Millisecond)))
					}
				}
				if op, err := c.DeleteSandbox(ctx, resp.Sandbox.ID, true); err == nil {
					c.WaitOperation(ctx, op.ID)
				}
			}
			pp, _ := c.Pool(ctx, p.ID)
			r.refill = pp.LastRefillMS
			if err := c.DeletePool(ctx, p.ID); err != nil {
				t.Fatal(err)
			}
			fmt.Printf("pool hit %-7s idle=%-7s n=%d hits=%d: create→exec true p50=%.2fms p99=%.2fms | %s p50=%.2fms p99=%.2fms | ratio %s | idle member PSS %d KiB, MemAvailable drop %d KiB/member | refill %.0fms\n",
				r.rt, r.mode, r.n, r.hits, ms(r.hit.pct(0.5)), ms(r.hit.pct(0.99)), r.rawLabel, ms(r.raw.pct(0.5)), ms(r.raw.pct(0.99)),
				ratio(r.hit, r.raw), r.pssKiB, r.availKiB, r.refill)
			fmt.Printf("    of which: create op done p50=%.2fms p99=%.2fms, claim_pool phase p50=%.2fms p99=%.2fms; the first exec true p50=%.2fms p99=%.2fms, a second p50=%.2fms p99=%.2fms\n",
				ms(r.create.pct(0.5)), ms(r.create.pct(0.99)), ms(r.claimPhase.pct(0.5)), ms(r.claimPhase.pct(0.99)), ms(r.exec1.pct(0.5)), ms(r.exec1.pct(0.99)), ms(r.exec2.pct(0.5)), ms(r.exec2.pct(0.99)))
		}
	}

	// 100 concurrent creates against a native pool that has not filled yet.
	p, err := c.SetPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: "native", Min: 2, Max: 4})
	if err != nil {
		t.Fatal(err)
	}
	const conc = 100
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		lat     samples
		ids     []string
		failed  []error
		claimed int
	)
	t0 := time.Now()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s0 := time.Now()
			resp, err := c.CreateSandbox(ctx, api.CreateSandboxRequest{Runtime: "native"})
			var op *api.Operation
			if err == nil {
				op, err = c.WaitOperation(ctx, resp.Operation.ID)
			}
			if err == nil && op.State != api.OpSucceeded {
				err = fmt.Errorf("%+v", op.Error)
			}
			if err == nil {
				var res *api.ExecResult
				res, err = c.Exec(ctx, resp.Sandbox.ID, api.ExecRequest{Cmd: []string{"true"}})
				if err == nil && res.ExitCode != 0 {
					err = fmt.Errorf("exit %d", res.ExitCode)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed = append(failed, err)
				return
			}
			lat = append(lat, time.Since(s0))
			ids = append(ids, resp.Sandbox.ID)
			for _, ph := range op.Phases {
				if ph.Name == "claim_pool" {
					claimed++
				}
			}
		}()
	}
	wg.Wait()
	burst := time.Since(t0)
	r0 := time.Now()
	pp := waitTarget(t, ctx, c, p.ID)
	recover := time.Since(r0)
	fmt.Printf("100 concurrent native creates from an empty pool: %d failed, %d claimed, all done in %v, create→exec true p50=%.1fms p99=%.1fms; pool back at target %d (hits %d misses %d) %v after the burst\n",
		len(failed), claimed, burst.Round(time.Millisecond), ms(lat.pct(0.5)), ms(lat.pct(0.99)), pp.Target, pp.Hits, pp.Misses, recover.Round(time.Millisecond))
	if len(failed) > 0 {
		t.Errorf("concurrent creates failed: %v", failed)
	}
	for _, id := range ids {
		if op, err := c.DeleteSandbox(ctx, id, true); err == nil {
			c.WaitOperation(ctx, op.ID)
		}
	}
	c.DeletePool(ctx, p.ID)
	fmt.Fprintln(os.Stderr, "pool bench: the machine may be shared; ratios are what to compare")
}

func waitReady(t *testing.T, ctx context.Context, c *sdk.Client, id string, n int) {
	t.Helper()
	for {
		p, err := c.Pool(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if p.Ready >= n {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("pool %s never reached %d ready: %+v", id, n, p)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func waitTarget(t *testing.T, ctx context.Context, c *sdk.Client, id string) *api.Pool {
	t.Helper()
	for {
		p, err := c.Pool(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if p.Ready >= p.Target && p.Filling == 0 {
			return p
		}
		if ctx.Err() != nil {
			t.Fatalf("pool %s never got back to its target: %+v", id, p)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
