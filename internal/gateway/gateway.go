// Package gateway is the far end of every sandbox's virtual NIC: one
// user-space TCP/IP stack (gVisor's netstack) per sandbox, in a process of
// its own (cmd/space-gateway), that answers the sandbox's DNS, terminates
// every TCP connection the sandbox opens and re-originates from the host's
// own sockets only what the sandbox's policy allows (internal/netpolicy).
//
// The host kernel never routes a sandbox packet: frames arrive on a
// descriptor (a TAP device or a datagram socket) and end in this package.
// Each sandbox has a stack of its own, so sandboxes can never reach each
// other, and nothing but the policy decides what the host dials.
//
// Rules that hold by construction:
//   - DNS is answered only here; a denied name gets NXDOMAIN and is never
//     forwarded; an allowed name's A records are filtered and recorded as
//     bindings (sandbox, name → IP, expiry).
//   - A TCP connection is allowed to an allowed CIDR, or to an IP this
//     gateway resolved for an allowed name for THIS sandbox; then the TLS SNI
//     or HTTP Host must be such a name bound to that IP.
//   - UDP other than DNS to the gateway, and ICMP other than ping of the
//     gateway, are dropped.
package gateway

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
)

// Dialer re-originates allowed connections (and DNS upstream queries) from
// the host. Tests inject one that refuses, and fails the test on, any
// address off this machine.
type Dialer interface {
	DialContext(ctx context.Context, network, address string) (net.Conn, error)
}

// Limits bound what one sandbox may make the gateway do.
type Limits struct {
	MaxConns       int     // concurrent TCP connections
	ConnsPerSecond float64 // new TCP connections per second (burst 2×)
	// BandwidthBytesPerSecond, if > 0, caps what one sandbox moves in each
	// direction, all its connections together (token buckets).
	BandwidthBytesPerSecond int64
	// DNSPerSecond bounds the DNS queries of one sandbox, every query
	// (UDP or TCP, allowed name or not) charged as it arrives, before any
	// other work. Token bucket, burst one second's worth: of the queries
	// arriving within any t seconds at most DNSPerSecond×(1+t) are
	// admitted; the rest get REFUSED.
	DNSPerSecond float64
	// NamesPerZone bounds distinct names queried under one wildcard zone
	// per ZoneWindow (exfiltration through <data>.allowed-zone).
	NamesPerZone int
	ZoneWindow   time.Duration
	// MaxLabel bounds each label of a name queried under a wildcard zone.
	MaxLabel int
}

// DefaultLimits are generous for real work and small for abuse.
var DefaultLimits = Limits{
	MaxConns:       512,
	ConnsPerSecond: 200,
	DNSPerSecond:   200,
	NamesPerZone:   200,
	ZoneWindow:     10 * time.Minute,
	MaxLabel:       40,
}

// Options configure a Gateway.
type Options struct {
	// DNSUpstream is the resolver allowed names are forwarded to (ip:port);
	// empty: allowed names get SERVFAIL.
	DNSUpstream string
	Policy      netpolicy.Options
	Limits      Limits
	Dialer      Dialer
	Logger      *slog.Logger
	// MinTTL clamps answer TTLs up (seconds); bindings live at least
	// BindingTTL so a client that caches an answer longer still connects.
	MinTTL     uint32
	BindingTTL time.Duration
	// Decider decides DNS queries, connections and intercepted HTTP
	// requests against the temporal policy (it may hold an action while an
	// approval is pending); nil allows all.
	Decider actions.Decider
	// UpstreamRoots verify the real hosts' certificates on intercepted
	// connections (credential brokering); nil: the system roots. Tests
	// and the hidden --egress-upstream-ca add their own CA.
	UpstreamRoots *x509.CertPool
}

// Gateway serves the links of many sandboxes.
type Gateway struct {
	opts Options
	log  *slog.Logger

	mu    sync.Mutex
	links map[string]*link

	cmu    sync.Mutex
	counts map[string]int64 // "protocol/verdict" → events, all links ever
}

