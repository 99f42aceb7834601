package gateway

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

// dialDNS is a UDP socket of the sandbox connected to the gateway's port 53.
func dialDNS(t *testing.T, sb *gatewaytest.SandboxStack) *gonet.UDPConn {
	t.Helper()
	c, err := gonet.DialUDP(sb.S, nil, &tcpip.FullAddress{Addr: tcpip.AddrFrom4(gatewayAddr.As4()), Port: 53}, ipv4.ProtocolNumber)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func packQuery(t *testing.T, id uint16, name string) []byte {
	t.Helper()
	m := dnsmessage.Message{Header: dnsmessage.Header{ID: id, RecursionDesired: true},
		Questions: []dnsmessage.Question{{Name: dnsmessage.MustNewName(name + "."), Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET}}}
	b, err := m.Pack()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// attachLink attaches another sandbox id to f's gateway and returns its
// "sandbox".
func (f *fixture) attachLink(t *testing.T, id string, p api.NetworkPolicy) *gatewaytest.SandboxStack {
	t.Helper()
	return gatewaytest.NewSandboxStack(t, f.attachRaw(t, id, p))
}

// TestDNSCanonicalCaseUpstream: the upstream sees an allowed name in one
// form (lowercase) whatever case the sandbox asked in, so letter case
// (0x20 bits) carries nothing out; nothing else of the upstream query is
// the sandbox's either (flags, EDNS). The sandbox still gets its own
// question back, case and ID included.
func TestDNSCanonicalCaseUpstream(t *testing.T) {
	lim := DefaultLimits
	lim.DNSPerSecond = 1e5 // this test is about case, not rate
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, lim)
	c := dialDNS(t, f.sb)
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 300
	for i := range n {
		variant := "AlLoWeD.TeSt"
		if i > 0 {
			b := []byte("allowed.test")
			for j := range b {
				if b[j] != '.' && rng.IntN(2) == 0 {
					b[j] -= 'a' - 'A'
				}
			}
			variant = string(b)
		}
		opt := dnsmessage.Resource{Body: &dnsmessage.OPTResource{Options: []dnsmessage.Option{{Code: 10, Data: []byte{byte(i), byte(i >> 8), 1, 2, 3, 4, 5, 6}}}}}
		if err := opt.Header.SetEDNS0(4096, dnsmessage.RCodeSuccess, true); err != nil {
			t.Fatal(err)
		}
		m := dnsmessage.Message{
			Header:      dnsmessage.Header{ID: uint16(0x4000 + i), RecursionDesired: i%2 == 0, AuthenticData: true, CheckingDisabled: true},
			Questions:   []dnsmessage.Question{{Name: dnsmessage.MustNewName(variant + "."), Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET}},
			Additionals: []dnsmessage.Resource{opt},
		}
		b, err := m.Pack()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 1500)
		k, err := c.Read(buf)
		if err != nil {
			t.Fatalf("query %d (%s): %v", i, variant, err)
		}
		var r dnsmessage.Message
		if err := r.Unpack(buf[:k]); err != nil {
			t.Fatal(err)
		}
		if r.ID != m.ID || r.RCode != dnsmessage.RCodeSuccess || len(r.Questions) != 1 || r.Questions[0].Name.String() != variant+"." ||
			len(r.Answers) != 1 || r.Answers[0].Body.(*dnsmessage.AResource).A != ip2.As4() {
			t.Fatalf("query %d (%s): reply %+v", i, variant, r)
		}
	}
	qs := f.dns.Queries()
	if len(qs) != n {
		t.Fatalf("upstream got %d queries, want %d", len(qs), n)
	}
	for i, q := range qs {
		if len(q.Questions) != 1 || q.Questions[0].Name.String() != "allowed.test." || q.Questions[0].Type != dnsmessage.TypeA ||
			q.Questions[0].Class != dnsmessage.ClassINET {
			t.Fatalf("upstream query %d: questions %+v", i, q.Questions)
		}
		if len(q.Additionals) != 0 || q.AuthenticData || q.CheckingDisabled || !q.RecursionDesired || q.OpCode != 0 || q.Response {
			t.Fatalf("upstream query %d carries what the sandbox chose: %+v", i, q)
		}
	}
}

