package agent_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
)

// BenchmarkExecTransport alternates a synchronous exec of /bin/true called
// in process (Agent.Exec) and the same exec through the host's client over
// a unix socket (yamux, HTTP/1.1 on a kept stream), and reports the median
// of each and their difference: what the agent protocol costs an exec.
func BenchmarkExecTransport(b *testing.B) {
	a, err := agent.New(agent.Config{Root: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	dir, err := os.MkdirTemp("", "agt")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ln, err := net.Listen("unix", filepath.Join(dir, "s"))
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	go a.Serve(ln)
	conn, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	req := agentproto.ExecRequest{Cmd: []string{"/bin/true"}}
	var direct, remote []time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		r := req
		if _, err := a.Exec(ctx, &r); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if _, err := c.Exec(ctx, req); err != nil {
			b.Fatal(err)
		}
		direct, remote = append(direct, t1.Sub(t0)), append(remote, time.Since(t1))
	}
	slices.Sort(direct)
	slices.Sort(remote)
	b.ReportMetric(float64(direct[len(direct)/2].Microseconds()), "direct-p50-µs")
	b.ReportMetric(float64(remote[len(remote)/2].Microseconds()), "client-p50-µs")
	b.ReportMetric(float64((remote[len(remote)/2] - direct[len(direct)/2]).Microseconds()), "transport-µs")
}
