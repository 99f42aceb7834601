package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
	"golang.org/x/term"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// processFlags are the flags of the process started by run and exec.
type processFlags struct {
	interactive, tty bool
	env              []string
	workdir, user    string
	timeout          string
}

func (p *processFlags) register(cmd *cobra.Command, withEnv bool) {
	fl := cmd.Flags()
	fl.BoolVarP(&p.interactive, "interactive", "i", false, "forward stdin to the process")
	fl.BoolVarP(&p.tty, "tty", "t", false, "allocate a terminal (needs a terminal on stdin)")
	fl.StringVar(&p.timeout, "timeout", "", "kill the process after this long, e.g. 30s")
	if withEnv {
		fl.StringArrayVarP(&p.env, "env", "e", nil, "environment variable KEY=VALUE (repeatable)")
		fl.StringVarP(&p.workdir, "workdir", "w", "", "working directory of the process")
		fl.StringVarP(&p.user, "user", "u", "", `user "uid[:gid]" inside the sandbox`)
	}
}

func (p *processFlags) request(argv []string) (api.ExecRequest, error) {
	req := api.ExecRequest{Cmd: argv, Workdir: p.workdir, User: p.user, TTY: p.tty}
	if len(argv) == 0 {
		return req, usagef("no command given (put it after --)")
	}
	env, err := parseKV("env", p.env, true)
	if err != nil {
		return req, &usageError{err}
	}
	req.Env = env
	if p.timeout != "" {
		d, err := time.ParseDuration(p.timeout)
		if err != nil || d <= 0 {
			return req, usagef("--timeout %q: want a positive duration like 30s", p.timeout)
		}
		req.TimeoutSeconds = d.Seconds()
	}
	if p.user != "" && !validUser(p.user) {
		return req, usagef(`--user %q: want "uid" or "uid:gid" (numbers)`, p.user)
	}
	return req, nil
}

func validUser(u string) bool {
	uid, gid, hasGid := strings.Cut(u, ":")
	isNum := func(s string) bool {
		if s == "" || len(s) > 10 {
			return false
		}
		for _, r := range s {
			if r < '0' || r > '9' {
				return false
			}
		}
		return true
	}
	return isNum(uid) && (!hasGid || isNum(gid))
}

func newRunCmd(a *app) *cobra.Command {
	var f sandboxFlags
	var p processFlags
	var rm bool
	cmd := &cobra.Command{
		Use:   "run [flags] -- CMD [ARG...]",
		Short: "Create a sandbox, run a command in it attached, exit with its code, delete it",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			sreq, err := f.request()
			if err != nil {
				return err
			}
			p.env = nil // sandbox env is the process env for run
			preq, err := p.request(args)
			if err != nil {
				return err
			}
			return a.run(sreq, preq, p, rm)
		},
	}
	f.register(cmd, false)
	p.register(cmd, false)
	cmd.Flags().BoolVar(&rm, "rm", true, "delete the sandbox afterwards")
	cmd.Flags().SetInterspersed(false)
	return cmd
}

func (a *app) run(sreq api.CreateSandboxRequest, preq api.ExecRequest, p processFlags, rm bool) error {
	c, err := a.Client()
	if err != nil {
		return err
	}
	// An interrupt while the sandbox is being created must still delete it;
	// once attached, signals are forwarded to the process instead.
	ctx := a.ctx
	if _, real := a.stdinFile(); real {
		var stop context.CancelFunc
		ctx, stop = signal.NotifyContext(a.ctx, os.Interrupt, syscall.SIGTERM)
		defer stop()
	}
	if err := a.ensureBase(ctx, c, sreq.Template); err != nil {
		return &runFailedError{err}
	}
	res, err := c.CreateSandbox(ctx, sreq)
	if err != nil {
		return &runFailedError{err}
	}
	id := res.Sandbox.ID
	if rm {
		defer a.cleanup(c, id)
	}
	if _, err := c.WaitOperation(ctx, res.Operation.ID); err != nil {
		return &runFailedError{fmt.Errorf("sandbox %s: %w", id, err)}
	}
	return a.attachProcess(c, id, preq, p)
}

// cleanup deletes a run's sandbox even when the run was interrupted: it
// uses its own deadline rather than the (maybe cancelled) command context.
func (a *app) cleanup(c *sdk.Client, id string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(a.ctx), 60*time.Second)
	defer cancel()
	op, err := c.DeleteSandbox(ctx, id, true)
	if err == nil {
		_, err = c.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		fmt.Fprintf(a.errOut, "space: deleting sandbox %s: %v\n", id, err)
	}
}

func newExecCmd(a *app) *cobra.Command {
	var p processFlags
	var detach bool
	cmd := &cobra.Command{
		Use:   "exec [flags] ID -- CMD [ARG...]",
		Short: "Run a command in a sandbox",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			argv := args[1:]
			// Flags stop at the sandbox id, so a "--" after it is still
			// in the arguments: it separates, it is not the command.
			if len(argv) > 0 && argv[0] == "--" {
				argv = argv[1:]
			}
			req, err := p.request(argv)
			if err != nil {
				return err
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			if detach {
				// -d -t (docker's -dit) starts a TTY command for a later
				// `space attach`, sized like this terminal if there is
				// one; a detached command's stdin stays open for that
				// attach anyway, so -i changes nothing.
				if p.tty {
					if f, ok := a.stdinFile(); ok && term.IsTerminal(int(f.Fd())) {
						if cols, rows, err := term.GetSize(int(f.Fd())); err == nil {
							req.Rows, req.Cols = uint16(rows), uint16(cols)
						}
					}
				}
				cmdObj, err := c.CreateCommand(a.ctx, args[0], api.CreateCommandRequest{ExecRequest: req, Detached: true})
				if err != nil {
					return err
				}
				cmdObj.AttachToken = "" // a secret; not for logs
				if a.json {
					return printJSON(a.out, cmdObj)
				}
				fmt.Fprintln(a.out, cmdObj.ID)
				return nil
			}
			return a.attachProcess(c, args[0], req, p)
		},
	}
	p.register(cmd, true)
	cmd.Flags().BoolVarP(&detach, "detach", "d", false, "start in the background and print the command id (see space ps, logs, attach, kill)")
	cmd.Flags().SetInterspersed(false)
	return cmd
}

