package bench

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
)

// bareTrue is the floor an exec cannot beat: this process's own
// fork/exec/wait of /bin/true (syscall.ForkExec, CLONE_VFORK, then Wait4),
// with nothing around it.
func bareTrue() error {
	pid, err := syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{Env: []string{}})
	if err != nil {
		return err
	}
	var ws syscall.WaitStatus
	for {
		_, err = syscall.Wait4(pid, &ws, 0, nil)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		return err
	}
	if !ws.Exited() || ws.ExitStatus() != 0 {
		return fmt.Errorf("/bin/true: %v", ws)
	}
	return nil
}

// TestExecBench: API-level synchronous exec of `true` on a live sandbox of
// each runtime (native, gvisor), one SDK client keeping its connection,
// interleaved in the same loop with a bare fork/exec/wait of /bin/true by
// this process. Target (issue 14): p50 ≤ bare + 0.5 ms.
//
// To say where an exec's time goes, the same loop also runs the exec one
// layer down at a time, each interleaved with the others: the manager's
// Exec without HTTP (policy, audit, OOM counter, the agent call), the
// agent client's Exec alone (the agent protocol and the agent), and the
// agent's own start→exit of the process (reported by the agent).
// SPACE_BENCH_EXEC_N sets the iterations (300); SPACE_BENCH_EXEC_RUNTIMES
// which runtimes ("native,gvisor"); SPACE_BENCH_EXEC_PROFILE=FILE writes a
// CPU profile of this process (the server runs in it) over the loop.
func TestExecBench(t *testing.T) {
	requireBench(t)
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	srv, c, _ := serve(t, server.NetworkOptions{})
	mgr := srv.Manager()
	ctx := context.Background()
	n := envInt("SPACE_BENCH_EXEC_N", 300)
	runtimes := []string{"native", "gvisor"}
	if v := os.Getenv("SPACE_BENCH_EXEC_RUNTIMES"); v != "" {
		runtimes = strings.Split(v, ",")
	}
	type target struct {
		name                       string
		id                         string
		api, manager, agent, inner samples
	}
	var targets []*target
	for _, rt := range runtimes {
		sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: rt})
		if err != nil {
			t.Fatalf("create %s sandbox: %v", rt, err)
		}
		targets = append(targets, &target{name: rt, id: sb.ID})
	}
	req := api.ExecRequest{Cmd: []string{"true"}}
	check := func(what string, res *api.ExecResult, err error) time.Duration {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if res.ExitCode != 0 {
			t.Fatalf("%s: true exited %d", what, res.ExitCode)
		}
		return time.Duration(res.DurationMS * float64(time.Millisecond))
	}
	// One round of each layer on tg, timed into its samples; the order
	// rotates with i, so no layer always runs first (on cold threads).
	round := func(tg *target, i int) {
		layers := []func(){
			func() {
				t0 := time.Now()
				res, err := c.Exec(ctx, tg.id, req)
				d := time.Since(t0)
				tg.inner = append(tg.inner, check(tg.name+" api exec", res, err))
				tg.api = append(tg.api, d)
			},
			func() {
				t0 := time.Now()
				res, err := mgr.Commands().Exec(ctx, tg.id, req)
				tg.manager = append(tg.manager, time.Since(t0))
				check(tg.name+" manager exec", &res, err)
			},
			func() {
				ac, release, err := mgr.Agent(ctx, tg.id)
				if err != nil {
					t.Fatal(err)
				}
				t0 := time.Now()
				res, err := ac.Exec(ctx, agentproto.ExecRequest{Cmd: req.Cmd})
				tg.agent = append(tg.agent, time.Since(t0))
				release()
				check(tg.name+" agent client exec", &res, err)
			},
		}
		for k := range layers {
			layers[(i+k)%len(layers)]()
		}
	}
	// Warm-up: first calls dial, fill caches and page the binaries in.
	for i := 0; i < 20; i++ {
		bareTrue()
		for _, tg := range targets {
			round(tg, i)
		}
	}
	for _, tg := range targets {
		tg.api, tg.manager, tg.agent, tg.inner = nil, nil, nil, nil
	}
	if f := os.Getenv("SPACE_BENCH_EXEC_PROFILE"); f != "" {
		w, err := os.Create(f)
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		if err := pprof.StartCPUProfile(w); err != nil {
			t.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	var bare samples
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := bareTrue(); err != nil {
			t.Fatal(err)
		}
		bare = append(bare, time.Since(t0))
		for _, tg := range targets {
			round(tg, i)
		}
	}
	line := func(name string, s samples) {
		fmt.Printf("%-52s n=%d p50=%.2fms p99=%.2fms\n", name, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
	}
	line("bare fork/exec/wait /bin/true (this process)", bare)
	for _, tg := range targets {
		line("api exec true ("+tg.name+", sdk → HTTP → manager)", tg.api)
		line("  manager.Exec, no HTTP", tg.manager)
		line("  agent client Exec, no manager", tg.agent)
		line("  the agent's own start→exit of the process", tg.inner)
		d50 := ms(tg.api.pct(0.5)) - ms(bare.pct(0.5))
		d99 := ms(tg.api.pct(0.99)) - ms(bare.pct(0.99))
		verdict := "met"
		if d50 > 0.5 {
			verdict = "missed"
		}
		fmt.Printf("  %s api − bare: p50 %+.2f ms, p99 %+.2f ms (target p50 ≤ +0.5 ms: %s); p99/p50 %.2f\n",
			tg.name, d50, d99, verdict, ms(tg.api.pct(0.99))/ms(tg.api.pct(0.5)))
		fmt.Printf("  %s p50 split: HTTP+sdk %.2f, manager %.2f, agent protocol+agent %.2f, process %.2f ms\n", tg.name,
			ms(tg.api.pct(0.5))-ms(tg.manager.pct(0.5)), ms(tg.manager.pct(0.5))-ms(tg.agent.pct(0.5)),
			ms(tg.agent.pct(0.5))-ms(tg.inner.pct(0.5)), ms(tg.inner.pct(0.5)))
	}
}
