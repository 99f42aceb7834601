// Package cli implements the `space` command line: thin cobra commands that
// parse and validate flags, then call the Go SDK (package sdk). No HTTP is
// spoken here directly, and no package of the server is linked: the
// host-side commands (`space server`, `space template build-base --local`,
// `space policy test`, `space mcp`) run through Host, which only the
// space-server binary fills (package hostcli); the space binary hands them
// to it (host.go).
//
// Execute is the whole program behind a function, so tests and the
// integration suite run it in-process with their own streams.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/sdk"
)

// Exit codes of the space binary besides a command's own code (run, exec).
const (
	ExitOK    = 0
	ExitError = 1 // the request failed
	ExitUsage = 2 // bad flags or arguments
	// ExitRunFailed is what run and exec exit with when space itself failed
	// (as opposed to the process exiting non-zero), as docker does.
	ExitRunFailed = 125
)

// exitCodeError carries an exit code out of a command without printing.
type exitCodeError struct{ code int }

func (e *exitCodeError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// usageError marks an error in the command line rather than in the request.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return &usageError{fmt.Errorf(format, args...)}
}

// runFailedError marks a failure of space itself inside run/exec.
type runFailedError struct{ err error }

func (e *runFailedError) Error() string { return e.err.Error() }
func (e *runFailedError) Unwrap() error { return e.err }

// app is the state one invocation shares between its commands.
type app struct {
	ctx    context.Context
	in     io.Reader
	out    io.Writer
	errOut io.Writer

	url    string
	apiKey string
	json   bool

	client *sdk.Client

	// host runs the host-side commands; nil hands them to space-server,
	// which only Main (mayExec) does, with the same args.
	host    *Host
	mayExec bool
	args    []string
}

// Client returns the SDK client for the configured server, built once.
func (a *app) Client() (*sdk.Client, error) {
	if a.client != nil {
		return a.client, nil
	}
	cfg, err := discoverConfig(a.url, a.apiKey)
	if err != nil {
		return nil, err
	}
	c, err := sdk.New(cfg.URL, cfg.APIKey, sdk.WithUserAgent("space-cli"))
	if err != nil {
		return nil, &usageError{err}
	}
	a.client = c
	return c, nil
}

// Execute runs the space CLI with args (without the program name) and
// returns the process exit code. The host-side commands fail (see Host and
// ExecuteHost).
func Execute(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return execute(ctx, nil, false, args, stdin, stdout, stderr)
}

func execute(ctx context.Context, h *Host, mayExec bool, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := &app{ctx: ctx, in: stdin, out: stdout, errOut: stderr, host: h, mayExec: mayExec, args: args}
	root := newRootCmd(a)
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return ExitOK
	}
	var ec *exitCodeError
	if errors.As(err, &ec) {
		return ec.code
	}
	fmt.Fprintln(stderr, "space:", err)
	var ue *usageError
	var rf *runFailedError
	switch {
	case errors.As(err, &ue) || isCobraUsageError(err):
		return ExitUsage
	case errors.As(err, &rf):
		return ExitRunFailed
	}
	return ExitError
}

// isCobraUsageError recognises cobra's own argument errors, which it does
// not type.
func isCobraUsageError(err error) bool {
	msg := err.Error()
	for _, p := range []string{"unknown command", "unknown flag", "unknown shorthand flag", "accepts ", "requires at least", "requires at most", "flag needs an argument", "invalid argument"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

func newRootCmd(a *app) *cobra.Command {
	root := &cobra.Command{
		Use:   "space",
		Short: "Run code in isolated Linux sandboxes",
		Long: "space creates isolated Linux sandboxes from templates, runs commands in them and manages their\n" +
			"lifecycle (pause, stop, suspend, fork). The server is `space server`; everything else talks to it.",
		SilenceUsage:  true,
		SilenceErrors: true,
		CompletionOptions: cobra.CompletionOptions{
			DisableDefaultCmd: true,
		},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err} })
	pf := root.PersistentFlags()
	pf.StringVar(&a.url, "url", "", "server URL, http(s)://host:port or unix:///path (env SPACE_URL; default "+sdk.DefaultURL+")")
	pf.StringVar(&a.apiKey, "api-key", "", "API key (env SPACE_API_KEY; default: the key file $SPACE_DATA/api-key)")
	pf.BoolVar(&a.json, "json", false, "print API objects as JSON instead of tables")

	if b := topLevel[commandName(a.args)]; b != nil {
		// The one command this invocation runs: building every command's
		// flags and subcommands costs about half a millisecond a call.
		root.AddCommand(b(a))
	} else {
		for _, b := range topLevelOrder {
			root.AddCommand(b(a))
		}
	}
	for _, add := range extraCommands {
		root.AddCommand(add(a))
	}
	return root
}

