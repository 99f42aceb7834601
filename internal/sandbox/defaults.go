package sandbox

// Template defaults (api.TemplateConfig) as a sandbox sees them: env,
// workdir and user are merged into the sandbox record at create, under what
// the create request asked for; the start command and its ready check run on
// every cold boot (create, start after stop, wake from stopped) but not after
// a resume, whose processes are still there.

import (
	"context"
	"fmt"
	"math"
	"path"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
)

// StartCommandIDPrefix begins the id of every command session that runs a
// template's start command, so clients can tell it from their own commands
// (theirs are "cmd-" and 16 characters; a start command is "cmd-start" and 16).
const StartCommandIDPrefix = "cmd-start"

// Bounds of the ready wait. The template store validates the same numbers
// when a template is made; they are checked again here because a template
// record is data read back from disk.
const (
	defaultReadyTimeout  = 60 * time.Second
	maxReadyTimeout      = 600 * time.Second
	defaultReadyInterval = 100 * time.Millisecond
	minReadyInterval     = 10 * time.Millisecond
	maxReadyInterval     = 60 * time.Second
	// failureTailBytes bounds each output excerpt in a start failure message.
	failureTailBytes = 2 << 10
	// readyOutputCap bounds what one ready check may print per stream.
	readyOutputCap = 16 << 10
)

func validateUser(field, u string) error {
	if u != "" && !userRE.MatchString(u) {
		return invalid("%s must be a user name or uid, optionally :group or :gid, got %q", field, truncate(u, 64))
	}
	return nil
}

// applyTemplateDefaults fills sb's env, workdir and user from the template's
// defaults; what the create request set wins (env key by key). Applying it
// twice (a re-driven create) changes nothing.
func applyTemplateDefaults(sb *api.Sandbox, tc api.TemplateConfig) error {
	if len(tc.Env) > 0 {
		env := make(map[string]string, len(tc.Env)+len(sb.Env))
		for k, v := range tc.Env {
			env[k] = v
		}
		for k, v := range sb.Env {
			env[k] = v
		}
		if err := validateEnv(env); err != nil {
			return fmt.Errorf("template env merged with the request's: %w", err)
		}
		sb.Env = env
	}
	if sb.Workdir == "" && tc.Workdir != "" {
		if err := validatePath("template workdir", tc.Workdir, false); err != nil {
			return err
		}
		if !path.IsAbs(tc.Workdir) {
			return invalid("template workdir must be an absolute path, got %q", truncate(tc.Workdir, 64))
		}
		sb.Workdir = tc.Workdir
	}
	if sb.User == "" && tc.User != "" {
		if err := validateUser("template user", tc.User); err != nil {
			return err
		}
		sb.User = tc.User
	}
	// The template's policy replaces none the request set (a request's
	// policy replaces the template's whole, not field by field).
	if sb.Network == nil && tc.Network != nil {
		if err := validatePolicy(*tc.Network); err != nil {
			return fmt.Errorf("template network policy: %w", err)
		}
		p := ClonePolicy(*tc.Network)
		sb.Network = &p
	}
	return nil
}

// isBuildStep reports whether sb runs a template build's RUN step. Like
// Docker's RUN, a step runs in its parent's filesystem and defaults but
// without the parent's start command: a build would otherwise start the
// server (and wait for it) before every step after START.
func isBuildStep(sb api.Sandbox) bool {
	return sb.Labels[BuildLabel] == BuildLabelStep
}

// startPlan is a template's start command with its defaults filled in.
type startPlan struct {
	cmd, ready []string
	timeout    time.Duration
	interval   time.Duration
}