// TestDNSRateBurst: a burst of queries much faster than the rate admits
// at most burst + rate×elapsed (burst = one second's worth, 200), the rest
// REFUSED.
func TestDNSRateBurst(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	c := dialDNS(t, f.sb)
	const n = 1200
	var admitted, refused, other atomic.Int64
	var last atomic.Int64 // unix nanos of the last reply read
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for admitted.Load()+refused.Load()+other.Load() < n {
			_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
			k, err := c.Read(buf)
			if err != nil {
				return // the rest were dropped
			}
			last.Store(time.Now().UnixNano())
			var p dnsmessage.Parser
			h, err := p.Start(buf[:k])
			switch {
			case err != nil:
				other.Add(1)
			case h.RCode == dnsmessage.RCodeRefused:
				refused.Add(1)
			case h.RCode == dnsmessage.RCodeSuccess:
				admitted.Add(1)
			default:
				other.Add(1)
			}
		}
	}()
	queries := make([][]byte, n)
	for i := range queries {
		queries[i] = packQuery(t, uint16(i), "allowed.test")
	}
	start := time.Now()
	for i, q := range queries {
		if _, err := c.Write(q); err != nil {
			t.Fatal(err)
		}
		if i%16 == 15 {
			// Fast, but not so fast that the link's buffers drop what
			// the limiter is to count.
			time.Sleep(time.Millisecond)
		}
	}
	sent := time.Since(start)
	<-done
	elapsed := time.Duration(last.Load() - start.UnixNano())
	lim := DefaultLimits
	bound := lim.DNSPerSecond + lim.DNSPerSecond*elapsed.Seconds() + 2
	t.Logf("burst of %d sent in %v, last reply after %v: %d admitted, %d refused, %d other, %d unanswered; bound %.0f",
		n, sent, elapsed, admitted.Load(), refused.Load(), other.Load(), n-admitted.Load()-refused.Load()-other.Load(), bound)
	if float64(admitted.Load()) > bound {
		t.Errorf("%d queries admitted in %v: more than burst + rate×elapsed = %.0f", admitted.Load(), elapsed, bound)
	}
	if admitted.Load() < int64(lim.DNSPerSecond)/2 || refused.Load() == 0 {
		t.Errorf("the burst was not served as a burst: %d admitted, %d refused", admitted.Load(), refused.Load())
	}
}

// attachRaw attaches sandbox id to f's gateway and returns the sandbox's
// end of its NIC as a bare descriptor (blocking writes: a sender goes as
// fast as the gateway reads), for a test that plays a hostile guest kernel.
func (f *fixture) attachRaw(t *testing.T, id string, p api.NetworkPolicy) int {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	defer nic.Close()
	if err := f.g.Attach(id, nic, p); err != nil {
		t.Fatal(err)
	}
	return fds[1]
}

// udpFrame is an Ethernet frame from the sandbox to the gateway's port 53
// carrying payload.
func udpFrame(srcPort uint16, payload []byte) []byte {
	gwMAC, _ := net.ParseMAC(hostnet.GatewayMAC)
	sbMAC, _ := net.ParseMAC(hostnet.SandboxMAC)
	b := make([]byte, header.EthernetMinimumSize+header.IPv4MinimumSize+header.UDPMinimumSize+len(payload))
	header.Ethernet(b).Encode(&header.EthernetFields{SrcAddr: tcpip.LinkAddress(sbMAC), DstAddr: tcpip.LinkAddress(gwMAC), Type: header.IPv4ProtocolNumber})
	ip := header.IPv4(b[header.EthernetMinimumSize:])
	ip.Encode(&header.IPv4Fields{TotalLength: uint16(len(ip)), TTL: 64, Protocol: uint8(header.UDPProtocolNumber),
		SrcAddr: tcpip.AddrFrom4(sandboxAddr.As4()), DstAddr: tcpip.AddrFrom4(gatewayAddr.As4())})
	ip.SetChecksum(^ip.CalculateChecksum())
	u := header.UDP(ip[header.IPv4MinimumSize:])
	u.Encode(&header.UDPFields{SrcPort: srcPort, DstPort: 53, Length: uint16(len(u))})
	copy(u[header.UDPMinimumSize:], payload)
	return b
}

