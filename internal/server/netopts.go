package server

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway/gwctl"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/sandbox"
)

// NetworkOptions configure the network gateway that serves every sandbox's
// virtual NIC (`space server --egress-allow-private … --dns-upstream …
// --default-allow-out … --default-internet`).
type NetworkOptions struct {
	// AllowPrivate are the loopback, private, link-local or host ranges
	// sandboxes may reach when their policy allows them; nothing of these
	// is reachable otherwise, whatever a policy says.
	AllowPrivate []netip.Prefix
	// DNSUpstream is the resolver ("host:port") the gateway asks for the
	// names a policy allows; empty: the first nameserver of
	// /etc/resolv.conf, port 53.
	DNSUpstream string
	// Default is the policy of sandboxes whose request and template set
	// none. The zero value reaches nothing.
	Default api.NetworkPolicy

	// BandwidthMiB caps what one sandbox moves in each direction through
	// the gateway (MiB/s, all its connections together; 0: no cap).
	BandwidthMiB int64
	// Disabled runs no gateway: sandboxes get no network link at all
	// (benchmarks compare against it).
	Disabled bool
	// DialGuard "loopback" makes the gateway refuse, and log as a
	// violation, every dial off this machine (tests: nothing may leave it).
	DialGuard string
	// UpstreamCA is a PEM file of extra roots the gateway trusts for the
	// real hosts of intercepted (credential-brokered) connections, on top
	// of the system roots (tests: local HTTPS servers with their own CA).
	UpstreamCA string
	// GatewayBinary overrides discovery of space-gateway (else
	// $SPACE_GATEWAY_BIN, next to space, next to space-agent).
	GatewayBinary string

	// Filled by the server: its data directory (the gateway's state lives
	// in DataDir/network), the agent binary and logger.
	DataDir     string
	AgentBinary string
	Logger      *slog.Logger
}