// planStart validates st (nil: nothing to start) and fills in defaults.
func planStart(st *api.StartCommand) (*startPlan, error) {
	if st == nil {
		return nil, nil
	}
	if err := template.ValidateConfig(api.TemplateConfig{Start: st}); err != nil {
		return nil, err
	}
	for _, argv := range [][]string{st.Cmd, st.Ready} {
		if len(argv) == 0 {
			continue
		}
		if err := validateExec(&api.ExecRequest{Cmd: argv}); err != nil {
			return nil, fmt.Errorf("template start command: %w", err)
		}
	}
	secs := st.ReadyTimeoutSeconds
	if math.IsNaN(secs) || math.IsInf(secs, 0) || secs < 0 || secs > maxReadyTimeout.Seconds() {
		return nil, invalid("template ready_timeout_seconds must be between 0 and %v, got %v", maxReadyTimeout.Seconds(), secs)
	}
	p := &startPlan{cmd: st.Cmd, ready: st.Ready, timeout: defaultReadyTimeout, interval: defaultReadyInterval}
	if secs > 0 {
		p.timeout = time.Duration(secs * float64(time.Second))
	}
	if ms := st.ReadyIntervalMS; ms != 0 {
		if ms < 0 || ms > maxReadyInterval.Milliseconds() {
			return nil, invalid("template ready_interval_ms must be between 0 and %d, got %d", maxReadyInterval.Milliseconds(), ms)
		}
		p.interval = max(time.Duration(ms)*time.Millisecond, minReadyInterval)
	}
	return p, nil
}

// startFromTemplate runs the template's start command of the sandbox sb,
// whose agent c has just come up, and waits for its ready check. The caller
// holds e.mu; on error it tears the instance down.
func (part *Commands) startFromTemplate(ctx context.Context, p *phases, c *agentclient.Client, sb api.Sandbox, st *api.StartCommand) error {
	m := part.m
	plan, err := planStart(st)
	if err != nil || plan == nil {
		return err
	}
	rec := store.CommandRecord{
		Command: api.Command{ID: StartCommandIDPrefix + strings.TrimPrefix(newID("x"), "x-"), SandboxID: sb.ID,
			Cmd: plan.cmd, State: api.CommandCreated, CreatedAt: time.Now().UTC()},
		// Env stays empty: startCommand merges the sandbox's env in, as for
		// every command.
		Spec:     api.ExecRequest{Cmd: plan.cmd, Workdir: sb.Workdir, User: sb.User},
		Detached: true,
	}
	// Nobody holds this token; RefreshToken gives a client one to attach.
	_, rec.TokenHash = newToken()
	rec.TokenExpiry = time.Now().Add(AttachTokenTTL)
	if err := p.run("start_command", func() error {
		if err := m.cfg.DB.PutCommand(ctx, rec); err != nil {
			return err
		}
		err := m.cmds.decideCommand(ctx, sb, &rec)
		if err == nil {
			err = m.cmds.startCommand(ctx, c, sb, &rec, false)
		}
		if err != nil {
			m.cmds.commandEnded(&rec, api.ExitStatus{ExitCode: -1, Reason: "could not start: " + err.Error()})
			return fmt.Errorf("template start command %s: %w", quoteArgv(plan.cmd), err)
		}
		return nil
	}); err != nil {
		return err
	}
	if len(plan.ready) == 0 {
		return nil
	}
	return p.run("ready", func() error { return m.cmds.awaitReady(ctx, c, sb, &rec, plan) })
}

