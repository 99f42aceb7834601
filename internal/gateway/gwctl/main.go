package gwctl

import (
	"context"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/landlock-lsm/go-landlock/landlock"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/gateway"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/runtime/confine"
)

// Main is the gateway process (cmd/space-gateway). The supervisor starts it
// as an unprivileged user with the control listener on --control-fd; it
// confines itself before it reads a byte from any sandbox.
func Main(args []string) error {
	fs := flag.NewFlagSet("space-gateway", flag.ContinueOnError)
	controlFD := fs.Int("control-fd", 3, "inherited listening unix socket")
	upstream := fs.String("dns-upstream", "", "resolver for allowed names (host:port)")
	allowPrivate := fs.String("allow-private", "", "comma-separated CIDRs the operator opened")
	protect := fs.String("protect", "", "comma-separated ip or ip:port never reachable")
	bandwidthMiB := fs.Int64("bandwidth-mib", 0, "MiB/s one sandbox may move in each direction (0: no cap)")
	runAs := fs.Int("user", -1, "uid (and gid) to switch to when started as root, before anything else")
	guard := fs.String("dial-guard", "", `"loopback": refuse and report every dial off this machine (tests)`)
	upstreamCA := fs.String("upstream-ca", "", "PEM file of extra roots for the real hosts of intercepted connections (tests)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	popts, err := parseOptions(*allowPrivate, *protect)
	if err != nil {
		return err
	}
	// Read while the filesystem is still open (and before leaving root:
	// the file may be anywhere root can read).
	roots, err := upstreamRoots(*upstreamCA)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(*controlFD), "control")
	fl, err := net.FileListener(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("control listener: %w", err)
	}
	ln, ok := fl.(*net.UnixListener)
	if !ok {
		return errors.New("control descriptor is not a unix listener")
	}
	if os.Getuid() == 0 && *runAs > 0 {
		if err := dropTo(*runAs); err != nil {
			return err
		}
	}
	if os.Getuid() == 0 || os.Geteuid() == 0 {
		return errors.New("refusing to run as root: the gateway parses hostile bytes")
	}
	if err := confineSelf(); err != nil {
		return err
	}
	lim := gateway.DefaultLimits
	lim.BandwidthBytesPerSecond = *bandwidthMiB << 20
	g, err := gateway.New(gateway.Options{
		Limits:        lim,
		DNSUpstream:   *upstream,
		Policy:        popts,
		Dialer:        hostDialer(popts, *upstream, *guard, log),
		Logger:        log,
		UpstreamRoots: roots,
		// The server's policy, over the decisions stream it opens.
		Decider: &StreamDecider{},
	})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go exitWhenOrphanedAndIdle(ctx, g, stop, log)
	log.Info("gateway serving", "pid", os.Getpid(), "dns_upstream", *upstream, "allow_private", *allowPrivate, "dial_guard", *guard)
	err = Serve(ctx, ln, g, log)
	g.Close()
	return err
}

// upstreamRoots loads the system roots, plus the CA certificates in file if
// one is named. Loaded here, not lazily: once confined the gateway can open
// no file, and crypto/x509 would find no roots at the first handshake.
func upstreamRoots(file string) (*x509.CertPool, error) {
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if file == "" {
		return pool, nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--upstream-ca: %w", err)
	}
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("--upstream-ca %s: no PEM certificate", file)
	}
	return pool, nil
}

func parseOptions(allowPrivate, protect string) (netpolicy.Options, error) {
	var o netpolicy.Options
	for _, s := range splitList(allowPrivate) {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return o, fmt.Errorf("--allow-private %q: %w", s, err)
		}
		o.AllowPrivate = append(o.AllowPrivate, p.Masked())
	}
	for _, s := range splitList(protect) {
		if ap, err := netip.ParseAddrPort(s); err == nil {
			o.Protected = append(o.Protected, ap)
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return o, fmt.Errorf("--protect %q: %w", s, err)
		}
		o.Protected = append(o.Protected, netip.AddrPortFrom(a, 0))
	}
	return o, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// gatewaySyscalls is everything the gateway does once it serves: the Go
