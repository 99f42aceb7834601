// Package gatewaytest has what tests of the network path share: a
// "sandbox" that is a netstack of its own on the far end of a NIC
// descriptor, a fake upstream DNS server on loopback, and a dialer that
// fails the test on any address off this machine.
package gatewaytest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/link/fdbased"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/icmp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"

	"github.com/spacehq/space/internal/runtime/hostnet"
)

// GuardDialer only ever dials loopback; any other address fails the test
// before a packet is sent.
type GuardDialer struct {
	T     *testing.T
	mu    sync.Mutex
	dials []string
}

func (d *GuardDialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(address)
	if err != nil || !ap.Addr().Unmap().IsLoopback() {
		d.T.Errorf("gateway tried to dial %s %s (off this machine)", network, address)
		return nil, fmt.Errorf("guard: %s refused", address)
	}
	d.mu.Lock()
	d.dials = append(d.dials, network+" "+address)
	d.mu.Unlock()
	var nd net.Dialer
	return nd.DialContext(ctx, network, address)
}

func (d *GuardDialer) Dialed(substr string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, s := range d.dials {
		if strings.Contains(s, substr) {
			return true
		}
	}
	return false
}

// Dials are the dials made so far ("network address").
func (d *GuardDialer) Dials() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.dials...)
}

// FakeDNS answers A queries from a fixed map on loopback and records every
// name it was asked.
type FakeDNS struct {
	Addr    string
	mu      sync.Mutex
	asked   []string
	answers map[string][]string // name → A records, or "cname:target"
	// queries are the queries as received (header, questions with the
	// name's case as sent, additional records), oldest first.
	queries []dnsmessage.Message
}

func StartDNS(t testing.TB, answers map[string][]string) *FakeDNS {
	d, stop, err := ServeDNS("127.0.0.1:0", answers)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return d
}

// ServeDNS is StartDNS for fixtures that outlive one test: the caller stops it.
func ServeDNS(addr string, answers map[string][]string) (*FakeDNS, func(), error) {
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		return nil, nil, err
	}
	d := &FakeDNS{Addr: pc.LocalAddr().String(), answers: answers}
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var m dnsmessage.Message
			if m.Unpack(buf[:n]) != nil || len(m.Questions) != 1 {
				continue
			}
			q := m.Questions[0]
			name := strings.TrimSuffix(strings.ToLower(q.Name.String()), ".")
			d.mu.Lock()
			d.asked = append(d.asked, name)
			d.queries = append(d.queries, dnsmessage.Message{Header: m.Header,
				Questions: append([]dnsmessage.Question(nil), m.Questions...), Additionals: append([]dnsmessage.Resource(nil), m.Additionals...)})
			m.Response = true
			recs, ok := d.answers[name]
			d.mu.Unlock()
			if !ok {
				m.RCode = dnsmessage.RCodeNameError
			}
			cur := q.Name
			for _, r := range recs {
				if target, isCNAME := strings.CutPrefix(r, "cname:"); isCNAME {
					tn := dnsmessage.MustNewName(target + ".")
					m.Answers = append(m.Answers, dnsmessage.Resource{
						Header: dnsmessage.ResourceHeader{Name: cur, Type: dnsmessage.TypeCNAME, Class: dnsmessage.ClassINET, TTL: 60},
						Body:   &dnsmessage.CNAMEResource{CNAME: tn}})
					cur = tn
					continue
				}
				m.Answers = append(m.Answers, dnsmessage.Resource{
					Header: dnsmessage.ResourceHeader{Name: cur, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 1},
					Body:   &dnsmessage.AResource{A: netip.MustParseAddr(r).As4()}})
			}
			out, _ := m.Pack()
			_, _ = pc.WriteTo(out, from)
		}
	}()
	return d, func() { pc.Close() }, nil
}

func (d *FakeDNS) WasAsked(name string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, n := range d.asked {
		if n == name {
			return true
		}
	}
	return false
}

