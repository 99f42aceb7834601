package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// CommandSpec is what command_run and command_start share: the process.
type CommandSpec struct {
	ID  string `json:"id" jsonschema:"the sandbox id"`
	Cmd any    `json:"cmd"` // a string (run by /bin/sh -c) or an argv array; its schema is set in cmdSchema
	Cwd string `json:"cwd,omitempty" jsonschema:"working directory (absolute path); default the sandbox's"`
	// Env adds to (and overrides) the sandbox's environment.
	Env  map[string]string `json:"env,omitempty" jsonschema:"extra environment variables for this command"`
	User string            `json:"user,omitempty" jsonschema:"user to run as (name or uid[:gid]); default the sandbox's (root unless set)"`
}

// argv turns cmd into the process's argv: a string is a shell command line.
func (c CommandSpec) argv() ([]string, error) {
	switch v := c.Cmd.(type) {
	case string:
		if strings.TrimSpace(v) == "" {
			return nil, invalid("cmd is empty")
		}
		return []string{"/bin/sh", "-c", v}, nil
	case []any:
		if len(v) == 0 {
			return nil, invalid("cmd is an empty array")
		}
		out := make([]string, len(v))
		for i, a := range v {
			s, ok := a.(string)
			if !ok {
				return nil, invalid("cmd[%d] is not a string", i)
			}
			out[i] = s
		}
		if out[0] == "" {
			return nil, invalid("cmd[0] (the program) is empty")
		}
		return out, nil
	case nil:
		return nil, invalid("cmd is required: a shell command line, or an array of program and arguments")
	}
	return nil, invalid("cmd must be a string or an array of strings")
}

func (c CommandSpec) request() (api.ExecRequest, error) {
	argv, err := c.argv()
	if err != nil {
		return api.ExecRequest{}, err
	}
	return api.ExecRequest{Cmd: argv, Workdir: c.Cwd, Env: c.Env, User: c.User}, nil
}

// CommandRunIn is command_run's input.
type CommandRunIn struct {
	CommandSpec
	TimeoutSeconds float64 `json:"timeout_seconds,omitempty" jsonschema:"kill the command after this many seconds; default 60, at most 3600"`
	Stdin          string  `json:"stdin,omitempty" jsonschema:"text to send to the command's standard input (closed afterwards)"`
	MaxOutputBytes int     `json:"max_output_bytes,omitempty" jsonschema:"how much of stdout and of stderr to return, each; default 65536, at most 1048576"`
}

// CommandRunOut is command_run's output.
type CommandRunOut struct {
	CommandID       string  `json:"command_id" jsonschema:"the command's id: command_output reads the rest of a truncated output with it"`
	ExitCode        int     `json:"exit_code"`
	Signal          string  `json:"signal,omitempty" jsonschema:"the signal that killed the process, if one did"`
	TimedOut        bool    `json:"timed_out,omitempty" jsonschema:"the command ran out of time and was killed"`
	OOMKilled       bool    `json:"oom_killed,omitempty" jsonschema:"the kernel killed it: the sandbox ran out of memory"`
	Stdout          string  `json:"stdout"`
	Stderr          string  `json:"stderr"`
	StdoutTruncated bool    `json:"stdout_truncated,omitempty"`
	StderrTruncated bool    `json:"stderr_truncated,omitempty"`
	StdoutOmitted   int64   `json:"stdout_omitted_bytes,omitempty"`
	StderrOmitted   int64   `json:"stderr_omitted_bytes,omitempty"`
	DurationMS      float64 `json:"duration_ms"`
}

// CommandStartIn is command_start's input.
type CommandStartIn struct {
	CommandSpec
}

// CommandStartOut is command_start's output.
type CommandStartOut struct {
	CommandID string `json:"command_id" jsonschema:"pass it to command_output, command_kill"`
	Pid       int    `json:"pid,omitempty" jsonschema:"process id inside the sandbox"`
	State     string `json:"state"`
}

