package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/runtime/hostproc"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// netServer is a server with (or without) the network gateway, its fake
// internet on loopback, and its data dir.
type netServer struct {
	c    *sdk.Client
	data string
}

func startNetServer(t *testing.T, dnsAddr string, disabled bool) *netServer {
	_, c, data := serve(t, server.NetworkOptions{Disabled: disabled, AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		DNSUpstream: dnsAddr, DialGuard: "loopback", GatewayBinary: testenv.GatewayBinary(t)})
	return &netServer{c: c, data: data}
}

func (n *netServer) create(t *testing.T, p *api.NetworkPolicy) *api.Sandbox {
	sb, err := n.c.CreateSandboxAndWait(context.Background(), api.CreateSandboxRequest{Runtime: "native", Network: p})
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func (n *netServer) remove(id string) {
	if op, err := n.c.DeleteSandbox(context.Background(), id, true); err == nil {
		n.c.WaitOperation(context.Background(), op.ID)
	}
}

func (n *netServer) sh(t *testing.T, id, script string) string {
	res, err := n.c.Exec(context.Background(), id, api.ExecRequest{Cmd: []string{"sh", "-c", script}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%q: %v %+v", script, err, res)
	}
	return res.Stdout
}

// seconds parses one float per line (curl's %{time_total}).
func seconds(t *testing.T, out string) samples {
	var s samples
	for _, f := range strings.Fields(out) {
		v, err := strconv.ParseFloat(f, 64)
		if err != nil {
			t.Fatalf("parsing %q: %v", f, err)
		}
		s = append(s, time.Duration(v*float64(time.Second)))
	}
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s
}

// TestNetworkBench: throughput of a 100 MiB download and the latency of
// small requests through the gateway against the host's own curl, create
// with a network link against without, and the gateway's memory per idle
// link. Numbers in docs/BENCHMARKS.md.
func TestNetworkBench(t *testing.T) {
	requireBench(t)
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	dns := gatewaytest.StartDNS(t, map[string][]string{"fast.test": {"127.0.0.2"}})
	const size = 100 << 20
	zeros := make([]byte, 1<<20)
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/big" {
			io.WriteString(w, "ok")
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(size))
		for i := 0; i < size/len(zeros); i++ {
			if _, err := w.Write(zeros); err != nil {
				return
			}
		}
	})}
	go srv.Serve(ln)
	defer srv.Close()

	withNet := startNetServer(t, dns.Addr, false)
	policy := &api.NetworkPolicy{AllowOut: []string{"fast.test"}, AllowPrivate: []string{"127.0.0.0/8"}}
	sb := withNet.create(t, policy)
	const downloads = 7
	curlLoop := func(url string, n int) string {
		return fmt.Sprintf("for i in $(seq %d); do curl -s -o /dev/null -w '%%{time_total}\\n' %s; done", n, url)
	}
	in := seconds(t, withNet.sh(t, sb.ID, curlLoop(fmt.Sprintf("http://fast.test:%d/big", port), downloads)))
	hostOut, err := exec.Command("sh", "-c", curlLoop(fmt.Sprintf("http://127.0.0.2:%d/big", port), downloads)).Output()
	if err != nil {
		t.Fatal(err)
	}
	host := seconds(t, string(hostOut))
	mibps := func(d time.Duration) float64 { return float64(size>>20) / d.Seconds() }
	fmt.Printf("%-34s sandbox p50=%.0f MiB/s  host curl p50=%.0f MiB/s  ratio %.2f×\n", "download 100 MiB (native)",
		mibps(in.pct(0.5)), mibps(host.pct(0.5)), mibps(in.pct(0.5))/mibps(host.pct(0.5)))

	// The same work on both sides: a new connection and one request to an
	// address (the sandbox's name was resolved once, before the loop).
	const small = 200
	in = seconds(t, withNet.sh(t, sb.ID, curlLoop(fmt.Sprintf("--resolve fast.test:%d:198.19.0.2 http://fast.test:%d/small", port, port), small)))
	hostOut, err = exec.Command("sh", "-c", curlLoop(fmt.Sprintf("http://127.0.0.2:%d/small", port), small)).Output()
	if err != nil {
		t.Fatal(err)
	}
	host = seconds(t, string(hostOut))
	fmt.Printf("%-34s sandbox p50=%.2fms p99=%.2fms  host p50=%.2fms p99=%.2fms  +%.2fms p50\n", "small request (new connection)",
		ms(in.pct(0.5)), ms(in.pct(0.99)), ms(host.pct(0.5)), ms(host.pct(0.99)), ms(in.pct(0.5)-host.pct(0.5)))
	dnsOut := withNet.sh(t, sb.ID, `python3 -c "
import socket,time
for i in range(200):
    t=time.perf_counter(); socket.gethostbyname('fast.test'); print(time.perf_counter()-t)"`)
	d := seconds(t, dnsOut)
	fmt.Printf("%-34s p50=%.2fms p99=%.2fms (through the gateway to the upstream)\n", "dns query (A, in the sandbox)", ms(d.pct(0.5)), ms(d.pct(0.99)))
	withNet.remove(sb.ID)

	// Create with a link against a server without a gateway.
	without := startNetServer(t, dns.Addr, true)
	const creates = 40
	timeCreates := func(n *netServer) samples {
		n.remove(n.create(t, nil).ID) // warm
		var s samples
		for i := 0; i < creates; i++ {
			start := time.Now()
			sb := n.create(t, policy)
			s = append(s, time.Since(start))
			n.remove(sb.ID)
		}
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		return s
	}
	a, b := timeCreates(withNet), timeCreates(without)
	fmt.Printf("%-34s with p50=%.1fms p99=%.1fms  without p50=%.1fms p99=%.1fms  +%.1fms p50\n", "create (native)",
		ms(a.pct(0.5)), ms(a.pct(0.99)), ms(b.pct(0.5)), ms(b.pct(0.99)), ms(a.pct(0.5)-b.pct(0.5)))

	// The gateway's memory per idle link.
	proc, err := hostproc.Adopt(filepath.Join(withNet.data, "network", "gateway.pid"))
	if err != nil {
		t.Fatal(err)
	}
	defer proc.Close()
	const idle = 20
	rss0, pss0 := testenv.Rollup(proc.Pid())
	var ids []string
	for i := 0; i < idle; i++ {
		ids = append(ids, withNet.create(t, policy).ID)
	}
	time.Sleep(2 * time.Second)
	rss1, pss1 := testenv.Rollup(proc.Pid())
	fmt.Printf("%-34s %d links: gateway RSS %d→%d KiB, PSS %d→%d KiB: %.0f KiB RSS per link\n", "gateway memory per idle link", idle,
		rss0, rss1, pss0, pss1, float64(rss1-rss0)/idle)
	for _, id := range ids {
		withNet.remove(id)
	}
}
