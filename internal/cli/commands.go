package cli

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// The commands of one sandbox's processes, as docker has them for a
// container's: ps, logs, attach, kill. Each is one or two SDK calls.

// psExitedKept is how many exited commands `space ps ID` shows without
// --all (the newest), besides every created and running one.
const psExitedKept = 5

func newPsCmd(a *app) *cobra.Command {
	var all, quiet bool
	cmd := &cobra.Command{
		Use:   "ps [flags] [ID]",
		Short: "List a sandbox's commands (without ID: list sandboxes, as ls)",
		Long: "With a sandbox ID, lists its commands: id, pid inside the sandbox, state, exit, when it started, and the\n" +
			"command line. By default every running (and not yet started) command and the last " + strconv.Itoa(psExitedKept) + " that exited;\n" +
			"--all lists every one. Without an ID, lists sandboxes like `space ls`.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if len(args) == 0 {
				list, err := c.ListSandboxes(a.ctx, sdk.ListOptions{})
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
			}
			cmds, err := c.ListCommands(a.ctx, args[0])
			if err != nil {
				return err
			}
			if !all {
				cmds = recentCommands(cmds, psExitedKept)
			}
			if a.json {
				return printJSON(a.out, api.CommandList{Commands: nonNil(cmds)})
			}
			if quiet {
				for _, cm := range cmds {
					fmt.Fprintln(a.out, cm.ID)
				}
				return nil
			}
			now := time.Now()
			t := newTable(a.out, "ID", "PID", "STATE", "EXIT", "STARTED", "COMMAND")
			for _, cm := range cmds {
				pid := "-"
				if cm.Pid > 0 {
					pid = strconv.Itoa(cm.Pid)
				}
				started := "-"
				if cm.StartedAt != nil {
					started = ago(now, *cm.StartedAt)
				}
				tty := ""
				if cm.TTY {
					tty = " (tty)"
				}
				t.row(cm.ID, pid, cm.State+tty, exitText(cm.Exit), started, commandLine(cm.Cmd, 60))
			}
			return t.flush()
		},
	}
	cmd.Flags().BoolVarP(&all, "all", "a", false, "list every command, not only running ones and the last exited")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print only ids")
	return cmd
}

// recentCommands keeps every command that has not exited and the last
// keep that have (cmds is oldest first, as the server lists them).
func recentCommands(cmds []api.Command, keep int) []api.Command {
	exited := 0
	for _, cm := range cmds {
		if cm.State == api.CommandExited {
			exited++
		}
	}
	out := make([]api.Command, 0, len(cmds))
	for _, cm := range cmds {
		if cm.State == api.CommandExited {
			exited--
			if exited >= keep {
				continue
			}
		}
		out = append(out, cm)
	}
	return out
}

// exitText is the EXIT column: the shell-style code, and how it ended
// when a signal or the OOM killer did it.
func exitText(st *api.ExitStatus) string {
	if st == nil {
		return "-"
	}
	code := strconv.Itoa(exitCode(*st))
	switch {
	case st.OOMKilled:
		return code + " (OOM killed)"
	case st.Signal != "":
		sig := strings.ToUpper(st.Signal)
		if !strings.HasPrefix(sig, "SIG") {
			sig = "SIG" + sig
		}
		return code + " (" + sig + ")"
	}
	return code
}

// commandLine renders argv for a table, shell-quoted where needed and cut
// at max runes.
func commandLine(argv []string, max int) string {
	parts := make([]string, len(argv))
	for i, s := range argv {
		if s == "" || strings.ContainsAny(s, " \t\n'\"\\$`;&|<>*?()[]{}!#~") {
			s = strconv.Quote(s)
		}
		parts[i] = s
	}
	line := strings.Join(parts, " ")
	if r := []rune(line); len(r) > max {
		line = string(r[:max-1]) + "…"
	}
	return line
}