// awaitReady runs the ready check until it passes, the timeout passes, or
// the start command fails.
func (part *Commands) awaitReady(ctx context.Context, c *agentclient.Client, sb api.Sandbox, rec *store.CommandRecord, plan *startPlan) error {
	m := part.m
	w := watchStart(ctx, c, rec.ID)
	defer w.stop()
	deadline := time.Now().Add(plan.timeout)
	env := mergeEnv(sb.Env, nil)
	var (
		last api.ExecResult
		// finished is the last check that ran to its end: when the deadline
		// cuts the final try short, it is the one that says why it failed.
		finished    api.ExecResult
		hasFinished bool
		tries       int
	)
	fail := func(kind error, format string, a ...any) error {
		w.stop()
		exit, exited := w.exit()
		if !exited {
			// The instance goes down with this failure, and the process with it.
			exit = api.ExitStatus{ExitCode: 137, Signal: "KILL", Reason: "killed: the sandbox's ready check did not pass"}
		}
		m.cmds.commandEnded(rec, exit)
		msg := fmt.Sprintf(format, a...)
		if tries > 0 {
			shown, note := last, ""
			if last.TimedOut && hasFinished {
				shown, note = finished, " (the final try was cut short by the deadline)"
			}
			how := describeExit(api.ExitStatus{ExitCode: shown.ExitCode, Signal: shown.Signal})
			if shown.TimedOut {
				how += " (timed out)"
			}
			msg += fmt.Sprintf("; last ready check %s: %s, output: %s%s", quoteArgv(plan.ready), how, quoteTail(shown.Stdout+shown.Stderr), note)
		}
		msg += fmt.Sprintf("; start command %s output: %s", quoteArgv(plan.cmd), quoteTail(w.tail()))
		return fmt.Errorf("%s: %w", msg, kind)
	}
	for {
		// A start command that failed will not become ready: say so at once.
		// One that exited 0 may have started a daemon, so keep checking.
		exit, exited := w.exit()
		if exited && (exit.ExitCode != 0 || exit.Signal != "") {
			return fail(errdefs.ErrUnprocessable, "template start command exited with %s before its ready check passed", describeExit(exit))
		}
		var exitCh <-chan struct{}
		if !exited {
			exitCh = w.exited
		}
		left := time.Until(deadline)
		if left <= 0 {
			return fail(errdefs.ErrTimeout, "template ready check did not pass within %s (%d tries)", plan.timeout, tries)
		}
		// The agent ends the check at the deadline and reports it; the
		// context only guards against an agent that does not. A start
		// command that fails meanwhile cuts the check short.
		cctx, cancel := context.WithDeadline(ctx, deadline.Add(time.Second))
		if exitCh != nil {
			go func() {
				select {
				case <-exitCh:
					cancel()
				case <-cctx.Done():
				}
			}()
		}
		res, err := c.Exec(cctx, agentproto.ExecRequest{
			Cmd: plan.ready, Env: env, Workdir: sb.Workdir, User: sb.User,
			TimeoutSeconds: max(left.Seconds(), 0.001), MaxOutputBytes: readyOutputCap,
		})
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return fail(ctx.Err(), "waiting for the template ready check: %v", ctx.Err())
			}
			if _, now := w.exit(); (now && !exited) || time.Now().After(deadline) {
				continue // decided at the top of the loop
			}
			return fail(errdefs.ErrUnprocessable, "template ready check %s could not run: %v", quoteArgv(plan.ready), err)
		}
		tries++
		last = res
		if !res.TimedOut {
			finished, hasFinished = res, true
		}
		if res.ExitCode == 0 && res.Signal == "" && !res.TimedOut {
			return nil
		}
		t := time.NewTimer(min(plan.interval, max(time.Until(deadline), 0)))
		select {
		case <-ctx.Done():
			t.Stop()
			return fail(ctx.Err(), "waiting for the template ready check: %v", ctx.Err())
		case <-exitCh:
			t.Stop()
		case <-t.C:
		}
	}
}

// commandEnded records that a start command ended (or never started).
func (part *Commands) commandEnded(rec *store.CommandRecord, exit api.ExitStatus) {
	m := part.m
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rec.State = api.CommandExited
	rec.Exit = &exit
	if err := m.cfg.DB.PutCommand(ctx, *rec); err != nil {
		m.log.Warn("recording the start command's end", "sandbox", rec.SandboxID, "command", rec.ID, "err", err)
	}
	if rec.StartedAt != nil {
		m.aud.auditCommandExit(ctx, rec.SandboxID, "", rec.ID, exit)
	}
}

