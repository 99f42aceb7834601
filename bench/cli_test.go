package bench

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// cliBinary is bin/space (with bin/space-server beside it) when make built
// them next to $SPACE_AGENT_BIN, else a fresh build of both as make does.
func cliBinary(t *testing.T) string {
	t.Helper()
	if a := os.Getenv("SPACE_AGENT_BIN"); a != "" {
		p := filepath.Join(filepath.Dir(a), "space")
		if _, err := os.Stat(filepath.Join(filepath.Dir(a), "space-server")); err == nil {
			return p
		}
	}
	dir := t.TempDir()
	for _, b := range []struct{ name, ldflags string }{{"space", "-s -w"}, {"space-server", ""}} {
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags="+b.ldflags, "-o", filepath.Join(dir, b.name), "github.com/spacehq/space/cmd/"+b.name)
		if b.name == "space" {
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as make builds it: static, no dynamic loader at start
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("building %s: %v\n%s", b.name, err, out)
		}
	}
	return filepath.Join(dir, "space")
}

// initTraceMS is the sum of the clock times GODEBUG=inittrace=1 reports
// for one run of bin with args: Go package initialisation before main.
func initTraceMS(t *testing.T, bin string, args ...string) float64 {
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "GODEBUG=inittrace=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %v: %v", bin, args, err)
	}
	sum := 0.0
	for _, l := range strings.Split(stderr.String(), "\n") {
		// init PKG @T ms, C ms clock, B bytes, A allocs
		f := strings.Fields(l)
		if len(f) >= 7 && f[0] == "init" && f[6] == "clock," {
			v, err := strconv.ParseFloat(f[4], 64)
			if err != nil {
				t.Fatalf("inittrace line %q", l)
			}
			sum += v
		}
	}
	return sum
}

// TestCLIBench: `space exec ID -- true` from the shell — the real binary,
// a real server, a native sandbox — interleaved with `bwrap --unshare-all
// … /bin/true`; `space --help` wall time; the init trace sums of the client
// and, for comparison, of space-server (the binary the CLI was before the
// split). Opt-in: SPACE_BENCH=1 (make bench).
func TestCLIBench(t *testing.T) {
	if os.Getenv("SPACE_BENCH") != "1" {
		t.Skip("benchmark; run with SPACE_BENCH=1 (make bench)")
	}
	n := 200
	if v, err := strconv.Atoi(os.Getenv("SPACE_BENCH_N")); err == nil && v > 0 {
		n = v
	}
	testenv.RequireRoot(t)
	rootfs := testenv.BaseRootfs(t)
	bin := cliBinary(t)
	data := t.TempDir()
	s, err := server.New(context.Background(), server.Config{DataDir: data, CacheDir: testenv.CacheDir(), AgentBinary: testenv.AgentBinary(t),
		JailBinary: testenv.JailBinary(t), APIKeyOut: os.Stderr})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: s.Handler()}
	go hs.Serve(l)
	url := "http://" + l.Addr().String()
	c, err := sdk.New(url, s.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	t.Cleanup(func() {
		sbs, _ := c.ListSandboxes(ctx, sdk.ListOptions{})
		for _, sb := range sbs {
			if op, err := c.DeleteSandbox(ctx, sb.ID, true); err == nil {
				c.WaitOperation(ctx, op.ID)
			}
		}
		hs.Close()
		s.Close()
	})
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	// The server's URL and key as a user's environment gives them (no key
	// file read).
	env := append(os.Environ(), "SPACE_URL="+url, "SPACE_API_KEY="+s.APIKey())
	spaceRun := func(args ...string) error {
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("space %v: %v: %s", args, err, out)
		}
		return nil
	}
	// Warm-up: page cache, the sandbox's first exec.
	for i := 0; i < 5; i++ {
		if err := spaceRun("exec", sb.ID, "--", "true"); err != nil {
			t.Fatal(err)
		}
	}
	var ex, bw, help samples
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := bwrapTrue(rootfs); err != nil {
			t.Fatalf("bwrap: %v", err)
		}
		bw = append(bw, time.Since(t0))
		t0 = time.Now()
		if err := spaceRun("exec", sb.ID, "--", "true"); err != nil {
			t.Fatal(err)
		}
		ex = append(ex, time.Since(t0))
		t0 = time.Now()
		if err := spaceRun("--help"); err != nil {
			t.Fatal(err)
		}
		help = append(help, time.Since(t0))
	}
	line := func(name string, s samples) {
		fmt.Printf("%-28s n=%d p50=%.2fms p99=%.2fms\n", name, len(s), ms(s.pct(0.5)), ms(s.pct(0.99)))
	}
	line("space_exec_true_cli", ex)
	line("bwrap_true", bw)
	line("space_help", help)
	fmt.Printf("space exec -- true / bwrap true (p50): %.2fx  (p99/p50 %.2f)\n", ms(ex.pct(0.5))/ms(bw.pct(0.5)), ms(ex.pct(0.99))/ms(ex.pct(0.5)))

	// Init trace sums, median of 21 runs each.
	med := func(f func() float64) float64 {
		var v []time.Duration
		for i := 0; i < 21; i++ {
			v = append(v, time.Duration(f()*1e6))
		}
		return ms(samples(v).pct(0.5))
	}
	server := filepath.Join(filepath.Dir(bin), "space-server")
	fmt.Printf("inittrace sum (median of 21): space --help %.2fms, space exec --help %.2fms, space-server --help %.2fms\n",
		med(func() float64 { return initTraceMS(t, bin, "--help") }), med(func() float64 { return initTraceMS(t, bin, "exec", "--help") }),
		med(func() float64 { return initTraceMS(t, server, "--help") }))
	for _, b := range []string{bin, server} {
		if fi, err := os.Stat(b); err == nil {
			fmt.Printf("binary %s: %.1f MB\n", filepath.Base(b), float64(fi.Size())/1e6)
		}
	}
}