func newLogsCmd(a *app) *cobra.Command {
	var follow bool
	var tail int
	cmd := &cobra.Command{
		Use:   "logs [flags] ID CMD",
		Short: "Print a command's output (stdout to stdout, stderr to stderr)",
		Long: "Prints what a command has written, from the server's replay buffer (the last 1 MiB of each stream; when\n" +
			"older output was overwritten a \"[space: N bytes of output were dropped]\" note says so on stderr).\n" +
			"With -f it then follows the output until the command exits and exits with its exit code, as `space exec`\n" +
			"does; Ctrl-C stops following and leaves the command running. --tail N prints only the last N lines of\n" +
			"each stream (stdout and stderr are separate streams: their lines are not interleaved by time).",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if tail < -1 {
				return usagef("--tail %d: want a number of lines (0 or more)", tail)
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			return a.logs(c, args[0], args[1], follow, tail)
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "follow the output until the command exits, then exit with its code")
	cmd.Flags().IntVarP(&tail, "tail", "n", -1, "print only the last N lines of each stream (-1: all)")
	return cmd
}

func (a *app) logs(c *sdk.Client, id, cmdID string, follow bool, tail int) error {
	cm, err := c.GetCommand(a.ctx, id, cmdID)
	if err != nil {
		return err
	}
	if cm.State == api.CommandCreated {
		// Attaching would start it: logs only reads.
		fmt.Fprintf(a.errOut, "space: command %s has not started (it starts when something attaches: space attach %s %s)\n", cmdID, id, cmdID)
		return nil
	}
	outW, errW := io.Writer(a.out), io.Writer(a.errOut)
	var tails []*tailWriter
	if tail >= 0 {
		to, te := &tailWriter{w: a.out, n: tail}, &tailWriter{w: a.errOut, n: tail}
		tails = []*tailWriter{to, te}
		outW, errW = to, te
	}
	flush := func() error {
		for _, t := range tails {
			if err := t.flush(); err != nil {
				return err
			}
		}
		return nil
	}
	if !follow || cm.State == api.CommandExited {
		st, err := c.ReadOutput(a.ctx, cm, sdk.AttachOptions{Stdout: outW, Stderr: errW})
		if err != nil {
			return err
		}
		if err := flush(); err != nil {
			return err
		}
		if follow && st != nil {
			return a.exitWith(*st)
		}
		return nil
	}
	sess, err := c.Attach(a.ctx, cm, sdk.AttachOptions{Stdout: outW, Stderr: errW})
	if err != nil {
		return err
	}
	defer sess.Close()
	// The tail is of the output up to now; what comes later is printed
	// as it comes.
	for i, t := range tails {
		i, end := i, [2]int64{cm.StdoutBytes, cm.StderrBytes}[i]
		t.until = end
		t.offset = func() int64 { o, e := sess.Offsets(); return [2]int64{o, e}[i] }
	}
	st, err := sess.Wait()
	if ferr := flush(); err == nil {
		err = ferr
	}
	if err != nil {
		return err
	}
	return a.exitWith(st)
}

// exitWith turns a process's exit into the CLI's exit, as exec does.
func (a *app) exitWith(st api.ExitStatus) error {
	if st.Reason != "" && (st.OOMKilled || st.Signal != "") {
		fmt.Fprintf(a.errOut, "space: %s\n", st.Reason)
	}
	if code := exitCode(st); code != 0 {
		return &exitCodeError{code}
	}
	return nil
}

// tailWriter keeps the last n lines of what is written to it up to the
// stream offset until, and writes them to w then (or at flush); what comes
// after until is written through. offset, when set, is the stream's offset
// after the current write (sdk.Session.Offsets); without it everything is
// held until flush.
type tailWriter struct {
	w      io.Writer
	n      int
	until  int64
	offset func() int64

	buf  []byte
	done bool
}

// tailHold bounds what a tailWriter holds: past it, only the last n lines
// are kept (the server's replay buffer is 1 MiB per stream, so this is
// only reached by a server that claims more).
const tailHold = 4 << 20

func (t *tailWriter) Write(p []byte) (int, error) {
	if t.done {
		return t.w.Write(p)
	}
	n := len(p)
	if t.offset != nil {
		end := t.offset()
		start := end - int64(len(p))
		if start >= t.until {
			if err := t.flush(); err != nil {
				return 0, err
			}
			return t.w.Write(p)
		}
		if end > t.until {
			// The write straddles the end of the tail.
			cut := t.until - start
			t.buf = append(t.buf, p[:cut]...)
			if err := t.flush(); err != nil {
				return 0, err
			}
			if _, err := t.w.Write(p[cut:]); err != nil {
				return 0, err
			}
			return n, nil
		}
	}
	t.buf = append(t.buf, p...)
	if len(t.buf) > tailHold {
		t.buf = append([]byte(nil), lastLines(t.buf, t.n)...)
	}
	if t.offset != nil && t.offset() >= t.until {
		if err := t.flush(); err != nil {
			return 0, err
		}
	}
	return n, nil
}

// flush writes the held tail once; later writes go straight through.
func (t *tailWriter) flush() error {
	if t.done {
		return nil
	}
	t.done = true
	b := lastLines(t.buf, t.n)
	t.buf = nil
	if len(b) == 0 {
		return nil
	}
	_, err := t.w.Write(b)
	return err
}

// lastLines is the suffix of b holding its last n lines (an unterminated
// last line counts as one).
func lastLines(b []byte, n int) []byte {
	if n <= 0 {
		return nil
	}
	end := len(b)
	if end > 0 && b[end-1] == '\n' {
		end--
	}
	for i := end - 1; i >= 0; i-- {
		if b[i] == '\n' {
			n--
			if n == 0 {
				return b[i+1:]
			}
		}
	}
	return b
}

func newKillCmd(a *app) *cobra.Command {
	var sig string
	cmd := &cobra.Command{
		Use:   "kill [flags] ID CMD",
		Short: "Send a signal to a command (default TERM); `space rm` deletes sandboxes",
		Long: "Sends a signal to a running command's process group in the sandbox (default TERM; -s KILL, -s INT, -s 9, …).\n" +
			"It prints the command id. `space ps ID` then shows how it ended.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			s := strings.TrimPrefix(strings.ToUpper(strings.TrimSpace(sig)), "SIG")
			if s == "" {
				return usagef("--signal: empty")
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			if err := c.SignalCommand(a.ctx, args[0], args[1], s); err != nil {
				return err
			}
			fmt.Fprintln(a.out, args[1])
			return nil
		},
	}
	cmd.Flags().StringVarP(&sig, "signal", "s", "TERM", "signal name (TERM, KILL, INT, HUP, …) or number")
	return cmd
}

// detachKeys end a TTY attach without touching the process: Ctrl-P Ctrl-Q,
// as docker has them.
const (
	detachKey1 = 0x10 // Ctrl-P
	detachKey2 = 0x11 // Ctrl-Q
)

// errDetached is how copyInput reports the detach keys.
var errDetached = errors.New("detached")

// copyInput copies src to dst. With detach it watches for Ctrl-P Ctrl-Q
// and returns errDetached when they come, without passing them on; a
// Ctrl-P followed by anything else is passed on with it. It returns nil
// on EOF of src.
func copyInput(dst io.Writer, src io.Reader, detach bool) error {
	buf := make([]byte, 32<<10)
	pending := false // a Ctrl-P was the last byte read
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			p := buf[:n]
			if detach {
				var out []byte
				if pending {
					if p[0] == detachKey2 {
						return errDetached
					}
					out = append(out, detachKey1)
					pending = false
				}
				for i := 0; i < len(p); i++ {
					if p[i] != detachKey1 {
						continue
					}
					if i+1 == len(p) {
						out = append(out, p[:i]...)
						p, pending = nil, true
						break
					}
					if p[i+1] == detachKey2 {
						if len(out)+i > 0 {
							if _, err := dst.Write(append(out, p[:i]...)); err != nil {
								return err
							}
						}
						return errDetached
					}
				}
				p = append(out, p...)
			}
			if len(p) > 0 {
				if _, err := dst.Write(p); err != nil {
					return err
				}
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

func newAttachCmd(a *app) *cobra.Command {
	var noStdin, closeStdin, replay bool
	cmd := &cobra.Command{
		Use:   "attach [flags] ID CMD",
		Short: "Attach the terminal to a running command's stdin, stdout and stderr",
		Long: "Re-attaches to a command started earlier (space exec -d, or one whose client went away): its new output\n" +
			"is printed (--replay: first what the server still buffers) and your input is sent to it.\n" +
			"A command with a TTY gets the terminal in raw mode and its size; detach with Ctrl-P Ctrl-Q.\n" +
			"A command without one: Ctrl-C or the end of your input (Ctrl-D) detaches; --close-stdin passes the end\n" +
			"of input on to the command instead and stays attached.\n" +
			"Detaching never stops the command. When it exits, attach exits with its exit code, as `space exec` does.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if noStdin && closeStdin {
				return usagef("--no-stdin and --close-stdin exclude each other")
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			return a.attachCommand(c, args[0], args[1], attachFlags{noStdin: noStdin, closeStdin: closeStdin, replay: replay})
		},
	}
	cmd.Flags().BoolVar(&noStdin, "no-stdin", false, "do not send input; stay attached until the command exits or Ctrl-C")
	cmd.Flags().BoolVar(&closeStdin, "close-stdin", false, "at the end of your input close the command's stdin and stay attached")
	cmd.Flags().BoolVar(&replay, "replay", false, "first print the output the server still buffers")
	return cmd
}

type attachFlags struct{ noStdin, closeStdin, replay bool }

func (a *app) attachCommand(c *sdk.Client, id, cmdID string, f attachFlags) error {
	cm, err := c.GetCommand(a.ctx, id, cmdID)
	if err != nil {
		return err
	}
	if cm.State == api.CommandExited {
		return fmt.Errorf("command %s has exited (exit %s); its output: space logs %s %s", cmdID, exitText(cm.Exit), id, cmdID)
	}
	opts := sdk.AttachOptions{Stdout: a.out, Stderr: a.errOut}
	if !f.replay {
		opts.StdoutOffset, opts.StderrOffset = cm.StdoutBytes, cm.StderrBytes
	}
	var rows, cols uint16
	raw := false
	restore := func() {}
	if cm.TTY {
		// Without a terminal on stdin (a script, a test) the bytes go
		// through as they are.
		var undo func()
		if rows, cols, undo, err = a.makeRaw(); err == nil {
			raw = true
			restore = sync.OnceFunc(undo)
			defer restore()
			// In raw mode "\n" does not return the carriage.
			opts.Stderr = crlfWriter{a.errOut}
		} else if !errors.Is(err, errNoTerminal) {
			return err
		}
	}
	sess, err := c.Attach(a.ctx, cm, opts)
	if err != nil {
		return err
	}
	defer sess.Close()
	if raw {
		_ = sess.Resize(rows, cols)
		stop := a.forwardSignals(sess, true)
		defer stop()
	}
	detached := make(chan struct{})
	var once sync.Once
	detach := func() { once.Do(func() { close(detached) }) }
	if !f.noStdin {
		go func() {
			err := copyInput(sess.Stdin, a.in, cm.TTY)
			switch {
			case errors.Is(err, errDetached):
				detach()
			case err == nil && f.closeStdin:
				_ = sess.Stdin.Close()
			case err == nil:
				detach()
			}
			// A failed write means the session ended; Wait says how.
		}()
	}
	type result struct {
		st  api.ExitStatus
		err error
	}
	done := make(chan result, 1)
	go func() {
		st, err := sess.Wait()
		done <- result{st, err}
	}()
	select {
	case r := <-done:
		restore()
		if r.err != nil {
			return r.err
		}
		return a.exitWith(r.st)
	case <-detached:
		_ = sess.Close()
		restore()
		fmt.Fprintf(a.errOut, "space: detached from %s; it keeps running (space logs -f %s %s, space attach %s %s)\n", cmdID, id, cmdID, id, cmdID)
		return nil
	}
}

var _ io.Writer = (*tailWriter)(nil)
