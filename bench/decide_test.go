package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sync/atomic"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// benchDecider allows everything at once; it applies to the sandboxes
// attached while next is set (the server asks Applies at attach).
type benchDecider struct {
	next  atomic.Bool
	calls atomic.Int64
}

func (d *benchDecider) Decide(context.Context, actions.Action) actions.Decision {
	d.calls.Add(1)
	return actions.Decision{Verdict: actions.Allow}
}

func (d *benchDecider) Applies(string) bool { return d.next.Load() }

// TestDecideBench: what the temporal policy costs a new connection through
// the gateway — a round trip over the decisions stream to the server, which
// reads the sandbox's record and, native, finds the executable in the
// sandbox's /proc — against a sandbox no rule applies to (the fast path),
// on the same server, interleaved. The Decider itself answers at once.
func TestDecideBench(t *testing.T) {
	requireBench(t)
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	dns := gatewaytest.StartDNS(t, map[string][]string{"fast.test": {"127.0.0.2"}})
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })}
	go srv.Serve(ln)
	defer srv.Close()

	dec := &benchDecider{}
	data, err := os.MkdirTemp("", "space-bench-decide-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(data)
	s, err := server.New(context.Background(), server.Config{DataDir: data, CacheDir: testenv.CacheDir(), AgentBinary: testenv.AgentBinary(t),
		JailBinary: testenv.JailBinary(t), APIKeyOut: os.Stderr, Decider: dec,
		Network: server.NetworkOptions{AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
			DNSUpstream: dns.Addr, DialGuard: "loopback", GatewayBinary: testenv.GatewayBinary(t)}})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: s.Handler()}
	go hs.Serve(l)
	c, err := sdk.New("http://"+l.Addr().String(), s.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	n := &netServer{c: c, data: data}
	defer func() {
		sbs, _ := c.ListSandboxes(context.Background(), sdk.ListOptions{})
		for _, sb := range sbs {
			n.remove(sb.ID)
		}
		hs.Close()
		s.Close()
	}()
	policy := &api.NetworkPolicy{AllowOut: []string{"fast.test"}, AllowPrivate: []string{"127.0.0.0/8"}}
	dec.next.Store(true)
	ruled := n.create(t, policy)
	dec.next.Store(false)
	plain := n.create(t, policy)

	// Each sandbox resolves the name once (a connection is allowed only to
	// an address the gateway resolved for it); the loops then skip DNS.
	for _, id := range []string{ruled.ID, plain.ID} {
		n.sh(t, id, fmt.Sprintf("curl -sf -o /dev/null http://fast.test:%d/", port))
	}
	const rounds, per = 4, 100
	loop := fmt.Sprintf("for i in $(seq %d); do curl -s -o /dev/null -w '%%{time_total}\\n' --resolve fast.test:%d:198.19.0.2 http://fast.test:%d/; done", per, port, port)
	var with, without samples
	for range rounds {
		with = append(with, seconds(t, n.sh(t, ruled.ID, loop))...)
		without = append(without, seconds(t, n.sh(t, plain.ID, loop))...)
	}
	if got := dec.calls.Load(); got < rounds*per {
		t.Fatalf("the Decider was asked %d times for %d connections", got, rounds*per)
	}
	fmt.Printf("%-34s with rules p50=%.2fms p99=%.2fms  without p50=%.2fms p99=%.2fms  +%.2fms p50 +%.2fms p99\n",
		"new connection, policy decision", ms(with.pct(0.5)), ms(with.pct(0.99)), ms(without.pct(0.5)), ms(without.pct(0.99)),
		ms(with.pct(0.5)-without.pct(0.5)), ms(with.pct(0.99)-without.pct(0.99)))
}