// Queries are the queries received so far as they came (the question's
// name keeps the case it was sent in; WasAsked compares lowercased).
func (d *FakeDNS) Queries() []dnsmessage.Message {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]dnsmessage.Message(nil), d.queries...)
}

// SandboxStack is the "sandbox": a netstack of its own on the other end of
// a datagram socketpair (the shape of the microvm NIC).
type SandboxStack struct {
	S *stack.Stack
}

func NewSandboxStack(t testing.TB, fd int) *SandboxStack {
	mac, _ := net.ParseMAC(hostnet.SandboxMAC)
	ep, err := fdbased.New(&fdbased.Options{FDs: []int{fd}, MTU: hostnet.MTU, EthernetHeader: true, Address: tcpip.LinkAddress(mac)})
	if err != nil {
		t.Fatal(err)
	}
	s := stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol, icmp.NewProtocol4},
	})
	if err := s.CreateNIC(1, ep); err != nil {
		t.Fatal(err)
	}
	if err := s.AddProtocolAddress(1, tcpip.ProtocolAddress{Protocol: ipv4.ProtocolNumber,
		AddressWithPrefix: tcpip.AddressWithPrefix{Address: tcpip.AddrFrom4(netip.MustParseAddr(hostnet.SandboxAddr).As4()), PrefixLen: hostnet.PrefixLen}}, stack.AddressProperties{}); err != nil {
		t.Fatal(err)
	}
	s.SetRouteTable([]tcpip.Route{{Destination: header.IPv4EmptySubnet, Gateway: tcpip.AddrFrom4(netip.MustParseAddr(hostnet.GatewayAddr).As4()), NIC: 1}})
	t.Cleanup(func() { s.RemoveNIC(1); s.Destroy() })
	return &SandboxStack{S: s}
}

func (sb *SandboxStack) Query(t testing.TB, server netip.Addr, name string, qtype dnsmessage.Type) (dnsmessage.RCode, []netip.Addr, error) {
	t.Helper()
	c, err := gonet.DialUDP(sb.S, nil, &tcpip.FullAddress{Addr: tcpip.AddrFrom4(server.As4()), Port: 53}, ipv4.ProtocolNumber)
	if err != nil {
		return 0, nil, err
	}
	defer c.Close()
	m := dnsmessage.Message{Header: dnsmessage.Header{ID: 7, RecursionDesired: true},
		Questions: []dnsmessage.Question{{Name: dnsmessage.MustNewName(name + "."), Type: qtype, Class: dnsmessage.ClassINET}}}
	b, _ := m.Pack()
	if _, err := c.Write(b); err != nil {
		return 0, nil, err
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 1500)
	n, err := c.Read(buf)
	if err != nil {
		return 0, nil, err
	}
	var resp dnsmessage.Message
	if err := resp.Unpack(buf[:n]); err != nil {
		return 0, nil, err
	}
	var ips []netip.Addr
	for _, rr := range resp.Answers {
		if a, ok := rr.Body.(*dnsmessage.AResource); ok {
			ips = append(ips, netip.AddrFrom4(a.A))
		}
	}
	return resp.RCode, ips, nil
}

func (sb *SandboxStack) Dial(ip netip.Addr, port uint16) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	return gonet.DialContextTCP(ctx, sb.S, tcpip.FullAddress{Addr: tcpip.AddrFrom4(ip.As4()), Port: port}, ipv4.ProtocolNumber)
}

// get sends one HTTP request with host over a new connection to ip:port and
// returns the body (or the error: a reset connection).
func (sb *SandboxStack) Get(ip netip.Addr, port uint16, host string) (string, error) {
	c, err := sb.Dial(ip, port)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "GET /hello HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// Set replaces the records of name (nil removes it).
func (d *FakeDNS) Set(name string, recs []string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if recs == nil {
		delete(d.answers, name)
		return
	}
	d.answers[name] = recs
}

// Socks5 is a minimal SOCKS5 server (no authentication, CONNECT only) on
// loopback that records the targets it was asked for and dials only
// loopback ones.
type Socks5 struct {
	Addr    string
	ln      net.Listener
	mu      sync.Mutex
	targets []string
}

// StartSocks5 starts one on addr ("127.0.0.4:0"); it stops with the test.
func StartSocks5(t testing.TB, addr string) *Socks5 {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &Socks5{Addr: ln.Addr().String(), ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go s.serve(c)
		}
	}()
	return s
}