// New returns a Gateway. Options.Dialer is required: the caller decides how
// the host dials (cmd/space-gateway guards it).
func New(opts Options) (*Gateway, error) {
	if opts.Dialer == nil {
		return nil, errors.New("gateway: no dialer")
	}
	if _, err := netip.ParseAddrPort(opts.DNSUpstream); err != nil && opts.DNSUpstream != "" {
		return nil, fmt.Errorf("gateway: dns upstream %q: %w", opts.DNSUpstream, err)
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Limits == (Limits{}) {
		opts.Limits = DefaultLimits
	}
	if opts.Decider == nil {
		opts.Decider = actions.AllowAll{}
	}
	if opts.MinTTL == 0 {
		opts.MinTTL = 10
	}
	if opts.BindingTTL == 0 {
		opts.BindingTTL = 5 * time.Minute
	}
	return &Gateway{opts: opts, log: opts.Logger, links: map[string]*link{}, counts: map[string]int64{}}, nil
}

// Attach starts serving one sandbox's NIC. The gateway takes its own
// duplicate of nic; the caller keeps (and closes) nic. Attaching an id that
// is attached replaces the old link (and ends its connections). The link
// asks Options.Decider (LinkOptions.Decide); AttachWith can say otherwise.
func (g *Gateway) Attach(id string, nic *os.File, p api.NetworkPolicy) error {
	return g.AttachWith(id, nic, p, LinkOptions{Decide: true})
}

// AttachWith is Attach with the link's options.
func (g *Gateway) AttachWith(id string, nic *os.File, p api.NetworkPolicy, o LinkOptions) error {
	pol, err := netpolicy.Compile(p, g.opts.Policy)
	if err != nil {
		return err
	}
	l, err := newLink(g, id, nic, pol, o)
	if err != nil {
		return err
	}
	g.mu.Lock()
	old := g.links[id]
	g.links[id] = l
	g.mu.Unlock()
	if old != nil {
		old.close()
	}
	g.log.Info("link attached", "sandbox", id)
	return nil
}

// SetPolicy replaces the policy of an attached sandbox.
func (g *Gateway) SetPolicy(id string, p api.NetworkPolicy) error {
	pol, err := netpolicy.Compile(p, g.opts.Policy)
	if err != nil {
		return err
	}
	l, err := g.link(id)
	if err != nil {
		return err
	}
	l.setPolicy(pol)
	return nil
}

// Decider is Options.Decider (AllowAll when none was given).
func (g *Gateway) Decider() actions.Decider { return g.opts.Decider }

// Detach stops serving id. Idempotent.
func (g *Gateway) Detach(id string) {
	g.mu.Lock()
	l := g.links[id]
	delete(g.links, id)
	g.mu.Unlock()
	if l != nil {
		l.close()
		g.log.Info("link detached", "sandbox", id)
	}
}

// Info returns the link's policy and counters.
func (g *Gateway) Info(id string) (api.NetworkInfo, error) {
	l, err := g.link(id)
	if err != nil {
		return api.NetworkInfo{}, err
	}
	return l.info(), nil
}

// Events streams the link's events (see eventRing.follow).
func (g *Gateway) Events(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	l, err := g.link(id)
	if err != nil {
		return err
	}
	return l.events.follow(ctx, after, follow, fn)
}

// Attached lists the attached ids, sorted.
func (g *Gateway) Attached() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	ids := make([]string, 0, len(g.links))
	for id := range g.links {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// Close detaches every link.
func (g *Gateway) Close() {
	for _, id := range g.Attached() {
		g.Detach(id)
	}
}

func (g *Gateway) count(ev api.NetworkEvent) {
	g.cmu.Lock()
	g.counts[ev.Protocol+"/"+ev.Verdict]++
	g.cmu.Unlock()
}

// Counters returns the events of every link since the gateway started, by
// "protocol/verdict" (Prometheus counters of the server).
func (g *Gateway) Counters() map[string]int64 {
	g.cmu.Lock()
	defer g.cmu.Unlock()
	out := make(map[string]int64, len(g.counts))
	for k, v := range g.counts {
		out[k] = v
	}
	return out
}

func (g *Gateway) link(id string) (*link, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	l := g.links[id]
	if l == nil {
		return nil, fmt.Errorf("%w: sandbox %q has no network link", errdefs.ErrNotFound, id)
	}
	return l, nil
}
