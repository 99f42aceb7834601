package cli

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// sandboxFlags are the flags shared by `sandbox create` and `run`.
type sandboxFlags struct {
	template, runtime string
	env               []string
	workdir           string
	cpus              float64
	memory, disk      string
	pids              int64
	labels            []string
	ttl               string
	idleAfter         string
	idleAction        string
	net               netFlags
	secrets           []string
}

func (f *sandboxFlags) register(cmd *cobra.Command, full bool) {
	fl := cmd.Flags()
	fl.StringVar(&f.template, "template", "", `template "name:tag" or "sha256:…" (server default base:latest)`)
	fl.StringVar(&f.runtime, "runtime", "", `runtime name or "auto" (server default auto)`)
	fl.StringArrayVarP(&f.env, "env", "e", nil, "environment variable KEY=VALUE (repeatable; bare KEY copies the local value)")
	fl.StringVarP(&f.workdir, "workdir", "w", "", "working directory inside the sandbox")
	fl.Float64Var(&f.cpus, "cpus", 0, "CPU quota in cores, e.g. 0.5 or 2")
	fl.StringVar(&f.memory, "memory", "", "memory limit, e.g. 512m or 1g (a bare number is MiB)")
	f.net.register(fl)
	fl.StringArrayVar(&f.secrets, "secret", nil, "grant this secret: its env var holds a placeholder the gateway replaces on requests to its hosts (comma-separated, repeatable)")
	if !full {
		return
	}
	fl.Int64Var(&f.pids, "pids", 0, "maximum number of tasks")
	fl.StringVar(&f.disk, "disk", "", "writable disk size, e.g. 1g")
	fl.StringArrayVar(&f.labels, "label", nil, "label k=v (repeatable)")
	fl.StringVar(&f.ttl, "ttl", "", "delete the sandbox after this long, e.g. 1h")
	fl.StringVar(&f.idleAfter, "idle-after", "", "act after this long without activity, e.g. 5m")
	fl.StringVar(&f.idleAction, "idle-action", "", "what to do when idle: pause, stop or suspend")
}

// request validates the flags and builds the create request.
func (f *sandboxFlags) request() (api.CreateSandboxRequest, error) {
	req := api.CreateSandboxRequest{Template: f.template, Runtime: f.runtime, Workdir: f.workdir}
	var err error
	if req.Env, err = parseKV("env", f.env, true); err != nil {
		return req, &usageError{err}
	}
	if req.Labels, err = parseKV("label", f.labels, false); err != nil {
		return req, &usageError{err}
	}
	if f.cpus < 0 || f.cpus > 1024 {
		return req, usagef("--cpus %g: want a number of cores between 0.01 and 1024", f.cpus)
	}
	req.Limits.CPUs = f.cpus
	if f.memory != "" {
		if req.Limits.MemoryMiB, err = parseMiB(f.memory); err != nil {
			return req, usagef("--memory: %v", err)
		}
	}
	if f.disk != "" {
		if req.Limits.DiskMiB, err = parseMiB(f.disk); err != nil {
			return req, usagef("--disk: %v", err)
		}
	}
	if f.pids < 0 {
		return req, usagef("--pids %d: must be positive", f.pids)
	}
	req.Limits.Pids = f.pids
	if f.ttl != "" {
		if req.TTLSeconds, err = parseSeconds("ttl", f.ttl); err != nil {
			return req, &usageError{err}
		}
	}
	switch {
	case f.idleAfter == "" && f.idleAction == "":
	case f.idleAfter == "" || f.idleAction == "":
		return req, usagef("--idle-after and --idle-action go together")
	default:
		secs, err := parseSeconds("idle-after", f.idleAfter)
		if err != nil {
			return req, &usageError{err}
		}
		switch f.idleAction {
		case api.OpPause, api.OpStop, api.OpSuspend:
		default:
			return req, usagef("--idle-action %q: want pause, stop or suspend", f.idleAction)
		}
		req.Idle = &api.IdlePolicy{AfterSeconds: secs, Action: f.idleAction}
	}
	if req.Workdir != "" && !strings.HasPrefix(req.Workdir, "/") {
		return req, usagef("--workdir %q: must be an absolute path", req.Workdir)
	}
	for _, s := range f.secrets {
		for _, n := range strings.Split(s, ",") {
			if n = strings.TrimSpace(n); n != "" {
				req.Secrets = append(req.Secrets, n)
			}
		}
	}
	// No policy flag: no policy sent, the template's or the server's applies.
	if f.net.given() {
		p, err := f.net.policy()
		if err != nil {
			return req, err
		}
		req.Network = &p
	}
	return req, nil
}

func newSandboxCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "sandbox", Aliases: []string{"sandboxes", "sb"}, Short: "Manage sandboxes"}
	cmd.AddCommand(newCreateCmd(a), newLsCmd(a), newInspectCmd(a), newRmCmd(a), newForkCmd(a))
	for _, verb := range []string{"pause", "resume", "stop", "start", "wake", "suspend", "restore"} {
		cmd.AddCommand(newLifecycleCmd(a, verb))
	}
	return cmd
}

func newCreateCmd(a *app) *cobra.Command {
	var f sandboxFlags
	var quiet, wait bool
	cmd := &cobra.Command{
		Use:   "create [flags]",
		Short: "Create a sandbox",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := f.request()
			if err != nil {
				return err
			}
			return a.create(req, quiet, wait)
		},
	}
	f.register(cmd, true)
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print only the sandbox id")
	cmd.Flags().BoolVar(&wait, "wait", false, "wait until the sandbox is running")
	return cmd
}

func (a *app) create(req api.CreateSandboxRequest, quiet, wait bool) error {
	c, err := a.Client()
	if err != nil {
		return err
	}
	if wait {
		if err := a.ensureBase(a.ctx, c, req.Template); err != nil {
			return err
		}
	}
	res, err := c.CreateSandbox(a.ctx, req)
	if err != nil {
		return err
	}
	sb := &res.Sandbox
	if wait {
		if _, err := c.WaitOperation(a.ctx, res.Operation.ID); err != nil {
			return fmt.Errorf("sandbox %s: %w", sb.ID, err)
		}
		if sb, err = c.GetSandbox(a.ctx, sb.ID); err != nil {
			return err
		}
	}
	switch {
	case quiet:
		fmt.Fprintln(a.out, sb.ID)
		return nil
	case a.json && wait:
		return printJSON(a.out, sb)
	case a.json:
		return printJSON(a.out, res)
	}
	t := newTable(a.out, "SANDBOX", "STATE", "OPERATION")
	t.row(sb.ID, sb.State, res.Operation.ID)
	return t.flush()
}

func newLsCmd(a *app) *cobra.Command {
	var state string
	var labels []string
	var quiet bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"}, // `space ps` is its own command (commands of a sandbox)
		Short:   "List sandboxes",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			lm, err := parseKV("label", labels, false)
			if err != nil {
				return &usageError{err}
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			list, err := c.ListSandboxes(a.ctx, sdk.ListOptions{State: state, Labels: lm})
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, api.SandboxList{Sandboxes: nonNil(list)})
			}
			if quiet {
				for _, sb := range list {
					fmt.Fprintln(a.out, sb.ID)
				}
				return nil
			}
			return printSandboxes(a, list, time.Now())
		},
	}
	cmd.Flags().StringVar(&state, "state", "", "only sandboxes in this state (running, paused, stopped, …)")
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only sandboxes with label k=v (repeatable)")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print only ids")
	return cmd
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

func printSandboxes(a *app, list []api.Sandbox, now time.Time) error {
	t := newTable(a.out, "ID", "STATE", "RUNTIME", "TEMPLATE", "CREATED", "LABELS")
	for _, sb := range list {
		t.row(sb.ID, sb.State, orDash(sb.Runtime), orDash(sb.Template), ago(now, sb.CreatedAt), orDash(fmtMap(sb.Labels)))
	}
	return t.flush()
}

func newInspectCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Show one sandbox in detail",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			sb, err := c.GetSandbox(a.ctx, args[0])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, sb)
			}
			return printSandbox(a, sb)
		},
	}
}

func printSandbox(a *app, sb *api.Sandbox) error {
	t := newTable(a.out)
	t.row("ID:", sb.ID)
	t.row("State:", sb.State)
	if sb.Error != "" {
		t.row("Error:", sb.Error)
	}
	t.row("Runtime:", orDash(sb.Runtime))
	t.row("Isolation:", orDash(sb.Isolation))
	t.row("Template:", orDash(sb.Template))
	t.row("Template digest:", orDash(sb.TemplateDigest))
	l := sb.Limits
	t.row("Limits:", fmt.Sprintf("cpus=%g memory=%dMiB pids=%d disk=%dMiB", l.CPUs, l.MemoryMiB, l.Pids, l.DiskMiB))
	if sb.Workdir != "" {
		t.row("Workdir:", sb.Workdir)
	}
	if len(sb.Env) > 0 {
		t.row("Env:", fmtMap(sb.Env))
	}
	if len(sb.Labels) > 0 {
		t.row("Labels:", fmtMap(sb.Labels))
	}
	if sb.TTLSeconds > 0 {
		t.row("TTL:", (time.Duration(sb.TTLSeconds) * time.Second).String())
	}
	if sb.ExpiresAt != nil {
		t.row("Expires:", sb.ExpiresAt.Format(time.RFC3339))
	}
	if sb.Network != nil {
		t.row("Network:", policySummary(*sb.Network))
	}
	if sb.Idle != nil {
		t.row("Idle:", fmt.Sprintf("%s after %s", sb.Idle.Action, time.Duration(sb.Idle.AfterSeconds)*time.Second))
	}
	t.row("Created:", sb.CreatedAt.Format(time.RFC3339))
	t.row("Updated:", sb.UpdatedAt.Format(time.RFC3339))
	t.row("Last active:", sb.LastActiveAt.Format(time.RFC3339))
	if sb.OperationID != "" {
		t.row("Operation:", sb.OperationID)
	}
	return t.flush()
}

func newRmCmd(a *app) *cobra.Command {
	var force, wait bool
	cmd := &cobra.Command{
		Use:     "rm ID...",
		Aliases: []string{"delete"},
		Short:   "Delete sandboxes (running ones need -f)",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			// Keep going past a failure so one bad id does not leave the
			// rest behind; report every failure.
			var errs []error
			var ops []*api.Operation
			for _, id := range args {
				op, err := c.DeleteSandbox(a.ctx, id, force)
				if err == nil && wait {
					op, err = c.WaitOperation(a.ctx, op.ID)
				}
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", id, err))
					continue
				}
				ops = append(ops, op)
				if !a.json {
					fmt.Fprintln(a.out, id)
				}
			}
			if a.json {
				if err := printJSON(a.out, nonNil(ops)); err != nil {
					return err
				}
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "delete even if running")
	cmd.Flags().BoolVar(&wait, "wait", false, "wait until deleted")
	return cmd
}

func newLifecycleCmd(a *app, verb string) *cobra.Command {
	var wait bool
	short := map[string]string{
		"pause":   "Freeze a sandbox in memory",
		"resume":  "Thaw a paused sandbox",
		"stop":    "Stop a sandbox (disk kept, memory not)",
		"start":   "Start a stopped sandbox",
		"wake":    "Bring a sandbox back to running by whichever path is valid",
		"suspend": "Save a sandbox's memory to disk and release it",
		"restore": "Restore a suspended sandbox",
	}[verb]
	cmd := &cobra.Command{
		Use:   verb + " ID",
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			op, err := c.Lifecycle(a.ctx, args[0], verb)
			if err != nil {
				return err
			}
			return a.finishOp(op, wait)
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "wait until the operation has finished")
	return cmd
}

