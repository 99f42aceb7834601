// Package bench measures space against the raw tools in the same run.
// Speed is measured here, never asserted in tests. Run with `make bench`
// (200 iterations each); every benchmark prints p50/p99 and, where there is a
// raw tool doing the same work, the ratio.
package bench

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

type harness struct {
	srv    *server.Server
	client *sdk.Client
	rootfs string
}

func start(b testing.TB) *harness {
	b.Helper()
	testenv.RequireRoot(b)
	rootfs := testenv.BaseRootfs(b)
	s, c, _ := serve(b, server.NetworkOptions{})
	// Warm: the first create imports the base template and derives the
	// runtime's root; that one-time cost is not what these benchmarks measure.
	sb, err := c.CreateSandboxAndWait(context.Background(), api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		b.Fatal(err)
	}
	if op, err := c.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
		c.WaitOperation(context.Background(), op.ID)
	}
	return &harness{srv: s, client: c, rootfs: rootfs}
}

// serve starts a server with network options no on a fresh data dir and a
// loopback listener; everything goes, sandboxes first, when b ends.
func serve(b testing.TB, no server.NetworkOptions) (*server.Server, *sdk.Client, string) {
	b.Helper()
	data, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		b.Fatal(err)
	}
	// SPACE_BENCH_DEBUG=1 shows the server's debug log (the runtimes'
	// start-up splits).
	var logger *slog.Logger
	if os.Getenv("SPACE_BENCH_DEBUG") == "1" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	s, err := server.New(context.Background(), server.Config{DataDir: data, CacheDir: testenv.CacheDir(), AgentBinary: testenv.AgentBinary(b),
		JailBinary: testenv.JailBinary(b), APIKeyOut: os.Stderr, Network: no, Logger: logger})
	if err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	hs := &http.Server{Handler: s.Handler()}
	go hs.Serve(l)
	c, err := sdk.New("http://"+l.Addr().String(), s.APIKey())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx := context.Background()
		sbs, _ := c.ListSandboxes(ctx, sdk.ListOptions{})
		for _, sb := range sbs {
			if op, err := c.DeleteSandbox(ctx, sb.ID, true); err == nil {
				c.WaitOperation(ctx, op.ID)
			}
		}
		hs.Close()
		s.Close()
		os.RemoveAll(data)
	})
	return s, c, data
}

type samples []time.Duration

func (s samples) pct(p float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	c := append(samples(nil), s...)
	sort.Slice(c, func(i, j int) bool { return c[i] < c[j] })
	i := int(p * float64(len(c)-1))
	return c[i]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func report(b *testing.B, name string, s samples) {
	b.ReportMetric(ms(s.pct(0.5)), name+"_p50_ms")
	b.ReportMetric(ms(s.pct(0.99)), name+"_p99_ms")
	fmt.Printf("%-28s n=%d p50=%.2fms p99=%.2fms\n", name, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
}

func bwrapTrue(rootfs string) error {
	return exec.Command("bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", rootfs, "/", "/bin/true").Run()
}

// BenchmarkCreateToFirstOutput: API create → operation done → exec `true`
// returns, versus raw `bwrap --unshare-all … /bin/true`, interleaved.
func BenchmarkCreateToFirstOutput(b *testing.B) {
	h := start(b)
	ctx := context.Background()
	var sp, bw samples
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if err := bwrapTrue(h.rootfs); err != nil {
			b.Fatalf("bwrap: %v", err)
		}
		bw = append(bw, time.Since(t0))

		t0 = time.Now()
		sb, err := h.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
		if err != nil {
			b.Fatal(err)
		}
		res, err := h.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("exec: %v %+v", err, res)
		}
		sp = append(sp, time.Since(t0))
		b.StopTimer()
		if op, err := h.client.DeleteSandbox(ctx, sb.ID, true); err == nil {
			h.client.WaitOperation(ctx, op.ID)
		}
		b.StartTimer()
	}
	report(b, "space_create_to_output", sp)
	report(b, "bwrap_true", bw)
	ratio := ms(sp.pct(0.5)) / ms(bw.pct(0.5))
	b.ReportMetric(ratio, "ratio_p50")
	fmt.Printf("create→first output / bwrap true (p50): %.2fx\n", ratio)
}

// BenchmarkExecRoundTrip: synchronous exec of `true` on a live sandbox
// through the API, versus bwrap running `true` from scratch.
func BenchmarkExecRoundTrip(b *testing.B) {
	h := start(b)
	ctx := context.Background()
	sb, err := h.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		b.Fatal(err)
	}
	var sp samples
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		res, err := h.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("exec: %v %+v", err, res)
		}
		sp = append(sp, time.Since(t0))
	}
	report(b, "exec_round_trip", sp)
}