// CommandOutputIn is command_output's input.
type CommandOutputIn struct {
	ID          string  `json:"id" jsonschema:"the sandbox id"`
	CommandID   string  `json:"command_id" jsonschema:"the command id from command_start or command_run"`
	SinceStdout int64   `json:"since_stdout,omitempty" jsonschema:"return stdout from this byte offset on: pass next_stdout of the previous call; 0 = from the oldest byte still buffered"`
	SinceStderr int64   `json:"since_stderr,omitempty" jsonschema:"the same for stderr (next_stderr of the previous call)"`
	WaitSeconds float64 `json:"wait_seconds,omitempty" jsonschema:"if there is no new output yet, wait up to this many seconds for some (or for the exit); default 0, at most 60"`
	MaxBytes    int     `json:"max_bytes,omitempty" jsonschema:"most bytes of each stream to return; default 65536, at most 1048576"`
}

// CommandOutputOut is command_output's output.
type CommandOutputOut struct {
	CommandID  string `json:"command_id"`
	Running    bool   `json:"running" jsonschema:"the process is still running"`
	ExitCode   *int   `json:"exit_code,omitempty" jsonschema:"set once the process has exited"`
	Signal     string `json:"signal,omitempty"`
	OOMKilled  bool   `json:"oom_killed,omitempty"`
	Stdout     string `json:"stdout" jsonschema:"stdout from since_stdout on"`
	Stderr     string `json:"stderr" jsonschema:"stderr from since_stderr on"`
	NextStdout int64  `json:"next_stdout" jsonschema:"pass as since_stdout next time to get only newer output"`
	NextStderr int64  `json:"next_stderr" jsonschema:"pass as since_stderr next time"`
	More       bool   `json:"more,omitempty" jsonschema:"more output is already waiting past max_bytes: call again with the next offsets"`
	// Dropped counts bytes that were overwritten in the sandbox's bounded
	// replay buffer (1 MiB per stream) before they were read.
	DroppedStdout int64 `json:"dropped_stdout_bytes,omitempty" jsonschema:"stdout bytes lost because the 1 MiB buffer overwrote them before they were read"`
	DroppedStderr int64 `json:"dropped_stderr_bytes,omitempty"`
}

// CommandListOut is command_list's output.
type CommandListOut struct {
	Commands  []CommandInfo `json:"commands"`
	Truncated bool          `json:"truncated,omitempty"`
}

// CommandInfo describes one command of a sandbox.
type CommandInfo struct {
	CommandID string   `json:"command_id"`
	Cmd       []string `json:"cmd"`
	State     string   `json:"state" jsonschema:"created, running or exited"`
	Pid       int      `json:"pid,omitempty"`
	ExitCode  *int     `json:"exit_code,omitempty"`
	Signal    string   `json:"signal,omitempty"`
	CreatedAt string   `json:"created_at"`
}

// CommandKillIn is command_kill's input.
type CommandKillIn struct {
	ID        string `json:"id" jsonschema:"the sandbox id"`
	CommandID string `json:"command_id" jsonschema:"the command id"`
	Signal    string `json:"signal,omitempty" jsonschema:"signal name or number: KILL (default), TERM or INT to ask it to stop cleanly, HUP, …"`
}

// CommandKillOut is command_kill's output.
type CommandKillOut struct {
	CommandID string `json:"command_id"`
	Signal    string `json:"signal"`
}

// cmdSchema is the schema of the cmd property: a shell line or an argv.
var cmdSchema = &jsonschema.Schema{
	Description: "the command: a string is run by /bin/sh -c (pipes, redirections, && work); an array is the program and its arguments, run without a shell",
	AnyOf: []*jsonschema.Schema{
		{Type: "string", MinLength: jsonschema.Ptr(1)},
		{Type: "array", Items: &jsonschema.Schema{Type: "string"}, MinItems: jsonschema.Ptr(1)},
	},
}

// schemaWithCmd infers In's input schema and gives its cmd property the
// string-or-array schema inference cannot express.
func schemaWithCmd[In any]() *jsonschema.Schema {
	s, err := jsonschema.For[In](nil)
	if err != nil {
		panic(fmt.Sprintf("mcpserver: schema of %T: %v", *new(In), err))
	}
	s.Properties["cmd"] = cmdSchema
	return s
}