// finishOp optionally waits for op and prints it.
func (a *app) finishOp(op *api.Operation, wait bool) error {
	var werr error
	if wait {
		c, err := a.Client()
		if err != nil {
			return err
		}
		done, err := c.WaitOperation(a.ctx, op.ID)
		if done != nil {
			op = done
		}
		werr = err
	}
	if a.json {
		if err := printJSON(a.out, op); err != nil {
			return err
		}
	} else if werr == nil {
		printOps(a, []*api.Operation{op})
	}
	return werr
}

func printOps(a *app, ops []*api.Operation) {
	t := newTable(a.out, "OPERATION", "KIND", "SANDBOX", "STATE", "DURATION", "ERROR")
	for _, op := range ops {
		dur := "-"
		if op.FinishedAt != nil {
			dur = op.FinishedAt.Sub(op.CreatedAt).Round(time.Millisecond).String()
		}
		errText := "-"
		if op.Error != nil {
			errText = op.Error.Code + ": " + op.Error.Message
		}
		t.row(op.ID, op.Kind, op.SandboxID, op.State, dur, errText)
	}
	t.flush()
}

func newForkCmd(a *app) *cobra.Command {
	var count int
	var wait, quiet bool
	cmd := &cobra.Command{
		Use:   "fork ID",
		Short: "Fork new sandboxes from a running one's memory and disk",
		Long: "Fork clones a running sandbox: each child continues from the parent's memory with its own copy of\n" +
			"the disk, its own id as hostname and fresh entropy, labelled " + api.LabelForkOf + "=ID. The children exist\n" +
			"(state creating) as soon as the fork is accepted; with --wait they are running when it returns.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if count < 1 || count > api.MaxForkCount {
				return usagef("--count %d: want 1 to %d", count, api.MaxForkCount)
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			op, err := c.Fork(a.ctx, args[0], api.ForkRequest{Count: count})
			if err != nil {
				return err
			}
			if quiet {
				if wait {
					if _, err := c.WaitOperation(a.ctx, op.ID); err != nil {
						return err
					}
				}
				for _, id := range op.Children {
					fmt.Fprintln(a.out, id)
				}
				return nil
			}
			if err := a.finishOp(op, wait); err != nil || a.json {
				return err
			}
			t := newTable(a.out, "CHILD")
			for _, id := range op.Children {
				t.row(id)
			}
			return t.flush()
		},
	}
	cmd.Flags().IntVar(&count, "count", 1, fmt.Sprintf("how many sandboxes to fork (1 to %d)", api.MaxForkCount))
	cmd.Flags().BoolVar(&wait, "wait", false, "wait until the fork has finished (the children are running)")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print only the children's ids, one per line")
	return cmd
}

func newOpCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "op", Aliases: []string{"operation"}, Short: "Inspect lifecycle operations"}
	get := &cobra.Command{
		Use:   "get OPID",
		Short: "Show an operation",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			op, err := c.GetOperation(a.ctx, args[0], 0)
			if err != nil {
				return err
			}
			return a.printOpDetail(op)
		},
	}
	wait := &cobra.Command{
		Use:   "wait OPID",
		Short: "Wait for an operation to finish (exit 1 if it failed)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			op, err := c.WaitOperation(a.ctx, args[0])
			if op != nil {
				if perr := a.printOpDetail(op); perr != nil {
					return perr
				}
			}
			return err
		},
	}
	cmd.AddCommand(get, wait)
	return cmd
}

func (a *app) printOpDetail(op *api.Operation) error {
	if a.json {
		return printJSON(a.out, op)
	}
	printOps(a, []*api.Operation{op})
	if len(op.Phases) > 0 {
		fmt.Fprintln(a.out)
		t := newTable(a.out, "PHASE", "DURATION")
		for _, p := range op.Phases {
			t.row(p.Name, strconv.FormatFloat(p.DurationMS, 'f', 1, 64)+"ms")
		}
		return t.flush()
	}
	return nil
}