// runtime (threads, memory, timers, signals for preemption), the poller,
// sockets it accepts, dials and sends on, and the NIC descriptors it reads
// and writes. Measured with strace over the network test suite, plus what
// the runtime needs on rarer paths (munmap, mprotect, exit). No open, no
// exec, no ptrace, no mount: the filesystem is also closed by Landlock.
var gatewaySyscalls = []uint32{
	unix.SYS_READ, unix.SYS_WRITE, unix.SYS_READV, unix.SYS_WRITEV, unix.SYS_CLOSE, unix.SYS_FSTAT,
	unix.SYS_FCNTL, unix.SYS_PPOLL, unix.SYS_POLL,
	unix.SYS_EPOLL_CREATE1, unix.SYS_EPOLL_CTL, unix.SYS_EPOLL_WAIT, unix.SYS_EPOLL_PWAIT, unix.SYS_EVENTFD2, unix.SYS_PIPE2,
	unix.SYS_ACCEPT4, unix.SYS_CONNECT, unix.SYS_SHUTDOWN, unix.SYS_SOCKET,
	unix.SYS_GETSOCKNAME, unix.SYS_GETPEERNAME, unix.SYS_GETSOCKOPT, unix.SYS_SETSOCKOPT,
	unix.SYS_RECVMSG, unix.SYS_SENDMSG, unix.SYS_RECVFROM, unix.SYS_SENDTO, unix.SYS_RECVMMSG, unix.SYS_SENDMMSG,
	unix.SYS_MMAP, unix.SYS_MUNMAP, unix.SYS_MADVISE, unix.SYS_MPROTECT,
	unix.SYS_FUTEX, unix.SYS_NANOSLEEP, unix.SYS_CLOCK_NANOSLEEP, unix.SYS_CLOCK_GETTIME, unix.SYS_GETTIMEOFDAY,
	unix.SYS_SCHED_YIELD, unix.SYS_SCHED_GETAFFINITY, unix.SYS_GETRANDOM,
	unix.SYS_CLONE, unix.SYS_GETPID, unix.SYS_GETPPID, unix.SYS_GETTID, unix.SYS_TGKILL,
	unix.SYS_RT_SIGACTION, unix.SYS_RT_SIGPROCMASK, unix.SYS_RT_SIGRETURN, unix.SYS_SIGALTSTACK,
	unix.SYS_RESTART_SYSCALL, unix.SYS_EXIT, unix.SYS_EXIT_GROUP,
}

// confineSelf: no new privileges, not dumpable, no filesystem at all (Landlock, on every
// thread), a seccomp allowlist of its own (every thread).
func confineSelf() error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	// Brokered secrets and sandbox CA keys live in this process's memory:
	// no core dump, no ptrace or /proc/PID/mem by its own uid. (Leaving
	// root already did this; a gateway started as its user has not.)
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("dumpable: %w", err)
	}
	if err := landlock.V5.BestEffort().RestrictPaths(); err != nil {
		return fmt.Errorf("landlock: %w", err)
	}
	if err := confine.LoadServiceFilter(gatewaySyscalls); err != nil {
		return fmt.Errorf("seccomp: %w", err)
	}
	return nil
}

// hostDialer dials from the host's own sockets. Every dial is checked once
// more at the socket (after any name resolution, which never happens here:
// the gateway only dials addresses): a non-public address outside the
// operator's ranges, or a protected one, is refused whatever called. With
// guard "loopback" anything off 127.0.0.0/8 is refused and reported.
//
// The operator's DNS upstream is the one exception to the address rules
// (it often is a loopback or private resolver); the policy still decides
// whether a sandbox's own connection may go there.
func hostDialer(o netpolicy.Options, upstream, guard string, log *slog.Logger) gateway.Dialer {
	return &net.Dialer{
		Timeout: 10 * time.Second,
		Control: func(network, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return fmt.Errorf("dial %s: %w", address, err)
			}
			ip := ap.Addr().Unmap()
			if guard == "loopback" && !ip.IsLoopback() {
				log.Error("DIAL GUARD VIOLATION: refused a dial off this machine", "network", network, "address", address)
				return fmt.Errorf("dial guard: %s is not on this machine", address)
			}
			if network == "udp" || network == "udp4" || network == "udp6" {
				if up, err := netip.ParseAddrPort(upstream); err == nil && up.Addr().Unmap() == ip && up.Port() == ap.Port() {
					return nil
				}
			}
			if why := o.Unreachable(ip, ap.Port()); why != "" {
				return fmt.Errorf("dial %s: %s", address, why)
			}
			return nil
		},
	}
}

// exitWhenOrphanedAndIdle ends the gateway once the server that started it
// is gone and no sandbox has a link: nothing would be lost, and nothing else
// would ever stop it. With links it stays for the next server to adopt.
func exitWhenOrphanedAndIdle(ctx context.Context, g *gateway.Gateway, stop func(), log *slog.Logger) {
	parent := os.Getppid()
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if os.Getppid() != parent && len(g.Attached()) == 0 {
			log.Info("server gone and no links: exiting")
			stop()
			return
		}
	}
}

// dropTo switches every thread to uid and gid id with no supplementary
// groups; leaving root clears every capability. The supervisor starts the
// gateway as root and lets it do this itself (rather than exec it as the
// user) so that the binary may live under a directory only root can
// search, as a checkout or an install under /root does.
func dropTo(id int) error {
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(id, id, id); err != nil {
		return fmt.Errorf("setresgid %d: %w", id, err)
	}
	if err := syscall.Setresuid(id, id, id); err != nil {
		return fmt.Errorf("setresuid %d: %w", id, err)
	}
	return nil
}
