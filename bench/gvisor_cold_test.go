package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

// TestGvisorColdCreateBench: a cold create (no pool) at runtime level —
// Create, Start, dial the agent, exec `true`, its exit status back — next
// to raw `runsc run /bin/true`, interleaved. The raw container gets the
// runtime's own flags and bundle (same rootfs content, same seccomp,
// mounts, limits and a network namespace holding a configured TAP, made
// once and reused): what is left between the two is ours — the disk and
// overlay mounts, a fresh namespace and TAP per sandbox, the agent's start
// inside and one round trip.
// SPACE_BENCH_GVISOR_COLD_N sets the iterations (200).
func TestGvisorColdCreateBench(t *testing.T) {
	b := newGVBench(t)
	n := envInt("SPACE_BENCH_GVISOR_COLD_N", 200)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()

	// Warm-up (page cache, the runtime's user namespace), and the
	// template of the raw bundle.
	inst, c, err := b.start(ctx, newSpecID("w-"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	bundle := b.rawBundle(t, inst, "raw-true", []string{"/bin/true"})
	inst.Destroy(ctx)
	ns := filepath.Join(b.dir, "raw-netns")
	if err := hostnet.NewNetNS(ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hostnet.RemoveNetNS(ns) })
	tap, err := hostnet.CreateTAP(ns)
	if err != nil {
		t.Fatal(err)
	}
	tap.Close()
	setBundleNetNS(t, bundle, ns)

	var ours, raw, create, start, first samples
	for i := 0; i < n; i++ {
		id := newSpecID("c-")
		t0 := time.Now()
		inst, err := b.rt.Create(ctx, b.spec(id))
		if err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		if err := inst.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t2 := time.Now()
		conn, err := inst.DialAgent(ctx)
		if err != nil {
			t.Fatal(err)
		}
		c, err := agentclient.New(conn)
		if err != nil {
			t.Fatal(err)
		}
		res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec true: %+v %v", res, err)
		}
		ours = append(ours, time.Since(t0))
		create, start, first = append(create, t1.Sub(t0)), append(start, t2.Sub(t1)), append(first, time.Since(t2))
		c.Close()
		if err := inst.Destroy(ctx); err != nil {
			t.Fatal(err)
		}

		rid := newSpecID("r-")
		t0 = time.Now()
		if _, err := b.rawNet(ctx, "run", "--bundle", bundle, rid); err != nil {
			t.Fatalf("raw run: %v", err)
		}
		raw = append(raw, time.Since(t0))
		b.rawNet(ctx, "delete", "--force", rid)
	}
	fmt.Printf("\n== gvisor cold create → `true` done vs raw runsc run (n=%d, interleaved) ==\n", n)
	printSamples("create→exec true (runtime)", ours)
	printSamples("  of which Create", create)
	printSamples("  of which Start", start)
	printSamples("  of which dial+exec true", first)
	printSamples("raw runsc run /bin/true", raw)
	fmt.Printf("  ratio p50 %s, p99 %.2f× (target ≤ 1.15×)\n", ratio(ours, raw), float64(ours.pct(0.99))/float64(raw.pct(0.99)))
}

// setBundleNetNS points a raw bundle at the network namespace ns.
func setBundleNetNS(t *testing.T, bundle, ns string) {
	t.Helper()
	p := filepath.Join(bundle, "config.json")
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	linux := spec["linux"].(map[string]any)
	nss, _ := linux["namespaces"].([]any)
	for _, x := range nss {
		m := x.(map[string]any)
		if m["type"] == "network" {
			m["path"] = ns
		}
	}
	out, _ := json.MarshalIndent(spec, "", "\t")
	if err := os.WriteFile(p, out, 0o600); err != nil {
		t.Fatal(err)
	}
}

// rawNet runs raw runsc with the runtime's own flags (its network mode
// included: the bundle names a namespace).
func (b *gvBench) rawNet(ctx context.Context, args ...string) ([]byte, error) {
	flags := append([]string(nil), runscFlags...)
	for k, f := range flags {
		if f == "--network=none" {
			flags[k] = "--network=sandbox"
		}
	}
	return b.rawFlags(ctx, flags, args...)
}