// extraCommands are added to the root command by other files (keys.go,
// secret.go); they are always built.
var extraCommands []func(*app) *cobra.Command

// topLevelOrder builds every top-level command besides extraCommands, for
// help, completion and names this table does not know.
var topLevelOrder = func() []func(*app) *cobra.Command {
	cmds := []func(*app) *cobra.Command{
		newRunCmd, newExecCmd, newSandboxCmd,
		newCreateCmd, // alias of `space sandbox create`
		newLsCmd, newInspectCmd, newRmCmd, newForkCmd, newCpCmd, newOpCmd, newTemplateCmd, newInfoCmd, newNetCmd,
		newPortCmd, newPortForwardCmd, newPsCmd, newLogsCmd, newAttachCmd, newKillCmd, newStatsCmd, newMCPCmd,
		newPolicyCmd, newApprovalsCmd, newApproveCmd, newDenyCmd, newAuditCmd, newServerCmd, newNodeCmd, newClusterCmd, newNodesCmd,
	}
	for _, verb := range lifecycleVerbs {
		cmds = append(cmds, func(a *app) *cobra.Command { return newLifecycleCmd(a, verb) })
	}
	return cmds
}()

var lifecycleVerbs = []string{"pause", "resume", "stop", "start", "wake", "suspend", "restore"}

// topLevel maps every name (and alias) of a command in topLevelOrder to
// its constructor; TestTopLevelTable keeps it in step with the commands'
// own names.
var topLevel = func() map[string]func(*app) *cobra.Command {
	m := map[string]func(*app) *cobra.Command{
		"run": newRunCmd, "exec": newExecCmd, "sandbox": newSandboxCmd, "sandboxes": newSandboxCmd, "sb": newSandboxCmd,
		"create": newCreateCmd, "ls": newLsCmd, "list": newLsCmd, "inspect": newInspectCmd, "rm": newRmCmd, "delete": newRmCmd,
		"fork": newForkCmd, "cp": newCpCmd, "op": newOpCmd, "operation": newOpCmd,
		"template": newTemplateCmd, "templates": newTemplateCmd, "tpl": newTemplateCmd, "info": newInfoCmd,
		"net": newNetCmd, "network": newNetCmd, "port": newPortCmd, "port-forward": newPortForwardCmd, "ps": newPsCmd,
		"logs": newLogsCmd, "attach": newAttachCmd, "kill": newKillCmd, "stats": newStatsCmd, "mcp": newMCPCmd,
		"policy": newPolicyCmd, "approvals": newApprovalsCmd, "approve": newApproveCmd, "deny": newDenyCmd,
		"audit": newAuditCmd, "server": newServerCmd, "node": newNodeCmd, "cluster": newClusterCmd, "nodes": newNodesCmd,
	}
	for _, verb := range lifecycleVerbs {
		m[verb] = func(a *app) *cobra.Command { return newLifecycleCmd(a, verb) }
	}
	return m
}()

// commandName is the first argument that is not a root flag (or a root
// flag's value): the top-level command cobra will run. "" when there is
// none or "--" comes first.
func commandName(args []string) string {
	for i := 0; i < len(args); i++ {
		arg := args[i]
		switch {
		case arg == "--":
			return ""
		case arg == "--url" || arg == "--api-key":
			i++ // its value
		case strings.HasPrefix(arg, "-"):
		default:
			return arg
		}
	}
	return ""
}

// stdinFile returns the real terminal-capable stdin when there is one.
func (a *app) stdinFile() (*os.File, bool) {
	f, ok := a.in.(*os.File)
	return f, ok
}