func (t *tools) addCommandTools(s *mcp.Server) {
	mcp.AddTool(s, &mcp.Tool{
		Name:  "command_run",
		Title: "Run a command",
		Description: "Run a command in a sandbox, wait for it to finish and return its exit code, stdout and stderr. " +
			"Use it for anything that ends within a minute or so (default timeout 60 s); for servers, watchers or long " +
			"builds use command_start. Each output stream is capped (64 KiB unless max_output_bytes says otherwise); " +
			"a truncated stream says how many bytes were left out, and command_output with the returned command_id " +
			"and since_stdout/since_stderr reads them.",
		InputSchema: schemaWithCmd[CommandRunIn](),
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(true), OpenWorldHint: boolPtr(false)},
	}, t.commandRun)
	mcp.AddTool(s, &mcp.Tool{
		Name:  "command_start",
		Title: "Start a background command",
		Description: "Start a command in the background and return at once with its command_id (servers, long builds, " +
			"anything that runs for a while). Read its output with command_output, list commands with command_list, stop " +
			"it with command_kill. The output is kept in a 1 MiB buffer per stream.",
		InputSchema: schemaWithCmd[CommandStartIn](),
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(true), OpenWorldHint: boolPtr(false)},
	}, t.commandStart)
	mcp.AddTool(s, &mcp.Tool{
		Name:  "command_output",
		Title: "Read a command's output",
		Description: "Read the output of a command (from command_start or command_run) since given byte offsets, and whether " +
			"it is still running or how it exited. Pass the next_stdout/next_stderr of the previous call as " +
			"since_stdout/since_stderr to get only what is new; set wait_seconds to wait for new output or the exit.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, t.commandOutput)
	mcp.AddTool(s, &mcp.Tool{
		Name:        "command_list",
		Title:       "List a sandbox's commands",
		Description: fmt.Sprintf("List the commands started in a sandbox (newest first, at most %d) with their state, pid and exit code.", MaxListCommands),
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, t.commandList)
	mcp.AddTool(s, &mcp.Tool{
		Name:        "command_kill",
		Title:       "Signal a command",
		Description: "Send a signal to a running command (KILL unless signal says otherwise; TERM or INT ask it to stop cleanly).",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(true), IdempotentHint: true, OpenWorldHint: boolPtr(false)},
	}, t.commandKill)
}

// outputLimit checks a per-stream byte limit (0 = the default).
func outputLimit(n int, name string) (int, error) {
	switch {
	case n == 0:
		return DefaultOutputBytes, nil
	case n < 0 || n > MaxOutputBytes:
		return 0, invalid("%s must be 1 to %d, got %d", name, MaxOutputBytes, n)
	}
	return n, nil
}

func (t *tools) commandRun(ctx context.Context, _ *mcp.CallToolRequest, in CommandRunIn) (*mcp.CallToolResult, CommandRunOut, error) {
	req, err := in.request()
	if err != nil {
		return nil, CommandRunOut{}, err
	}
	limit, err := outputLimit(in.MaxOutputBytes, "max_output_bytes")
	if err != nil {
		return nil, CommandRunOut{}, err
	}
	timeout := DefaultRunTimeout
	if in.TimeoutSeconds != 0 {
		if in.TimeoutSeconds < 0 || in.TimeoutSeconds > MaxRunTimeout.Seconds() || math.IsNaN(in.TimeoutSeconds) {
			return nil, CommandRunOut{}, invalid("timeout_seconds must be between 0 and %d", int(MaxRunTimeout.Seconds()))
		}
		timeout = time.Duration(in.TimeoutSeconds * float64(time.Second))
	}
	// A command session rather than a synchronous exec: every byte is
	// counted (so a truncated stream says how much is missing), and the
	// rest stays readable by offset with command_output.
	cmd, err := t.c.CreateCommand(ctx, in.ID, api.CreateCommandRequest{ExecRequest: req})
	if err != nil {
		return nil, CommandRunOut{}, toolError("starting the command in sandbox "+in.ID, err)
	}
	start := time.Now()
	stdout, stderr := &capture{limit: limit}, &capture{limit: limit}
	sess, err := t.c.Attach(ctx, cmd, sdk.AttachOptions{Stdout: stdout, Stderr: stderr})
	if err != nil {
		return nil, CommandRunOut{}, toolError("attaching to command "+cmd.ID, err)
	}
	defer sess.Close()
	go func() {
		if in.Stdin != "" {
			if _, err := sess.Stdin.Write([]byte(in.Stdin)); err != nil {
				return
			}
		}
		_ = sess.Stdin.Close()
	}()
	var (
		timedOut bool
		tmu      sync.Mutex
	)
	timer := time.AfterFunc(timeout, func() {
		tmu.Lock()
		timedOut = true
		tmu.Unlock()
		kctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = t.c.SignalCommand(kctx, in.ID, cmd.ID, "KILL")
	})
	defer timer.Stop()
	st, err := sess.Wait()
	if err != nil {
		if ctx.Err() != nil {
			// The client gave up on the call: do not leave the command
			// running behind its back.
			kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			_ = t.c.SignalCommand(kctx, in.ID, cmd.ID, "KILL")
		}
		return nil, CommandRunOut{}, toolError("running command "+cmd.ID, err)
	}
	timer.Stop()
	tmu.Lock()
	out := CommandRunOut{
		CommandID: cmd.ID, ExitCode: st.ExitCode, Signal: st.Signal, TimedOut: timedOut, OOMKilled: st.OOMKilled,
		Stdout: string(stdout.buf), Stderr: string(stderr.buf),
		StdoutTruncated: stdout.omitted() > 0, StderrTruncated: stderr.omitted() > 0,
		StdoutOmitted: stdout.omitted(), StderrOmitted: stderr.omitted(),
		DurationMS: float64(time.Since(start).Microseconds()) / 1000,
	}
	tmu.Unlock()
	return text(runText(in.ID, out, int64(len(stdout.buf)), int64(len(stderr.buf)))), out, nil
}

// runText is command_run's result as a model reads it.
func runText(sandboxID string, o CommandRunOut, keptOut, keptErr int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "exit_code: %d", o.ExitCode)
	if o.Signal != "" {
		fmt.Fprintf(&b, " (killed by signal %s)", o.Signal)
	}
	if o.TimedOut {
		b.WriteString(" — timed out and killed; use command_start for long-running commands")
	}
	if o.OOMKilled {
		b.WriteString(" — killed by the OOM killer: the sandbox ran out of memory")
	}
	fmt.Fprintf(&b, "\nduration_ms: %.0f\n", o.DurationMS)
	b.WriteString(streamText("stdout", o.Stdout, o.StdoutOmitted))
	b.WriteString(streamText("stderr", o.Stderr, o.StderrOmitted))
	if o.StdoutTruncated || o.StderrTruncated {
		fmt.Fprintf(&b, "Output was truncated. Read the rest with command_output {id: %q, command_id: %q, since_stdout: %d, since_stderr: %d} "+
			"(the newest 1 MiB per stream is kept), or redirect the output to a file and page it with file_read.\n",
			sandboxID, o.CommandID, keptOut, keptErr)
	}
	return b.String()
}

