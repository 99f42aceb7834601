package gateway

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/link/fdbased"
	"gvisor.dev/gvisor/pkg/tcpip/link/nested"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/icmp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

const nicID tcpip.NICID = 1

var (
	gatewayAddr = netip.MustParseAddr(hostnet.GatewayAddr)
	sandboxAddr = netip.MustParseAddr(hostnet.SandboxAddr)
)

// link is one sandbox's NIC, stack and state.
type link struct {
	g      *Gateway
	id     string
	fd     int
	stack  *stack.Stack
	events *eventRing

	policy atomic.Pointer[netpolicy.Policy]
	// broker is the credential-brokering config (nil: nothing is
	// intercepted); ruleCache the policy's header rules (mitm.go).
	broker    atomic.Pointer[broker]
	ruleCache atomic.Pointer[ruleCache]

	bindings *bindings
	dns      *dnsGuard

	connLimit *rate.Limiter
	mu        sync.Mutex
	conns     map[*relay]struct{}
	ingress   map[*ingressConn]struct{} // connections the host opened into the sandbox
	closed    bool

	dropEvents *rate.Limiter // bounds events of dropped packets
	dnsTCP     atomic.Int32  // open DNS-over-TCP connections
	bwOut      *rate.Limiter // nil: no bandwidth cap
	bwIn       *rate.Limiter
	bytesOut   atomic.Int64
	bytesIn    atomic.Int64
	queries    atomic.Int64

	// The temporal policy (decide.go): whether to ask, what waits for an
	// answer, and ctx, which ends every wait when the link goes.
	decideOn atomic.Bool
	open     atomic.Int32 // sandbox-opened connections, from SYN to close (Limits.MaxConns)
	heldDNS  atomic.Int32 // DNS queries waiting for a decision
	ctx      context.Context
	cancel   context.CancelFunc
}

func newLink(g *Gateway, id string, nic *os.File, pol *netpolicy.Policy, o LinkOptions) (_ *link, err error) {
	// Our own descriptor: the caller closes nic when Attach returns.
	fd, err := unix.FcntlInt(nic.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("gateway: dup nic: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	// A datagram socket (microvm) can batch reads; a TAP cannot.
	mode := fdbased.Readv
	if st, serr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); serr == nil && st == unix.SOCK_DGRAM {
		mode = fdbased.RecvMMsg
	}
	mac, _ := net.ParseMAC(hostnet.GatewayMAC)
	fdep, err := fdbased.New(&fdbased.Options{
		FDs:                []int{fd},
		MTU:                hostnet.MTU,
		EthernetHeader:     true,
		Address:            tcpip.LinkAddress(mac),
		PacketDispatchMode: mode,
		// A frame with a bad checksum from the sandbox can only corrupt
		// the sandbox's own connection; the sandbox kernel checks ours.
		RXChecksumOffload: true,
	})
	if err != nil {
		return nil, fmt.Errorf("gateway: link endpoint: %w", err)
	}
	lim := g.opts.Limits
	l := &link{
		g: g, id: id, fd: fd,
		events:     newEventRing(g.count),
		bindings:   newBindings(),
		dns:        newDNSGuard(lim),
		connLimit:  rate.NewLimiter(rate.Limit(lim.ConnsPerSecond), int(2*lim.ConnsPerSecond)+1),
		conns:      map[*relay]struct{}{},
		ingress:    map[*ingressConn]struct{}{},
		dropEvents: rate.NewLimiter(20, 40),
	}
	l.policy.Store(pol)
	l.decideOn.Store(o.Decide)
	l.ctx, l.cancel = context.WithCancel(context.Background())
	defer func() {
		if err != nil {
			l.cancel()
		}
	}()
	if b := lim.BandwidthBytesPerSecond; b > 0 {
		burst := int(min(b, 1<<20))
		l.bwOut = rate.NewLimiter(rate.Limit(b), burst)
		l.bwIn = rate.NewLimiter(rate.Limit(b), burst)
	}

	s := stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol, icmp.NewProtocol4},
	})
	l.stack = s
	// Room for bulk transfers over a fast virtual link (defaults are sized
	// for a real network's 1500-byte frames).
	sndBuf := tcpip.TCPSendBufferSizeRangeOption{Min: 4 << 10, Default: 1 << 20, Max: 8 << 20}
	rcvBuf := tcpip.TCPReceiveBufferSizeRangeOption{Min: 4 << 10, Default: 1 << 20, Max: 8 << 20}
	modRcv := tcpip.TCPModerateReceiveBufferOption(true)
	sack := tcpip.TCPSACKEnabled(true)
	for _, opt := range []tcpip.SettableTransportProtocolOption{&sndBuf, &rcvBuf, &modRcv, &sack} {
		if terr := s.SetTransportProtocolOption(tcp.ProtocolNumber, opt); terr != nil {
			s.Destroy()
			return nil, fmt.Errorf("gateway: tcp option: %s", terr)
		}
	}
	fil := &filter{l: l}
	fil.Init(fdep, fil)
	if terr := s.CreateNIC(nicID, fil); terr != nil {
		s.Destroy()
		return nil, fmt.Errorf("gateway: create nic: %s", terr)
	}
	if terr := s.AddProtocolAddress(nicID, tcpip.ProtocolAddress{
		Protocol:          ipv4.ProtocolNumber,
		AddressWithPrefix: tcpip.AddrFrom4(gatewayAddr.As4()).WithPrefix(),
	}, stack.AddressProperties{}); terr != nil {
		s.Destroy()
		return nil, fmt.Errorf("gateway: address: %s", terr)
	}
	s.SetRouteTable([]tcpip.Route{{Destination: header.IPv4EmptySubnet, NIC: nicID}})
	// Every destination is "ours": the forwarder sees each SYN, whatever
	// address the sandbox sent it to, and decides.
	s.SetPromiscuousMode(nicID, true)
	s.SetSpoofing(nicID, true)
	fwd := tcp.NewForwarder(s, 0, 512, l.handleTCP)
	s.SetTransportProtocolHandler(tcp.ProtocolNumber, fwd.HandlePacket)
	if err := l.serveDNSUDP(); err != nil {
		s.Destroy()
		return nil, err
	}
	return l, nil
}