// TestDNSFloodBounded: a flood of datagrams at the gateway's port 53 (a
// hostile guest writing frames as fast as the gateway reads them) costs
// the gateway a bounded number of goroutines, and so of memory; another
// link answers during and after it, the flooded one once its rate allows.
func TestDNSFloodBounded(t *testing.T) {
	pol := api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}
	f := newFixture(t, pol)
	fd := f.attachRaw(t, "flood", pol)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	heapBefore, sysBefore := ms.HeapInuse, ms.Sys
	baseline := runtime.NumGoroutine()

	const n = 50000
	frames := make([][]byte, 0, 64)
	for i := range 64 {
		name := "allowed.test"
		if i%2 == 1 {
			name = fmt.Sprintf("x%d.denied.test", i)
		}
		frames = append(frames, udpFrame(uint16(20000+i), packQuery(t, uint16(i), name)))
	}
	var maxG, maxHeap atomic.Int64
	var profile string // of the goroutines at the highest count past baseline+60
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the sampler
		defer wg.Done()
		var ms runtime.MemStats
		for i := 0; ; i++ {
			if g := int64(runtime.NumGoroutine()); g > maxG.Load() {
				maxG.Store(g)
				if g > int64(baseline+60) {
					var b strings.Builder
					_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
					profile = b.String()
				}
			}
			if i%20 == 0 {
				runtime.ReadMemStats(&ms)
				if h := int64(ms.HeapInuse); h > maxHeap.Load() {
					maxHeap.Store(h)
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	start := time.Now()
	during := make(chan error, 1)
	for i := range n {
		if _, err := unix.Write(fd, frames[i%len(frames)]); err != nil {
			t.Fatal(err)
		}
		if i == n/2 {
			// Another sandbox's DNS while this one floods.
			go func() {
				rc, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA)
				if err == nil && (rc != dnsmessage.RCodeSuccess || len(ips) != 1) {
					err = fmt.Errorf("rcode %v ips %v", rc, ips)
				}
				during <- err
			}()
		}
	}
	sent := time.Since(start)
	time.Sleep(500 * time.Millisecond) // what is queued drains
	close(stop)
	wg.Wait()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	l, err := f.g.link("flood")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d datagrams written in %v; goroutines: baseline %d, max %d; heap in use: before %.1f MiB, peak %.1f MiB, after %.1f MiB; sys before %.1f MiB, after %.1f MiB; queries received %d, dropped with the queue full %d",
		n, sent, baseline, maxG.Load(), mib(heapBefore), mib(uint64(maxHeap.Load())), mib(ms.HeapInuse), mib(sysBefore), mib(ms.Sys), l.queries.Load(), l.dns.dropped.Load())
	// The bound per link is 1 reader + 8 workers + 64 queries waiting for
	// a decision, plus the other link's and the runtime's own; unbounded,
	// a flood makes thousands. 200 leaves room for scheduling noise on a
	// busy CI machine without hiding a leak.
	if maxG.Load() > int64(baseline+200) {
		t.Errorf("goroutines reached %d during the flood (baseline %d):\n%s", maxG.Load(), baseline, profile)
	}
	if err := <-during; err != nil {
		t.Errorf("another link during the flood: %v", err)
	}
	if rc, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 {
		t.Errorf("another link after the flood: %v %v %v", rc, ips, err)
	}
	// The flooded link answers again once what it queued is read and its
	// rate limiter has refilled (a second; longer under the race detector).
	sb := gatewaytest.NewSandboxStack(t, fd)
	for prev := int64(-1); prev != l.queries.Load(); time.Sleep(200 * time.Millisecond) {
		prev = l.queries.Load()
	}
	time.Sleep(1100 * time.Millisecond)
	deadline := time.Now().Add(10 * time.Second)
	for {
		rc, ips, err := sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA)
		if err == nil && rc == dnsmessage.RCodeSuccess && len(ips) == 1 {
			break
		}
		if time.Now().After(deadline) {
			evs := f.g.eventsOf(t, "flood")
			t.Fatalf("the flooded link after the flood: %v %v %v; last events %+v", rc, ips, err, evs[max(0, len(evs)-3):])
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func (g *Gateway) eventsOf(t *testing.T, id string) []api.NetworkEvent {
	var out []api.NetworkEvent
	if err := g.Events(context.Background(), id, 0, false, func(ev api.NetworkEvent) error {
		out = append(out, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func mib(b uint64) float64 { return float64(b) / (1 << 20) }
