// Package hostcli is the host-side half of the space CLI, linked only into
// the space-server binary: `space server` (internal/server), `space
// template build-base --local` (internal/template), `space policy test`
// (internal/policy) and `space mcp` (internal/mcpserver). The space client
// binary links none of these and hands those commands to space-server
// (cli.Host), so its start-up initialises no server package.
package hostcli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cli"
	"github.com/spacehq/space/internal/mcpserver"
	"github.com/spacehq/space/internal/policy"
	"github.com/spacehq/space/internal/replica"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/sdk"
)

// Host is the host-side half of the CLI, for cli.ExecuteHost.
func Host() *cli.Host {
	return &cli.Host{Server: newServerCmd, Node: newNodeCmd, Cluster: newClusterCmd, BuildBaseLocal: buildBaseLocal, PolicyTest: policyTest, MCP: serveMCP}
}

// Main is the space-server binary: the whole CLI over os.Args, host-side
// commands included.
func Main(ctx context.Context) int {
	return Execute(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
}

// Execute is cli.Execute with the host-side commands run in this process.
func Execute(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return cli.ExecuteHost(ctx, Host(), args, stdin, stdout, stderr)
}

// buildBaseLocal builds only the cached base root filesystem in cacheDir.
func buildBaseLocal(ctx context.Context, cacheDir string, progress func(sdk.BuildProgress)) (string, error) {
	return template.BuildBase(ctx, cacheDir, func(p template.Progress) {
		progress(sdk.BuildProgress{Phase: p.Phase, Done: int64(p.Done), Total: int64(p.Total), Message: p.Message})
	})
}

// serveMCP is `space mcp`: the MCP server over stdio until the client
// closes stdin.
func serveMCP(ctx context.Context, c *sdk.Client, in io.Reader, out io.Writer) error {
	srv := mcpserver.New(c, mcpserver.Options{})
	err := srv.Run(ctx, &mcp.IOTransport{Reader: io.NopCloser(in), Writer: nopWriteCloser{out}})
	// The client closing stdin is how a stdio session ends.
	if errors.Is(err, io.EOF) || errors.Is(err, mcp.ErrConnectionClosed) || ctx.Err() != nil {
		return nil
	}
	return err
}

type nopWriteCloser struct{ io.Writer }

func (nopWriteCloser) Close() error { return nil }

// serverNetFlags are `space server`'s network gateway flags.
type serverNetFlags struct {
	allowPrivate    []string
	dnsUpstream     string
	defaultAllowOut []string
	defaultPrivate  []string
	defaultInternet bool
	dialGuard       string
	bandwidth       string
	upstreamCA      string
}

func (f *serverNetFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringSliceVar(&f.allowPrivate, "egress-allow-private", nil, "CIDR[,CIDR]: loopback, private or link-local ranges sandboxes may reach when their policy allows them — an allow_out IP/CIDR inside one, or allow_private for names (none by default; the outer limit of every policy)")
	fl.StringVar(&f.dnsUpstream, "dns-upstream", "", "HOST:PORT of the resolver the gateway asks for allowed names (default: the first nameserver of /etc/resolv.conf, port 53)")
	fl.StringArrayVar(&f.defaultAllowOut, "default-allow-out", nil, "allow-out entry of the default policy, for sandboxes whose request and template set none (repeatable)")
	fl.StringArrayVar(&f.defaultPrivate, "default-allow-private", nil, "allow_private entry of the default policy: a loopback/private CIDR its names may lead into, within --egress-allow-private (repeatable)")
	fl.BoolVar(&f.defaultInternet, "default-internet", false, "the default policy allows every public destination")
	fl.StringVar(&f.bandwidth, "egress-bandwidth", "", "cap on what one sandbox moves in each direction through the gateway, per second (e.g. 10m, 1g; default no cap)")
	// Tests: the gateway refuses (and logs as a violation) any dial off this machine.
	fl.StringVar(&f.dialGuard, "egress-dial-guard", "", `"loopback": the gateway refuses and reports every dial off this machine (tests)`)
	_ = fl.MarkHidden("egress-dial-guard")
	// Tests: a local HTTPS server with its own CA stands in for a brokered host.
	fl.StringVar(&f.upstreamCA, "egress-upstream-ca", "", "PEM file of extra roots the gateway trusts for the real hosts of intercepted connections (tests)")
	_ = fl.MarkHidden("egress-upstream-ca")
}

// options checks the flags and builds the server's NetworkOptions; the
// server validates the default policy itself.
func (f *serverNetFlags) options() (server.NetworkOptions, error) {
	if f.dialGuard != "" && f.dialGuard != "loopback" {
		return server.NetworkOptions{}, usagef("--egress-dial-guard %q: only \"loopback\"", f.dialGuard)
	}
	var bw int64
	if f.bandwidth != "" {
		var err error
		if bw, err = cli.ParseMiB(f.bandwidth); err != nil {
			return server.NetworkOptions{}, usagef("--egress-bandwidth: %v", err)
		}
	}
	o := server.NetworkOptions{DNSUpstream: f.dnsUpstream, DialGuard: f.dialGuard, BandwidthMiB: bw, UpstreamCA: f.upstreamCA,
		Default: api.NetworkPolicy{Internet: f.defaultInternet, AllowOut: f.defaultAllowOut, AllowPrivate: f.defaultPrivate}}
	for _, s := range f.allowPrivate {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return o, usagef("--egress-allow-private %q: want a CIDR such as 10.0.0.0/8 or an IP", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		o.AllowPrivate = append(o.AllowPrivate, p.Masked())
	}
	return o, nil
}

func newServerCmd(e cli.Env) *cobra.Command { return newServeCmd(e, false) }

// newNodeCmd is `space node`: `space server` whose --cluster-store is
// required.
func newNodeCmd(e cli.Env) *cobra.Command { return newServeCmd(e, true) }

func newServeCmd(e cli.Env, node bool) *cobra.Command {
	cfg := server.Config{}
	var nf serverNetFlags
	var rc replica.Config
	cmd := &cobra.Command{
		Use:   "server",
		Short: "Run the space API server and node services",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if node && cfg.Cluster.Store == "" {
				return usagef("space node needs --cluster-store (the cluster's PostgreSQL DSN); a single box is `space server`")
			}
			if rc.Store != "" {
				if node || cfg.Cluster.Store != "" {
					return usagef("--store makes an API replica, --cluster-store a node: a process is one or the other")
				}
				if cfg.Cluster.Listen != "" {
					return usagef("--cluster-listen is a node's; a replica serves --listen only")
				}
				rc.Listen, rc.DataDir = cfg.Listen, cfg.DataDir
				rc.CAFile, rc.CertFile, rc.KeyFile = cfg.Cluster.CAFile, cfg.Cluster.CertFile, cfg.Cluster.KeyFile
				rc.SecretsKeyFile = cfg.Cluster.SecretsKeyFile
				if rc.NodeTimeout <= 0 {
					return usagef("--node-timeout must be positive")
				}
				rc.Logger = slog.New(slog.NewTextHandler(e.Err, nil))
				ctx, stop := signal.NotifyContext(e.Ctx, os.Interrupt, syscall.SIGTERM)
				defer stop()
				return replica.Run(ctx, rc)
			}
			if cfg.DataDir == "" || cfg.CacheDir == "" || cfg.Listen == "" {
				return usagef("--data, --cache and --listen must not be empty")
			}
			if cfg.Audit.RetainAge < 0 || cfg.Audit.RetainRecords < 0 || cfg.Audit.CheckpointEvery < 1 || cfg.Audit.CheckpointInterval < time.Second {
				return usagef("--audit-retain-age and --audit-retain-records must not be negative, --audit-checkpoint-every at least 1, --audit-checkpoint-interval at least 1s")
			}
			var err error
			if cfg.Network, err = nf.options(); err != nil {
				return err
			}
			if cfg.Cluster.Store != "" {
				if cfg.Cluster.NodeID == "" {
					if cfg.Cluster.NodeID, err = os.Hostname(); err != nil {
						return err
					}
				}
				if cfg.Cluster.Advertise == "" && cfg.Cluster.Listen != "" {
					cfg.Cluster.Advertise = "https://" + cfg.Cluster.Listen
				}
				if cfg.Cluster.Advertise == "" {
					if strings.HasPrefix(cfg.Listen, "unix:") {
						return usagef("--advertise is required when --listen is a unix socket: replicas reach nodes over the network")
					}
					cfg.Cluster.Advertise = "http://" + cfg.Listen
				}
				if cfg.Cluster.Heartbeat <= 0 {
					return usagef("--heartbeat must be positive")
				}
			}
			cfg.Logger = slog.New(slog.NewTextHandler(e.Err, nil))
			ctx, stop := signal.NotifyContext(e.Ctx, os.Interrupt, syscall.SIGTERM)
			defer stop()
			return server.Run(ctx, cfg)
		},
	}
	cacheDefault := cli.DefaultCacheDir()
	cmd.Flags().StringVar(&cfg.DataDir, "data", cli.DataDir(), "data directory (env SPACE_DATA)")
	cmd.Flags().StringVar(&cfg.Listen, "listen", "127.0.0.1:7070", "listen address host:port or unix:/path")
	cmd.Flags().StringVar(&cfg.PortDomain, "port-domain", "", `domain of host-routed sandbox port URLs, http://<port>-<id>.<domain>/ (e.g. "sandbox.example.com" with a wildcard DNS record; default: the host clients reach the server by, "localhost:<port>" for loopback)`)
	cmd.Flags().StringVar(&cfg.CacheDir, "cache", cacheDefault, "cache directory for templates and kernels (env SPACE_CACHE)")
	cmd.Flags().Int64Var(&cfg.MaxTemplateBytes, "max-template-bytes", 8<<30, "limit on one template import or build step (unpacked bytes, and each compressed OCI layer)")
	cmd.Flags().BoolVar(&cfg.AllowPrivateRegistries, "allow-private-registries", false, "let template pulls reach loopback, private and link-local registry addresses")
	cmd.Flags().DurationVar(&cfg.ApprovalTimeout, "approval-timeout", policy.DefaultApprovalTimeout, "how long an action a policy rule asks about waits for an answer before it is denied")
	cmd.Flags().DurationVar(&cfg.Audit.RetainAge, "audit-retain-age", 0, "drop audit records older than this (e.g. 2160h; cut at a signed checkpoint; default keep)")
	cmd.Flags().Int64Var(&cfg.Audit.RetainRecords, "audit-retain-records", 0, "keep about this many audit records, at least (cut at a signed checkpoint; default keep all)")
	cmd.Flags().IntVar(&cfg.Audit.CheckpointEvery, "audit-checkpoint-every", 1000, "sign an audit checkpoint after this many records")
	cmd.Flags().DurationVar(&cfg.Audit.CheckpointInterval, "audit-checkpoint-interval", time.Minute, "sign an audit checkpoint after this long when there are new records")
	cmd.Flags().IntVar(&cfg.PoolDefault, "pool-default", 1, "warm pool size for base:latest on the auto runtime with the default limits (0 disables)")
	cmd.Flags().Int64Var(&cfg.PoolMemFloor, "pool-mem-floor", 1<<30, "host MemAvailable in bytes under which warm pools stop filling and shed idle members")
	cmd.Flags().StringVar(&cfg.Cluster.Store, "cluster-store", "", "PostgreSQL DSN of a cluster's shared state (postgres://…): run as a node of that cluster (default: a single box)")
	cmd.Flags().StringVar(&cfg.Cluster.NodeID, "node-id", "", "this node's name in the cluster (default: the host name)")
	cmd.Flags().StringVar(&cfg.Cluster.Advertise, "advertise", "", "the address cluster replicas reach this node's API at (default: http://<--listen>)")
	cmd.Flags().DurationVar(&cfg.Cluster.Heartbeat, "heartbeat", 2*time.Second, "time between this node's heartbeats to the cluster store")
	cmd.Flags().StringVar(&cfg.Cluster.Listen, "cluster-listen", "", "a node's cluster listener host:port: its API over mutual TLS for the cluster's replicas (default --advertise https://<this>)")
	cmd.Flags().StringVar(&cfg.Cluster.CAFile, "cluster-ca", "", "the cluster CA's certificate (space cluster ca)")
	cmd.Flags().StringVar(&cfg.Cluster.CertFile, "cluster-cert", "", "this node's or replica's certificate from the cluster CA (space cluster cert)")
	cmd.Flags().StringVar(&cfg.Cluster.KeyFile, "cluster-key", "", "the key of --cluster-cert")
	cmd.Flags().StringVar(&cfg.Cluster.SecretsKeyFile, "cluster-secrets-key", "", "the cluster's secrets key (space cluster ca writes DIR/secrets.key): replicas seal the secrets they store in PostgreSQL with it, nodes open what they mirror")
	cmd.Flags().StringVar(&cfg.Cluster.SuspendShare, "suspend-share", "", "a node's directory on storage every node mounts at the same path: suspended sandboxes are exported there so another node can continue them when this one is lost")
	cmd.Flags().DurationVar(&cfg.Cluster.OrphanGrace, "orphan-grace", 30*time.Second, "how long a node keeps a sandbox it made since it started that has no row in the cluster store")
	if !node {
		cmd.Flags().StringVar(&rc.Store, "store", "", "PostgreSQL DSN of a cluster (postgres://…): run as one of its API replicas, holding no sandbox (needs --cluster-ca, --cluster-cert, --cluster-key)")
		cmd.Flags().DurationVar(&rc.NodeTimeout, "node-timeout", 10*time.Second, "a replica's limit on how late a node's heartbeat may be before it gets no new sandbox and is marked lost")
	}
	nf.register(cmd)
	if node {
		cmd.Use, cmd.Short = "node", "Run a cluster node: the space server joined to a cluster's PostgreSQL state"
	}
	return cmd
}

// policyTest is `space policy test`: rs over the history file's actions
// (JSON Lines), then the action file's action if one is given.
func policyTest(rs api.PolicyRuleSet, historyFile, actionFile string) ([]api.PolicyTestResult, error) {
	f, err := os.Open(historyFile)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	hist, err := policy.ReadActions(f, 1_000_000)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", historyFile, err)
	}
	var extra *api.PolicyAction
	if actionFile != "" {
		b, err := os.ReadFile(actionFile)
		if err != nil {
			return nil, err
		}
		acts, err := policy.ReadActions(strings.NewReader(strings.ReplaceAll(string(b), "\n", " ")), 1)
		if err != nil || len(acts) != 1 {
			return nil, fmt.Errorf("%s: want one action (a JSON object): %v", actionFile, err)
		}
		extra = &acts[0]
	}
	return policy.Test(rs, hist, extra)
}

func usagef(format string, args ...any) error { return cli.UsageError(fmt.Errorf(format, args...)) }
