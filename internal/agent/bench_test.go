package agent

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentproto"
)

// reportP50 adds the median latency to a benchmark's output: on a busy
// machine the mean (ns/op) is dominated by scheduling outliers.
func reportP50(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
}

// BenchmarkSpawnTrue is the floor under any exec: fork/exec of /bin/true
// and its reaping, with nothing else.
func BenchmarkSpawnTrue(b *testing.B) {
	a, err := New(Config{Root: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	lat := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		t := time.Now()
		_, done, err := a.reaper.start("/bin/true", []string{"true"}, &syscall.ProcAttr{Sys: &syscall.SysProcAttr{Setsid: true}})
		if err != nil {
			b.Fatal(err)
		}
		<-done
		lat = append(lat, time.Since(t))
	}
	reportP50(b, lat)
}

// BenchmarkExecTrue is a synchronous exec without the transport.
func BenchmarkExecTrue(b *testing.B) {
	a, err := New(Config{Root: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	req := &agentproto.ExecRequest{Cmd: []string{"/bin/true"}}
	lat := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		t := time.Now()
		if _, err := a.Exec(context.Background(), req); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t))
	}
	reportP50(b, lat)
}

// BenchmarkExecOverhead alternates a bare spawn and a synchronous exec of
// /bin/true, so both see the same machine load, and reports the median of
// each and of the agent's own cost (their difference).
func BenchmarkExecOverhead(b *testing.B) {
	a, err := New(Config{Root: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	req := &agentproto.ExecRequest{Cmd: []string{"/bin/true"}}
	var spawn, exec []time.Duration
	for i := 0; i < b.N; i++ {
		t := time.Now()
		_, done, err := a.reaper.start("/bin/true", []string{"true"}, &syscall.ProcAttr{Dir: "/", Sys: &syscall.SysProcAttr{Setsid: true}})
		if err != nil {
			b.Fatal(err)
		}
		<-done
		t1 := time.Now()
		if _, err := a.Exec(context.Background(), req); err != nil {
			b.Fatal(err)
		}
		spawn, exec = append(spawn, t1.Sub(t)), append(exec, time.Since(t1))
	}
	slices.Sort(spawn)
	slices.Sort(exec)
	b.ReportMetric(float64(spawn[len(spawn)/2].Microseconds()), "spawn-p50-µs")
	b.ReportMetric(float64(exec[len(exec)/2].Microseconds()), "exec-p50-µs")
	b.ReportMetric(float64((exec[len(exec)/2] - spawn[len(spawn)/2]).Microseconds()), "overhead-µs")
}