// check validates the options and fills in DNSUpstream from
// /etc/resolv.conf when it is empty (left empty if there is none).
func (o *NetworkOptions) check() error {
	if err := netpolicy.Validate(o.Default); err != nil {
		return fmt.Errorf("the default network policy: %w", err)
	}
	for _, p := range o.AllowPrivate {
		if !p.IsValid() {
			return fmt.Errorf("egress-allow-private: an invalid prefix: %w", errdefs.ErrInvalidArgument)
		}
	}
	if o.DNSUpstream == "" {
		up, err := DefaultDNSUpstream("/etc/resolv.conf")
		if err != nil {
			// Left empty: a gateway that needs one says so when it starts;
			// a server without a gateway needs none.
			o.logger().Warn("no DNS upstream for sandboxes: none given (--dns-upstream) and none found", "err", err)
			return nil
		}
		o.DNSUpstream = up
	}
	host, port, err := net.SplitHostPort(o.DNSUpstream)
	if err != nil || host == "" || port == "" {
		return fmt.Errorf("dns-upstream %q must be host:port: %w", o.DNSUpstream, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (o *NetworkOptions) logger() *slog.Logger {
	if o.Logger != nil {
		return o.Logger
	}
	return slog.Default()
}

// DefaultDNSUpstream returns the first nameserver of a resolv.conf file as
// "host:53".
func DefaultDNSUpstream(resolvConf string) (string, error) {
	f, err := os.Open(resolvConf)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", resolvConf, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 || fields[0] != "nameserver" {
			continue
		}
		// A zone ("fe80::1%eth0") is kept: net.JoinHostPort brackets it.
		if _, err := netip.ParseAddr(fields[1]); err != nil {
			continue
		}
		return net.JoinHostPort(fields[1], "53"), nil
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("reading %s: %w", resolvConf, err)
	}
	return "", errors.New(resolvConf + " names no nameserver")
}

// startNetwork starts (or re-adopts) the network gateway process with opts
// and returns the manager's handle on it. Without a gateway binary, or
// where it cannot run (not root: it is started as its own unprivileged
// user), it returns nil with a warning: sandboxes then get no network link
// at all (the security default: nothing escapes), and their policies are
// stored but show attached=false.
//
// dec is the server's Decider: the gateway asks it about the DNS queries
// and connections of the sandboxes it applies to (decisions.go), once
// serveDecisions has started the stream.
func startNetwork(opts NetworkOptions, dec *deciderRef) (sandbox.Network, error) {
	log := opts.logger()
	if opts.Disabled {
		return nil, nil
	}
	bin := findBinary(opts.GatewayBinary, "SPACE_GATEWAY_BIN", "space-gateway")
	if bin == "" && opts.AgentBinary != "" {
		bin = findBinary(filepath.Join(filepath.Dir(opts.AgentBinary), "space-gateway"), "", "")
	}
	if bin == "" {
		log.Warn("space-gateway binary not found (make build, or set SPACE_GATEWAY_BIN): sandboxes get no network link")
		return nil, nil
	}
	if os.Geteuid() != 0 {
		log.Warn("not root: the network gateway cannot be started as its own user; sandboxes get no network link")
		return nil, nil
	}
	set := gwctl.Settings{DNSUpstream: opts.DNSUpstream, DialGuard: opts.DialGuard, BandwidthMiB: opts.BandwidthMiB, UpstreamCA: opts.UpstreamCA}
	for _, p := range opts.AllowPrivate {
		set.AllowPrivate = append(set.AllowPrivate, p.String())
	}
	set.Protect = hostAddresses()
	n := &gatewayNetwork{dec: dec, log: log}
	sup := &gwctl.Supervisor{Binary: bin, Dir: filepath.Join(opts.DataDir, "network"), Settings: set,
		Logger: log.With("component", "gateway"), OnRestart: func() {
			if f := n.onRestart.Load(); f != nil {
				(*f)()
			}
		}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := sup.Start(ctx); err != nil {
		return nil, err
	}
	n.Client, n.sup = sup.Client(), sup
	return n, nil
}

// gatewayNetwork is the supervised gateway as the manager's Network.
type gatewayNetwork struct {
	*gwctl.Client
	sup *gwctl.Supervisor
	// onRestart is what to do when the supervisor replaced a dead gateway
	// (the manager, once it exists, re-attaches every link).
	onRestart atomic.Pointer[func()]
	// dec answers the gateway's questions on the decisions stream, which
	// stopDecisions ends.
	dec           *deciderRef
	log           *slog.Logger
	stopDecisions context.CancelFunc
	decisionsDone chan struct{}
}

// Attach attaches with whether the server's Decider applies to the
// sandbox: if not, the gateway never asks about it.
func (n *gatewayNetwork) Attach(ctx context.Context, id string, nic *os.File, p api.NetworkPolicy) error {
	return n.Client.AttachDecide(ctx, id, nic, p, n.dec.applies(id))
}

// refreshScope re-tells the gateway, for every link, whether the Decider
// applies (after a rule change).
func (n *gatewayNetwork) refreshScope(ctx context.Context) {
	ids, err := n.Attached(ctx)
	if err != nil {
		n.log.Warn("telling the gateway which sandboxes have rules: listing its links", "err", err)
		return
	}
	for _, id := range ids {
		if err := n.SetDecide(ctx, id, n.dec.applies(id)); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			n.log.Warn("telling the gateway whether a sandbox has rules", "sandbox", id, "err", err)
		}
	}
}

// serveDecisions keeps the gateway's decisions stream open, answering with
// the server's Decider, until Close (re-opened after a gateway restart).
func (n *gatewayNetwork) serveDecisions(mgr *sandbox.Manager) {
	ctx, cancel := context.WithCancel(context.Background())
	n.stopDecisions, n.decisionsDone = cancel, make(chan struct{})
	go func() {
		defer close(n.decisionsDone)
		n.Client.RunDecisions(ctx, decideFor(n.dec, mgr), n.log.With("component", "decisions"))
	}()
}

// OnRestart sets what runs after a dead gateway was replaced.
func (n *gatewayNetwork) OnRestart(f func()) { n.onRestart.Store(&f) }

// Close stops supervising. The gateway keeps running while it serves any
// sandbox (the next server adopts it: a restart cuts no sandbox off); with
// nothing to serve it is stopped.
func (n *gatewayNetwork) Close() error {
	if n.stopDecisions != nil {
		n.stopDecisions()
		<-n.decisionsDone
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ids, err := n.Attached(ctx)
	n.sup.Close(err == nil && len(ids) == 0)
	return nil
}

// hostAddresses are the host's own interface addresses: never reachable
// from a sandbox, whatever the operator opened (the API listens on one).
func hostAddresses() []string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return []string{"127.0.0.1", "::1"}
	}
	var out []string
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, p.Addr().String())
		}
	}
	return out
}