func (t *tools) commandStart(ctx context.Context, _ *mcp.CallToolRequest, in CommandStartIn) (*mcp.CallToolResult, CommandStartOut, error) {
	req, err := in.request()
	if err != nil {
		return nil, CommandStartOut{}, err
	}
	cmd, err := t.c.CreateCommand(ctx, in.ID, api.CreateCommandRequest{ExecRequest: req, Detached: true})
	if err != nil {
		return nil, CommandStartOut{}, toolError("starting the command in sandbox "+in.ID, err)
	}
	out := CommandStartOut{CommandID: cmd.ID, Pid: cmd.Pid, State: cmd.State}
	return text(fmt.Sprintf("Started command %s (pid %d) in %s. Read its output with command_output {id: %q, command_id: %q}.",
		cmd.ID, cmd.Pid, in.ID, in.ID, cmd.ID)), out, nil
}

// Timing of command_output's read of the replay buffer: the buffered
// output arrives at once after the attach, so a short quiet spell after it
// means "nothing more for now".
const (
	outputQuiet    = 150 * time.Millisecond
	outputMinWait  = 300 * time.Millisecond // for the replay to start arriving
	exitedMaxWait  = 10 * time.Second       // an exited command's replay ends with its exit
	outputPollTick = 25 * time.Millisecond
)

// pager collects one attach's output from given offsets, up to a limit per
// stream, keeping exact offsets across drops and cuts.
type pager struct {
	mu      sync.Mutex
	limit   int
	buf     [2][]byte
	next    [2]int64 // offset of the next byte not returned
	full    [2]bool
	dropped [2]int64
	last    time.Time // when anything last arrived
}

