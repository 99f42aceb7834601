package cli

// The host-side half of the CLI. The space binary is a client: it links
// the SDK and package api, so it starts in well under a millisecond of Go
// initialisation. What needs this machine's own packages — the server,
// the local base build, offline policy evaluation and the MCP stdio server
// (its JSON-schema and protocol packages) — is behind Host, which only the
// space-server binary fills (package hostcli). The space binary hands those
// commands to space-server installed beside it with execve, so the process
// keeps its pid, signals and streams: `space server` is still the one
// command that runs the server.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// ServerBinaryName is the binary the space client hands host-side commands
// to, looked up beside the running executable ($SPACE_SERVER_BIN wins).
const ServerBinaryName = "space-server"

// Env is what a host-side command gets of the invocation.
type Env struct {
	Ctx context.Context
	In  io.Reader
	Out io.Writer
	Err io.Writer
}

// Host is the host-side half of the CLI. A nil field is a command this
// binary does not link: it is handed to space-server.
type Host struct {
	// Server builds `space server` (its flags and the server run).
	Server func(Env) *cobra.Command
	// Node builds `space node`: the server joined to a cluster.
	Node func(Env) *cobra.Command
	// Cluster builds `space cluster`: the cluster CA and members'
	// certificates.
	Cluster func(Env) *cobra.Command
	// BuildBaseLocal builds the cached base root filesystem in cacheDir
	// without a server (`space template build-base --local`) and returns
	// its path.
	BuildBaseLocal func(ctx context.Context, cacheDir string, progress func(sdk.BuildProgress)) (string, error)
	// PolicyTest evaluates rs over the history file's actions, then the
	// action file's action if one is given (`space policy test`).
	PolicyTest func(rs api.PolicyRuleSet, historyFile, actionFile string) ([]api.PolicyTestResult, error)
	// MCP serves space's tools over stdio through c until in ends
	// (`space mcp`).
	MCP func(ctx context.Context, c *sdk.Client, in io.Reader, out io.Writer) error
}

// UsageError marks err as a mistake in the command line (exit status 2),
// for host-side commands.
func UsageError(err error) error { return &usageError{err} }

// ParseMiB parses "512m", "1g", "1.5g", "2GiB" or "1024" (MiB) into MiB.
func ParseMiB(s string) (int64, error) { return parseMiB(s) }

// DefaultCacheDir is $SPACE_CACHE or /var/cache/space.
func DefaultCacheDir() string { return defaultCacheDir() }

// Main is the space binary: Execute over os.Args with the host-side
// commands handed to space-server.
func Main(ctx context.Context) int {
	return execute(ctx, nil, true, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
}

// ExecuteHost is Execute with the host-side commands run in this process
// by h (the space-server binary, and tests of those commands).
func ExecuteHost(ctx context.Context, h *Host, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return execute(ctx, h, false, args, stdin, stdout, stderr)
}

// errNoHost is a host-side command asked of a process that neither links
// it nor may replace itself (Execute called as a library).
var errNoHost = errors.New("this command runs in " + ServerBinaryName + ", which this program does not link")

// handOff replaces this process with space-server running the same command
// line. Only Main may: a library caller (tests) gets errNoHost instead of
// losing its process.
func (a *app) handOff() error {
	if !a.mayExec {
		return errNoHost
	}
	bin, err := serverBinary()
	if err != nil {
		return err
	}
	err = syscall.Exec(bin, append([]string{bin}, a.args...), os.Environ())
	return fmt.Errorf("running %s: %w", bin, err)
}

// serverBinary is $SPACE_SERVER_BIN, else space-server beside this
// executable (symlinks resolved, so a link to bin/space finds its sibling).
func serverBinary() (string, error) {
	if p := os.Getenv("SPACE_SERVER_BIN"); p != "" {
		return p, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	if r, err := filepath.EvalSymlinks(self); err == nil {
		self = r
	}
	p := filepath.Join(filepath.Dir(self), ServerBinaryName)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("this command runs in %s, installed beside %s (make build), or set SPACE_SERVER_BIN: %w", ServerBinaryName, self, err)
	}
	return p, nil
}

// newServerCmd is `space server`: the host's own, or one that hands the
// whole command line (flags and --help included) to space-server.
func newServerCmd(a *app) *cobra.Command {
	if a.host != nil && a.host.Server != nil {
		return a.host.Server(Env{Ctx: a.ctx, In: a.in, Out: a.out, Err: a.errOut})
	}
	return &cobra.Command{
		Use:                "server",
		Short:              "Run the space API server and node services",
		DisableFlagParsing: true,
		RunE:               func(*cobra.Command, []string) error { return a.handOff() },
	}
}

// newNodeCmd is `space node`, handed to space-server like `space server`.
func newNodeCmd(a *app) *cobra.Command {
	if a.host != nil && a.host.Node != nil {
		return a.host.Node(Env{Ctx: a.ctx, In: a.in, Out: a.out, Err: a.errOut})
	}
	return &cobra.Command{
		Use:                "node",
		Short:              "Run a cluster node: the space server joined to a cluster's PostgreSQL state",
		DisableFlagParsing: true,
		RunE:               func(*cobra.Command, []string) error { return a.handOff() },
	}
}

// newClusterCmd is `space cluster`, handed to space-server like `space server`.
func newClusterCmd(a *app) *cobra.Command {
	if a.host != nil && a.host.Cluster != nil {
		return a.host.Cluster(Env{Ctx: a.ctx, In: a.in, Out: a.out, Err: a.errOut})
	}
	return &cobra.Command{
		Use:                "cluster",
		Short:              "Make a cluster's CA and its nodes' and replicas' certificates",
		DisableFlagParsing: true,
		RunE:               func(*cobra.Command, []string) error { return a.handOff() },
	}
}

// buildBaseLocal builds only the cached base root filesystem in cacheDir,
// with the same progress display as a build through a server.
func (a *app) buildBaseLocal(cacheDir string) error {
	if a.host == nil || a.host.BuildBaseLocal == nil {
		return a.handOff()
	}
	var rootfs string
	_, err := a.buildBase(func(progress func(sdk.BuildProgress)) (*api.Template, error) {
		var err error
		rootfs, err = a.host.BuildBaseLocal(a.ctx, cacheDir, progress)
		return nil, err
	})
	if err != nil {
		return err
	}
	fmt.Fprintln(a.out, "base root filesystem ready:", rootfs)
	return nil
}
