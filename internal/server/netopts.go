package server

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
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

	// Filled by the server: its data directory (the gateway's state lives
	// in DataDir/network) and logger.
	DataDir string
	Logger  *slog.Logger
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

// startNetwork starts the network gateway with opts and returns the
// manager's handle on it, or nil when this server has none: then sandboxes
// get no network link at all (the security default: nothing escapes). If
// the returned Network is an io.Closer, Server.Close closes it.
//
// TODO: the gateway supervisor lands in the same branch of work: it fills
// this in (start the confined gateway process, return its
// gateway/supervisor.Client).
func startNetwork(opts NetworkOptions) (sandbox.Network, error) {
	_ = opts
	return nil, nil
}