// attachProcess runs req in sandbox id attached to the CLI's streams and
// turns the process's exit into the CLI's exit code.
func (a *app) attachProcess(c *sdk.Client, id string, req api.ExecRequest, p processFlags) error {
	var restore func()
	if req.TTY {
		rows, cols, undo, err := a.makeRaw()
		if errors.Is(err, errNoTerminal) {
			return usagef("-t needs a terminal on stdin")
		}
		if err != nil {
			return &runFailedError{err}
		}
		if rows > 0 && cols > 0 {
			req.Rows, req.Cols = rows, cols
		}
		restore = undo
		defer restore()
	}
	stderr := a.errOut
	if req.TTY {
		// In raw mode "\n" does not return the carriage; notes from the
		// SDK go through a translator so they stay readable.
		stderr = crlfWriter{a.errOut}
	}
	opts := sdk.AttachOptions{Stdout: a.out, Stderr: stderr}
	streamed := !req.TTY && !p.interactive
	var sess *sdk.Session
	var err error
	if streamed {
		// Nothing to send but signals: one request that starts the
		// command and streams its output (no WebSocket).
		sess, err = c.ExecStream(a.ctx, id, req, opts)
		if errors.Is(err, sdk.ErrNotFound) {
			streamed = false // a server without the route; the attach path says what is missing
		} else if err != nil {
			return &runFailedError{err}
		}
	}
	if !streamed {
		cmdObj, err := c.CreateCommand(a.ctx, id, api.CreateCommandRequest{ExecRequest: req})
		if err != nil {
			return &runFailedError{err}
		}
		if sess, err = c.Attach(a.ctx, cmdObj, opts); err != nil {
			return &runFailedError{err}
		}
	}
	defer sess.Close()

	stopSignals := a.forwardSignals(sess, req.TTY)
	defer stopSignals()

	switch {
	case streamed: // the server closed stdin
	case p.interactive || req.TTY:
		go func() {
			// io.Copy ends on local EOF; EOF is then passed on. A failed
			// write means the session ended; nothing more to do.
			if _, err := io.Copy(sess.Stdin, a.in); err == nil {
				_ = sess.Stdin.Close()
			}
		}()
	default:
		_ = sess.Stdin.Close()
	}
	st, err := sess.Wait()
	if restore != nil {
		restore()
	}
	if err != nil {
		return &runFailedError{err}
	}
	return a.exitWith(st)
}

// errNoTerminal is makeRaw's answer when stdin is not a terminal.
var errNoTerminal = errors.New("stdin is not a terminal")

// makeRaw puts the terminal on stdin in raw mode and returns its size (0
// when unknown) and the function that restores it (idempotent).
func (a *app) makeRaw() (rows, cols uint16, restore func(), err error) {
	f, ok := a.stdinFile()
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return 0, 0, nil, errNoTerminal
	}
	if c, r, err := term.GetSize(int(f.Fd())); err == nil {
		rows, cols = uint16(r), uint16(c)
	}
	state, err := term.MakeRaw(int(f.Fd()))
	if err != nil {
		return 0, 0, nil, fmt.Errorf("setting the terminal to raw mode: %w", err)
	}
	return rows, cols, sync.OnceFunc(func() { _ = term.Restore(int(f.Fd()), state) }), nil
}

// forwardSignals relays the CLI's own signals to the process: window
// changes always (TTY), and interrupts when not in raw mode (in raw mode
// Ctrl-C is just a byte on stdin). Only for a real process, not tests.
func (a *app) forwardSignals(sess *sdk.Session, tty bool) (stop func()) {
	f, ok := a.stdinFile()
	if !ok {
		return func() {}
	}
	ch := make(chan os.Signal, 4)
	if tty {
		signal.Notify(ch, syscall.SIGWINCH)
	} else {
		signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			case sig := <-ch:
				if sig == syscall.SIGWINCH {
					if cols, rows, err := term.GetSize(int(f.Fd())); err == nil {
						_ = sess.Resize(uint16(rows), uint16(cols))
					}
					continue
				}
				_ = sess.Signal(strings.TrimPrefix(unix.SignalName(sig.(syscall.Signal)), "SIG"))
			}
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
	}
}

// exitCode maps a process exit to a shell-style exit code: the code, or
// 128+signal number when it was killed.
func exitCode(st api.ExitStatus) int {
	if st.Signal != "" {
		name := strings.ToUpper(st.Signal)
		if !strings.HasPrefix(name, "SIG") {
			name = "SIG" + name
		}
		if n := unix.SignalNum(name); n != 0 {
			return 128 + int(n)
		}
		return 128 + 9 // unknown signal name: report it as a kill
	}
	if st.ExitCode < 0 || st.ExitCode > 255 {
		return ExitError
	}
	return st.ExitCode
}

// crlfWriter turns "\n" into "\r\n" for a terminal in raw mode.
type crlfWriter struct{ w io.Writer }

func (c crlfWriter) Write(p []byte) (int, error) {
	if _, err := c.w.Write([]byte(strings.ReplaceAll(string(p), "\n", "\r\n"))); err != nil {
		return 0, err
	}
	return len(p), nil
}

var _ io.Writer = crlfWriter{}