// Close stops accepting (a proxy that is down).
func (s *Socks5) Close() { s.ln.Close() }

// Targets are the host:port CONNECTs asked so far.
func (s *Socks5) Targets() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.targets...)
}

func (s *Socks5) serve(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	hdr := make([]byte, 2)
	if _, err := io.ReadFull(br, hdr); err != nil || hdr[0] != 5 {
		return
	}
	if _, err := io.ReadFull(br, make([]byte, hdr[1])); err != nil {
		return
	}
	_, _ = c.Write([]byte{5, 0})
	req := make([]byte, 4)
	if _, err := io.ReadFull(br, req); err != nil || req[1] != 1 || req[3] != 1 {
		_, _ = c.Write([]byte{5, 7, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	addr := make([]byte, 6)
	if _, err := io.ReadFull(br, addr); err != nil {
		return
	}
	target := netip.AddrPortFrom(netip.AddrFrom4([4]byte(addr[:4])), uint16(addr[4])<<8|uint16(addr[5]))
	s.mu.Lock()
	s.targets = append(s.targets, target.String())
	s.mu.Unlock()
	if !target.Addr().IsLoopback() {
		_, _ = c.Write([]byte{5, 2, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	up, err := net.Dial("tcp", target.String())
	if err != nil {
		_, _ = c.Write([]byte{5, 5, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	defer up.Close()
	_, _ = c.Write([]byte{5, 0, 0, 1, 127, 0, 0, 1, 0, 0})
	_ = c.SetDeadline(time.Time{})
	go func() { _, _ = io.Copy(up, br); up.Close() }()
	_, _ = io.Copy(c, up)
}

// ForgetAsked clears the record of names asked (a fixture shared by tests).
func (d *FakeDNS) ForgetAsked() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.asked = nil
	d.queries = nil
}

// Serve listens on port of the sandbox's own address and runs handle on
// each connection (which it then closes), until t ends: a service inside
// the sandbox.
func (sb *SandboxStack) Serve(t testing.TB, port uint16, handle func(net.Conn)) {
	ln, err := gonet.ListenTCP(sb.S, tcpip.FullAddress{Port: port}, ipv4.ProtocolNumber)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
}

// ServeHTTPPair starts HTTP (or HTTPS, with httptest's own certificate)
// servers on the same port of 127.0.0.2 and 127.0.0.3 — two "hosts" of a
// fake internet — that answer "hello from <their address> host=<Host>", so
// a test sees where a request landed and under which name. stop closes both.
func ServeHTTPPair(tlsOn bool) (port uint16, stop func(), err error) {
	for range 20 {
		a, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			return 0, nil, err
		}
		p := a.Addr().(*net.TCPAddr).Port
		b, err := net.Listen("tcp", fmt.Sprintf("127.0.0.3:%d", p))
		if err != nil {
			a.Close()
			continue
		}
		var servers []*httptest.Server
		for _, ln := range []net.Listener{a, b} {
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, "hello from %s host=%s", r.Context().Value(http.LocalAddrContextKey), r.Host)
			}))
			srv.Listener.Close()
			srv.Listener = ln
			if tlsOn {
				srv.StartTLS()
			} else {
				srv.Start()
			}
			servers = append(servers, srv)
		}
		return uint16(p), func() {
			for _, s := range servers {
				s.Close()
			}
		}, nil
	}
	return 0, nil, fmt.Errorf("no common free port on 127.0.0.2 and 127.0.0.3")
}
