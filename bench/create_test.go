package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// TestColdCreateBench measures a pool miss on the native runtime: API
// create (waiting for the sandbox to run) → exec `true` returns, interleaved
// with raw `bwrap --unshare-all --die-with-parent --ro-bind ROOT / /bin/true`,
// SPACE_BENCH_N iterations (default 200). The server has no warm pool, so
// every create is cold. It also prints where the time goes: the create
// operation's phases and the two client calls, p50 each.
func TestColdCreateBench(t *testing.T) {
	if os.Getenv("SPACE_BENCH") == "" {
		t.Skip("benchmark: set SPACE_BENCH=1 (make bench)")
	}
	n := 200
	if s := os.Getenv("SPACE_BENCH_N"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("SPACE_BENCH_N=%q", s)
		}
		n = v
	}
	h := start(t)
	ctx := context.Background()
	var sp, bw, createCall, execCall, opTime, outside samples
	phases := map[string]samples{}
	var order []string
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := bwrapTrue(h.rootfs); err != nil {
			t.Fatalf("bwrap: %v", err)
		}
		bw = append(bw, time.Since(t0))

		t0 = time.Now()
		res, err := h.client.CreateSandboxWait(ctx, api.CreateSandboxRequest{Runtime: "native"}, time.Minute)
		if err != nil || res.Operation.State != api.OpSucceeded {
			t.Fatalf("create: %v %+v", err, res)
		}
		sb, op := res.Sandbox, res.Operation
		t1 := time.Now()
		out, err := h.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
		if err != nil || out.ExitCode != 0 {
			t.Fatalf("exec: %v %+v", err, out)
		}
		t2 := time.Now()
		sp = append(sp, t2.Sub(t0))
		createCall = append(createCall, t1.Sub(t0))
		execCall = append(execCall, t2.Sub(t1))
		var inPhases time.Duration
		for _, p := range op.Phases {
			if _, ok := phases[p.Name]; !ok {
				order = append(order, p.Name)
			}
			d := time.Duration(p.DurationMS * float64(time.Millisecond))
			phases[p.Name] = append(phases[p.Name], d)
			if p.Name != "network" { // runs alongside agent_ready
				inPhases += d
			}
		}
		if op.FinishedAt != nil {
			opTime = append(opTime, op.FinishedAt.Sub(op.CreatedAt))
			outside = append(outside, op.FinishedAt.Sub(op.CreatedAt)-inPhases)
		}
		if op, err := h.client.DeleteSandbox(ctx, sb.ID, true); err == nil {
			h.client.WaitOperation(ctx, op.ID)
		}
	}
	line := func(name string, s samples) {
		fmt.Printf("%-34s n=%d p50=%.2fms p99=%.2fms\n", name, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
	}
	line("space create→exec true (native)", sp)
	line("bwrap --unshare-all true", bw)
	fmt.Printf("ratio p50 %.2fx, p99 %.2fx\n", ms(sp.pct(0.5))/ms(bw.pct(0.5)), ms(sp.pct(0.99))/ms(bw.pct(0.99)))
	fmt.Println("where the time goes (p50 each):")
	line("  create call (until running)", createCall)
	line("    operation created→finished", opTime)
	for _, name := range order {
		line("      phase "+name, phases[name])
	}
	line("      outside the phases", outside)
	fmt.Println("      (network runs alongside agent_ready; the machine's load shows in bwrap's numbers)")
	line("  exec true call", execCall)
}
