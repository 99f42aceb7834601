package gateway

import (
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
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

// attachLink attaches another sandbox id to f's gateway and returns its
// "sandbox".
func (f *fixture) attachLink(t *testing.T, id string, p api.NetworkPolicy) *gatewaytest.SandboxStack {
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
	return gatewaytest.NewSandboxStack(t, fds[1])
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