func (p *pager) write(i int, b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.last = time.Now()
	if p.full[i] {
		return
	}
	room := p.limit - len(p.buf[i])
	keep := len(b)
	if keep > room {
		keep = utf8Cut(b, room)
		p.full[i] = true
	}
	p.buf[i] = append(p.buf[i], b[:keep]...)
	p.next[i] += int64(keep)
}

func (p *pager) drop(stream string, n int64) {
	i := 0
	if stream == "stderr" {
		i = 1
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.last = time.Now()
	if !p.full[i] {
		p.next[i] += n
		p.dropped[i] += n
	}
}

type pagerStream struct {
	p *pager
	i int
}

func (w pagerStream) Write(b []byte) (int, error) { w.p.write(w.i, b); return len(b), nil }

func (t *tools) commandOutput(ctx context.Context, _ *mcp.CallToolRequest, in CommandOutputIn) (*mcp.CallToolResult, CommandOutputOut, error) {
	limit, err := outputLimit(in.MaxBytes, "max_bytes")
	if err != nil {
		return nil, CommandOutputOut{}, err
	}
	if in.SinceStdout < 0 || in.SinceStderr < 0 {
		return nil, CommandOutputOut{}, invalid("since_stdout and since_stderr must not be negative")
	}
	if in.WaitSeconds < 0 || in.WaitSeconds > MaxWaitSeconds || math.IsNaN(in.WaitSeconds) {
		return nil, CommandOutputOut{}, invalid("wait_seconds must be between 0 and %d", MaxWaitSeconds)
	}
	out, err := t.readOutput(ctx, in.ID, in.CommandID, in.SinceStdout, in.SinceStderr, limit, time.Duration(in.WaitSeconds*float64(time.Second)))
	if err != nil {
		return nil, CommandOutputOut{}, err
	}
	return text(outputText(in.ID, out)), out, nil
}

// readOutput attaches to a command at the given offsets and returns what
// it delivers: everything buffered (up to limit per stream), and, when
// wait > 0 and nothing new is there yet, what arrives within wait.
func (t *tools) readOutput(ctx context.Context, sandboxID, cmdID string, sinceOut, sinceErr int64, limit int, wait time.Duration) (CommandOutputOut, error) {
	cmd, err := t.c.GetCommand(ctx, sandboxID, cmdID)
	if err != nil {
		return CommandOutputOut{}, toolError("reading command "+cmdID, err)
	}
	exited := cmd.State == api.CommandExited
	p := &pager{limit: limit, next: [2]int64{sinceOut, sinceErr}}
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	sess, err := t.c.Attach(actx, cmd, sdk.AttachOptions{
		Stdout: pagerStream{p, 0}, Stderr: pagerStream{p, 1},
		StdoutOffset: sinceOut, StderrOffset: sinceErr,
		OnDropped: p.drop, ReattachTimeout: -1,
	})
	if err != nil {
		return CommandOutputOut{}, toolError("reading the output of command "+cmdID, err)
	}
	defer sess.Close()
	type result struct {
		st  api.ExitStatus
		err error
	}
	done := make(chan result, 1)
	go func() {
		st, err := sess.Wait()
		done <- result{st, err}
	}()
	start := time.Now()
	deadline := start.Add(max(wait, outputMinWait))
	if exited {
		deadline = start.Add(exitedMaxWait)
	}
	tick := time.NewTicker(outputPollTick)
	defer tick.Stop()
	var (
		res    result
		gotEnd bool
	)
loop:
	for {
		select {
		case res = <-done:
			gotEnd = true
			break loop
		case <-ctx.Done():
			return CommandOutputOut{}, toolError("reading the output of command "+cmdID, ctx.Err())
		case now := <-tick.C:
			p.mu.Lock()
			last, full := p.last, p.full[0] && p.full[1]
			got := len(p.buf[0])+len(p.buf[1]) > 0 || p.dropped[0]+p.dropped[1] > 0
			p.mu.Unlock()
			quiet := !last.IsZero() && now.Sub(last) >= outputQuiet
			switch {
			case full:
				break loop
			case exited:
				// Its whole replay and then the exit frame are coming.
				if now.After(deadline) {
					break loop
				}
			case now.After(deadline):
				break loop
			case got && quiet && now.Sub(start) >= outputMinWait:
				// Something new arrived and nothing more for a while.
				break loop
			case !got && wait == 0 && now.Sub(start) >= outputMinWait:
				break loop
			}
		}
	}
	cancel()
	if !gotEnd {
		res = <-done // the cancel ends Wait
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	out := CommandOutputOut{
		CommandID: cmdID, Running: true,
		Stdout: string(p.buf[0]), Stderr: string(p.buf[1]),
		NextStdout: p.next[0], NextStderr: p.next[1],
		More:          p.full[0] || p.full[1],
		DroppedStdout: p.dropped[0], DroppedStderr: p.dropped[1],
	}
	if gotEnd && res.err == nil {
		code := res.st.ExitCode
		out.Running, out.ExitCode, out.Signal, out.OOMKilled = false, &code, res.st.Signal, res.st.OOMKilled
	} else if gotEnd && !errors.Is(res.err, context.Canceled) {
		return CommandOutputOut{}, toolError("reading the output of command "+cmdID, res.err)
	}
	return out, nil
}

// outputText is command_output's result as a model reads it.
func outputText(sandboxID string, o CommandOutputOut) string {
	var b strings.Builder
	if o.Running {
		b.WriteString("state: running\n")
	} else {
		fmt.Fprintf(&b, "state: exited, exit_code: %d", *o.ExitCode)
		if o.Signal != "" {
			fmt.Fprintf(&b, " (killed by signal %s)", o.Signal)
		}
		b.WriteString("\n")
	}
	if o.DroppedStdout+o.DroppedStderr > 0 {
		fmt.Fprintf(&b, "(%d stdout and %d stderr bytes were overwritten in the 1 MiB buffer before they could be read)\n", o.DroppedStdout, o.DroppedStderr)
	}
	b.WriteString(streamText("stdout", o.Stdout, 0))
	b.WriteString(streamText("stderr", o.Stderr, 0))
	switch {
	case o.More:
		fmt.Fprintf(&b, "More output is waiting: call command_output again with since_stdout: %d, since_stderr: %d.\n", o.NextStdout, o.NextStderr)
	case o.Running:
		fmt.Fprintf(&b, "For newer output call command_output {id: %q, command_id: %q, since_stdout: %d, since_stderr: %d, wait_seconds: 10}.\n",
			sandboxID, o.CommandID, o.NextStdout, o.NextStderr)
	}
	return b.String()
}

func (t *tools) commandList(ctx context.Context, _ *mcp.CallToolRequest, in SandboxIDIn) (*mcp.CallToolResult, CommandListOut, error) {
	cmds, err := t.c.ListCommands(ctx, in.ID)
	if err != nil {
		return nil, CommandListOut{}, toolError("listing the commands of sandbox "+in.ID, err)
	}
	sort.SliceStable(cmds, func(i, j int) bool { return cmds[i].CreatedAt.After(cmds[j].CreatedAt) })
	out := CommandListOut{Commands: []CommandInfo{}}
	for _, c := range cmds {
		if len(out.Commands) == MaxListCommands {
			out.Truncated = true
			break
		}
		ci := CommandInfo{CommandID: c.ID, Cmd: c.Cmd, State: c.State, Pid: c.Pid, CreatedAt: c.CreatedAt.UTC().Format(time.RFC3339)}
		if ci.Cmd == nil {
			ci.Cmd = []string{}
		}
		if c.Exit != nil {
			code := c.Exit.ExitCode
			ci.ExitCode, ci.Signal = &code, c.Exit.Signal
		}
		out.Commands = append(out.Commands, ci)
	}
	return nil, out, nil
}

func (t *tools) commandKill(ctx context.Context, _ *mcp.CallToolRequest, in CommandKillIn) (*mcp.CallToolResult, CommandKillOut, error) {
	sig := in.Signal
	if sig == "" {
		sig = "KILL"
	}
	if err := t.c.SignalCommand(ctx, in.ID, in.CommandID, sig); err != nil {
		return nil, CommandKillOut{}, toolError(fmt.Sprintf("signalling command %s with %s", in.CommandID, sig), err)
	}
	return text(fmt.Sprintf("Sent %s to command %s. command_output tells when it has exited.", sig, in.CommandID)),
		CommandKillOut{CommandID: in.CommandID, Signal: sig}, nil
}