func (l *link) setPolicy(pol *netpolicy.Policy) {
	l.policy.Store(pol)
	l.events.add(api.NetworkEvent{Protocol: "policy", Verdict: api.VerdictAllow, Reason: "policy replaced"})
	// Connections the new policy no longer allows end now.
	l.mu.Lock()
	var gone []*relay
	for r := range l.conns {
		if !l.stillAllowed(pol, r) {
			gone = append(gone, r)
		}
	}
	l.mu.Unlock()
	for _, r := range gone {
		r.abort("closed: policy no longer allows it")
	}
}

func (l *link) info() api.NetworkInfo {
	verdicts, dropped := l.events.counts()
	l.mu.Lock()
	open := int64(int(l.open.Load()) + len(l.ingress))
	l.mu.Unlock()
	return api.NetworkInfo{
		Policy:   l.policy.Load().Source(),
		Address:  hostnet.SandboxAddr,
		Gateway:  hostnet.GatewayAddr,
		Attached: true,
		Stats: api.NetworkStats{
			BytesOut: l.bytesOut.Load(), BytesIn: l.bytesIn.Load(),
			Connections: open, DNSQueries: l.queries.Load(),
			Verdicts: verdicts, EventsDropped: dropped,
		},
	}
}

func (l *link) close() {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	l.cancel()
	conns := l.conns
	l.conns = map[*relay]struct{}{}
	ingress := l.ingress
	l.ingress = map[*ingressConn]struct{}{}
	l.mu.Unlock()
	for r := range conns {
		r.abort("closed: link detached")
	}
	for c := range ingress {
		_ = c.end("closed: link detached")
	}
	// RemoveNIC stops the endpoint's reader before the descriptor goes.
	l.stack.RemoveNIC(nicID)
	l.stack.Destroy()
	unix.Close(l.fd)
	l.events.close()
}

// dropEvent records a dropped packet, rate-bounded so a flood of them
// keeps little of the ring's room for denials; those beyond the bound are
// counted in the ring's next summary.
func (l *link) dropEvent(ev api.NetworkEvent) {
	ev.Verdict = api.VerdictDrop
	if l.dropEvents.Allow() {
		l.events.add(ev)
	} else {
		l.events.aggregate(ev)
	}
}

// filter sits between the NIC and the stack and drops, before the stack
// sees them, every packet the gateway never serves: anything but IPv4 and
// ARP, UDP except DNS to the gateway, ICMP except to the gateway.
type filter struct {
	nested.Endpoint
	l *link
}

var _ stack.NetworkDispatcher = (*filter)(nil)

func (f *filter) DeliverNetworkPacket(proto tcpip.NetworkProtocolNumber, pkt *stack.PacketBuffer) {
	if f.admit(proto, pkt) {
		f.Endpoint.DeliverNetworkPacket(proto, pkt)
	}
}

func (f *filter) admit(proto tcpip.NetworkProtocolNumber, pkt *stack.PacketBuffer) bool {
	switch proto {
	case arp.ProtocolNumber:
		return true
	case ipv4.ProtocolNumber:
	default:
		return false // IPv6 and the rest: the link is IPv4 only
	}
	hdr, ok := pkt.Data().PullUp(header.IPv4MinimumSize)
	if !ok {
		return false
	}
	ip := header.IPv4(hdr)
	ihl := int(ip.HeaderLength())
	if ihl < header.IPv4MinimumSize {
		return false
	}
	dst := netip.AddrFrom4(ip.DestinationAddress().As4())
	switch ip.TransportProtocol() {
	case header.TCPProtocolNumber:
		return true // the forwarder decides
	case header.UDPProtocolNumber:
		full, ok := pkt.Data().PullUp(ihl + header.UDPMinimumSize)
		if !ok {
			return false
		}
		port := header.UDP(full[ihl:]).DestinationPort()
		if dst == gatewayAddr && port == 53 {
			return true
		}
		reason := "udp is not forwarded"
		proto := "udp"
		if port == 53 {
			reason, proto = "dns to an address other than the gateway", "dns"
		}
		f.l.dropEvent(api.NetworkEvent{Protocol: proto, IP: dst.String(), Port: int(port), Reason: reason})
		return false
	case header.ICMPv4ProtocolNumber:
		if dst == gatewayAddr {
			return true // ping of the gateway answers
		}
		f.l.dropEvent(api.NetworkEvent{Protocol: "icmp", IP: dst.String(), Reason: "icmp is not forwarded"})
		return false
	default:
		f.l.dropEvent(api.NetworkEvent{Protocol: "other", IP: dst.String(), Reason: fmt.Sprintf("ip protocol %d is not forwarded", ip.TransportProtocol())})
		return false
	}
}
