package agentclient_test

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// socketPair returns two connected unix stream sockets.
func socketPair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "sock")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	return conn(fds[0]), conn(fds[1])
}

// realAgent serves an in-process agent over a socket pair.
func realAgent(t testing.TB) *agentclient.Client {
	t.Helper()
	a, err := agent.New(agent.Config{Root: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	hostEnd, agentEnd := socketPair(t)
	go a.ServeConn(agentEnd)
	c, err := agentclient.New(hostEnd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); a.Close() })
	return c
}

func TestRealAgentRoundTrip(t *testing.T) {
	c := realAgent(t)
	ctx := ctxT(t)
	res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"echo", "hello"}})
	if err != nil || res.Stdout != "hello\n" {
		t.Fatalf("exec %+v %v", res, err)
	}
	if _, err := c.WriteFile(ctx, "/f", 0o600, strings.NewReader("data")); err != nil {
		t.Fatal(err)
	}
	fi, err := c.Stat(ctx, "/f")
	if err != nil || fi.Mode != 0o600 || fi.Size != 4 {
		t.Fatalf("stat %+v %v", fi, err)
	}
	_, err = c.Stat(ctx, "/missing")
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "/missing") {
		t.Fatalf("err = %v", err)
	}
	_, err = c.Proc(ctx, "nope/../x")
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("err = %v", err)
	}
}

// BenchmarkExec measures one synchronous exec round trip (client → yamux
// over a unix socket → agent → fork/exec of /bin/true → reap → answer).
func BenchmarkExec(b *testing.B) {
	c := realAgent(b)
	ctx := context.Background()
	req := agentproto.ExecRequest{Cmd: []string{"/bin/true"}}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t := time.Now()
		res, err := c.Exec(ctx, req)
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("%+v %v", res, err)
		}
		lat = append(lat, time.Since(t))
	}
	// The median: on a busy machine the mean (ns/op) is mostly scheduling
	// outliers.
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
}

// BenchmarkHealth measures the protocol overhead alone.
func BenchmarkHealth(b *testing.B) {
	c := realAgent(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.Health(ctx); err != nil {
			b.Fatal(err)
		}
	}
}
