package native_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/testenv"
)

// benchRuntime is a native runtime on a short private DataDir sharing the
// test binary's uid-shifted template.
func benchRuntime(tb testing.TB) (runtime.Runtime, runtime.Spec) {
	tb.Helper()
	testenv.RequireRoot(tb)
	root := testenv.BaseRootfs(tb)
	agent := testenv.AgentBinary(tb)
	if sharedRootfs == "" {
		dir, err := os.MkdirTemp("", "nt-rootfs-")
		if err != nil {
			tb.Fatal(err)
		}
		sharedRootfs = dir
	}
	dir, err := os.MkdirTemp("", "nb-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Symlink(sharedRootfs, filepath.Join(dir, "rootfs")); err != nil {
		tb.Fatal(err)
	}
	rt, err := runtime.New(native.Name, runtime.Config{DataDir: dir, AgentBinary: agent, Logger: testLogger})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if c, ok := rt.(interface{ Close() error }); ok {
			c.Close()
		}
	})
	spec := runtime.Spec{RootFS: root, TemplateDigest: "sha256:base-bookworm-test",
		Limits: api.Limits{CPUs: 1, MemoryMiB: 256, Pids: 256, DiskMiB: 256}}
	return rt, spec
}

// firstHealth dials the agent and waits for its first Health answer.
func firstHealth(ctx context.Context, inst runtime.Instance) (*agentclient.Client, error) {
	conn, err := inst.DialAgent(ctx)
	if err != nil {
		return nil, err
	}
	c, err := agentclient.New(conn)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if _, err := c.Health(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

var initTimesRE = regexp.MustCompile(`exec\+Go start ([^,]+), config wait ([^,]+), setup ([^)]+)\)`)

type durations []time.Duration

func (d durations) pct(p float64) time.Duration {
	s := append(durations(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// BenchmarkStartup measures, per sandbox, Create, Start and the time from
// Start's return to the agent's first Health answer, and reports p50/p99 of
// each and of the total. Run with -benchtime=60x for meaningful tails.
func BenchmarkStartup(b *testing.B) {
	rt, spec := benchRuntime(b)
	ctx := context.Background()
	// One warm-up so the template copy and page cache are not measured.
	warm := spec
	warm.ID = "bench-warm"
	if inst, err := rt.Create(ctx, warm); err != nil {
		b.Fatal(err)
	} else {
		inst.Destroy(ctx)
	}
	var create, start, health, total durations
	initPhases := make([]durations, 3)
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		s := spec
		s.ID = fmt.Sprintf("bench-%d", n)
		t0 := time.Now()
		inst, err := rt.Create(ctx, s)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := inst.Start(ctx); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		c, err := firstHealth(ctx, inst)
		if err != nil {
			b.Fatal(err)
		}
		t3 := time.Now()
		create = append(create, t1.Sub(t0))
		start = append(start, t2.Sub(t1))
		health = append(health, t3.Sub(t2))
		total = append(total, t3.Sub(t0))
		b.StopTimer()
		// The init's own account of Start: exec + Go start-up, waiting for
		// the host's config, and building the sandbox.
		if log, err := os.ReadFile(filepath.Join(inst.(interface{ Dir() string }).Dir(), "rw", "init.log")); err == nil {
			if m := initTimesRE.FindSubmatch(log); m != nil {
				for k := range initPhases {
					if d, err := time.ParseDuration(string(m[k+1])); err == nil {
						initPhases[k] = append(initPhases[k], d)
					}
				}
			}
		}
		c.Close()
		if err := inst.Destroy(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	for _, m := range []struct {
		name string
		d    durations
	}{{"create", create}, {"start", start}, {"health", health}, {"total", total},
		{"init-gostart", initPhases[0]}, {"init-cfgwait", initPhases[1]}, {"init-setup", initPhases[2]}} {
		b.ReportMetric(float64(m.d.pct(0.5).Microseconds())/1000, m.name+"-p50-ms")
		b.ReportMetric(float64(m.d.pct(0.99).Microseconds())/1000, m.name+"-p99-ms")
	}
	b.ReportMetric(0, "ns/op")
}