// startWatch follows a start command through an attach of its own: it keeps
// the last failureTailBytes of its output (stdout and stderr as they came)
// and its exit status. The attach replays from offset 0 and holds no state
// in the agent that other attaches could notice.
type startWatch struct {
	ctx    context.Context // the watch's own; cancelled by stop
	cancel context.CancelFunc
	done   chan struct{} // closed when the watch ended
	exited chan struct{} // closed when the exit status is known

	mu   sync.Mutex
	buf  []byte
	st   api.ExitStatus
	gone bool
}

func watchStart(ctx context.Context, c *agentclient.Client, id string) *startWatch {
	wctx, cancel := context.WithCancel(ctx)
	w := &startWatch{ctx: wctx, cancel: cancel, done: make(chan struct{}), exited: make(chan struct{})}
	go w.run(c, id)
	return w
}

func (w *startWatch) run(c *agentclient.Client, id string) {
	defer close(w.done)
	defer w.cancel()
	conn, err := c.Attach(w.ctx, id, 0, 0)
	if err != nil {
		w.fallback(c, id)
		return
	}
	defer conn.CloseNow()
	frames := agentclient.Frames(conn)
	for {
		f, _, err := frames.Next(w.ctx)
		if err != nil {
			if w.ctx.Err() == nil {
				w.fallback(c, id) // the stream broke or went bad, not us: ask once more
			}
			return
		}
		switch f.Type {
		case api.FrameStdout, api.FrameStderr:
			w.mu.Lock()
			w.buf = appendTail(w.buf, f.Data, failureTailBytes)
			w.mu.Unlock()
		case api.FrameExit:
			w.setExit(f.Exit)
			return
		}
	}
}

// fallback asks the agent directly whether the process has exited, for when
// the attach is unavailable.
func (w *startWatch) fallback(c *agentclient.Client, id string) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		qctx, cancel := context.WithTimeout(w.ctx, 2*time.Second)
		info, err := c.Proc(qctx, id)
		cancel()
		if err == nil && !info.Running && info.Exit != nil {
			w.setExit(*info.Exit)
			return
		}
		select {
		case <-w.ctx.Done():
			return
		case <-c.Done():
			return // the agent is gone; the ready check will say so
		case <-t.C:
		}
	}
}

// stop ends the watch and waits for it.
func (w *startWatch) stop() {
	w.cancel()
	<-w.done
}

func (w *startWatch) setExit(st api.ExitStatus) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.gone {
		w.st, w.gone = st, true
		close(w.exited)
	}
}

func (w *startWatch) exit() (api.ExitStatus, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.st, w.gone
}

func (w *startWatch) tail() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return string(w.buf)
}

// appendTail appends b to buf keeping at most n bytes, the newest.
func appendTail(buf, b []byte, n int) []byte {
	if len(b) >= n {
		return append(buf[:0], b[len(b)-n:]...)
	}
	if over := len(buf) + len(b) - n; over > 0 {
		buf = append(buf[:0], buf[over:]...)
	}
	return append(buf, b...)
}

// quoteTail makes up to failureTailBytes of the end of untrusted output safe
// to put in an error message: valid UTF-8, no control characters but
// newlines and tabs, quoted.
func quoteTail(s string) string {
	if len(s) > failureTailBytes {
		s = s[len(s)-failureTailBytes:]
		// Do not start in the middle of a UTF-8 sequence.
		for i := 0; i < utf8.UTFMax && len(s) > 0 && !utf8.RuneStart(s[0]); i++ {
			s = s[1:]
		}
	}
	s = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\t' || !unicode.IsControl(r) {
			return r
		}
		return -1
	}, strings.ToValidUTF8(s, "\uFFFD"))
	if strings.TrimSpace(s) == "" {
		return "(none)"
	}
	return fmt.Sprintf("%q", s)
}

func quoteArgv(argv []string) string {
	return truncate(fmt.Sprintf("%q", argv), 256)
}

func describeExit(st api.ExitStatus) string {
	if st.Signal != "" {
		return "signal " + st.Signal
	}
	return fmt.Sprintf("exit code %d", st.ExitCode)
}
