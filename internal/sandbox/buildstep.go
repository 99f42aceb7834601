package sandbox

// Build steps: a RUN instruction of a template build runs in an ordinary
// sandbox of its parent template, created, watched and deleted through the
// same operations as any other, so reconcile and sweep know it. It is
// labelled BuildLabel=BuildLabelStep. Its command's output streams to the
// build as it comes; on exit 0 the sandbox is stopped and its writable
// layer (runtime.ChangeExporter) handed to the build, which turns it into
// the step's template.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/build"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
)

var _ build.Runner = (*Builds)(nil)

// BuildLabel marks the sandboxes template builds run their steps in; its
// value is BuildLabelStep.
const (
	BuildLabel     = "space.build"
	BuildLabelStep = "step"
)

// BuildStepLimits are a build step sandbox's limits: roomier than a
// sandbox's defaults, because package installs and compilers need memory,
// processes and disk. The disk is sparse: only what the step writes costs.
var BuildStepLimits = api.Limits{CPUs: 2, MemoryMiB: 2048, Pids: 1024, DiskMiB: 8192}

// DefaultBuildPath is the PATH of a build step whose environment has none
// (Docker's default for RUN).
const DefaultBuildPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// buildCleanupTimeout bounds deleting a step's sandbox after the step.
const buildCleanupTimeout = 2 * time.Minute

// errNoChangeExport says a runtime's instances cannot hand over their
// filesystem changes; RunStep then tries the next runtime.
var errNoChangeExport = errors.New("the runtime cannot export a sandbox's filesystem changes")

// RunStep implements build.Runner. The sandbox is deleted afterwards
// whatever happens (also when ctx ends), with a fresh bounded context.
func (part *Builds) RunStep(ctx context.Context, s build.Step) (int, error) {
	m := part.m
	if s.Template == "" {
		return -1, invalid("build step has no template")
	}
	if err := validateExec(&api.ExecRequest{Cmd: s.Cmd, Env: s.Env, Workdir: s.Workdir}); err != nil {
		return -1, err
	}
	if err := validateUser("user", s.User); err != nil {
		return -1, err
	}
	if s.Apply == nil {
		return -1, invalid("build step has no Apply")
	}
	out := s.Output
	if out == nil {
		out = io.Discard
	}
	rts, err := m.builds.stepRuntimes(ctx)
	if err != nil {
		return -1, err
	}
	if s.Network && m.cfg.Network == nil {
		// Without a gateway no sandbox has a network: say so rather than
		// run the step without one.
		return -1, fmt.Errorf("a build step asks for network access, but this server has no network gateway: %w", errdefs.ErrNotSupported)
	}
	var tried []string
	for _, rt := range rts {
		code, err := m.builds.runStepOn(ctx, rt, s, out)
		if errors.Is(err, errNoChangeExport) {
			tried = append(tried, rt.Name())
			continue
		}
		return code, err
	}
	return -1, fmt.Errorf("no runtime on this host can capture a build step's changes (tried %v): %w", tried, errdefs.ErrNotSupported)
}

// stepRuntimes orders the available runtimes for a build step: auto's
// choice first, then the others by strength.
func (part *Builds) stepRuntimes(ctx context.Context) ([]runtime.Runtime, error) {
	m := part.m
	first, err := runtime.PickAuto(ctx, m.cfg.Runtimes)
	if err != nil {
		return nil, fmt.Errorf("build step: %w: %w", err, errdefs.ErrUnprocessable)
	}
	out := []runtime.Runtime{first}
	strength := map[string]int{}
	var rest []string
	for _, name := range slices.Sorted(maps.Keys(m.cfg.Runtimes)) {
		rt := m.cfg.Runtimes[name]
		if rt == first {
			continue
		}
		if c := rt.Probe(ctx); c.Available {
			strength[name] = c.Strength
			rest = append(rest, name)
		}
	}
	slices.SortStableFunc(rest, func(a, b string) int { return strength[b] - strength[a] })
	for _, name := range rest {
		out = append(out, m.cfg.Runtimes[name])
	}
	return out, nil
}

// runStepOn runs s in a new sandbox of runtime rt and deletes the sandbox.
func (part *Builds) runStepOn(ctx context.Context, rt runtime.Runtime, s build.Step, out io.Writer) (code int, err error) {
	m := part.m
	sb, op, err := m.creates.Create(ctx, api.CreateSandboxRequest{
		Template: s.Template, Runtime: rt.Name(), Limits: BuildStepLimits,
		Labels:  map[string]string{BuildLabel: BuildLabelStep},
		Network: stepPolicy(s),
	})
	if err != nil {
		return -1, fmt.Errorf("build step sandbox: %w", err)
	}
	defer func() {
		if derr := m.builds.deleteStepSandbox(sb.ID); derr != nil {
			m.log.Error("deleting a build step's sandbox", "sandbox", sb.ID, "err", derr)
			if err == nil {
				err = fmt.Errorf("build step: removing its sandbox %s: %w", sb.ID, derr)
			}
		}
	}()
	op, err = m.verbs.Wait(ctx, op.ID)
	if err != nil {
		return -1, fmt.Errorf("build step: creating its sandbox: %w", err)
	}
	if op.State != api.OpSucceeded {
		return -1, fmt.Errorf("build step: creating its sandbox on runtime %s: %w", rt.Name(), OpError(op))
	}
	e := m.entry(sb.ID)
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	exp, ok := inst.(runtime.ChangeExporter)
	if !ok {
		return -1, errNoChangeExport
	}

	code, err = m.builds.runStepCommand(ctx, sb.ID, s, out)
	if err != nil || code != 0 {
		return code, err
	}

	stop, err := m.verbs.systemLifecycle(ctx, sb.ID, api.OpStop, false)
	if err != nil {
		return -1, fmt.Errorf("build step: stopping its sandbox: %w", err)
	}
	if stop, err = m.verbs.Wait(ctx, stop.ID); err != nil {
		return -1, fmt.Errorf("build step: stopping its sandbox: %w", err)
	}
	if stop.State != api.OpSucceeded {
		return -1, fmt.Errorf("build step: stopping its sandbox: %w", OpError(stop))
	}
	// Hold the sandbox's lock so nothing starts it again (a stray wake)
	// while its disk is read.
	e.mu.Lock()
	defer e.mu.Unlock()
	ch, err := exp.Changes(ctx)
	if err != nil {
		return -1, fmt.Errorf("build step: reading its changes: %w", err)
	}
	defer func() {
		if rerr := ch.Release(); rerr != nil && err == nil {
			err = fmt.Errorf("build step: releasing its changes: %w", rerr)
		}
	}()
	if err := s.Apply(ctx, template.Upper{Dir: ch.Dir, OpaqueXattr: ch.OpaqueXattr, IDBase: ch.IDBase}); err != nil {
		return -1, err
	}
	return 0, nil
}

// OpError is the error of a finished, failed operation, with the sentinel
// its code names (ErrUnavailable when none).
func OpError(op api.Operation) error {
	if op.Error == nil {
		return fmt.Errorf("operation %s ended %s: %w", op.ID, op.State, errdefs.ErrUnavailable)
	}
	sentinel := errdefs.FromCode(op.Error.Code)
	if sentinel == nil {
		sentinel = errdefs.ErrUnavailable
	}
	return fmt.Errorf("%s: %w", op.Error.Message, sentinel)
}

// runStepCommand starts s.Cmd in the running sandbox id, copies its output
// to out as it comes, and returns its exit code.
func (part *Builds) runStepCommand(ctx context.Context, id string, s build.Step, out io.Writer) (int, error) {
	m := part.m
	c, sb, release, err := m.agent(ctx, id)
	if err != nil {
		return -1, fmt.Errorf("build step: %w", err)
	}
	defer release()
	env := map[string]string{}
	maps.Copy(env, sb.Env)
	maps.Copy(env, s.Env)
	if _, ok := env["PATH"]; !ok {
		env["PATH"] = DefaultBuildPath
	}
	workdir, user := s.Workdir, s.User
	if workdir == "" {
		workdir = sb.Workdir
	}
	if user == "" {
		user = sb.User
	}
	procID := newID("cmd")
	oomBefore := m.oomKills(ctx, id)
	if _, err := c.StartProc(ctx, agentproto.ProcStart{ID: procID, Cmd: s.Cmd, Env: mergeEnv(nil, env), Workdir: workdir, User: user, HoldForAttach: true}); err != nil {
		return -1, fmt.Errorf("build step: starting %q: %w", s.Cmd[0], err)
	}
	conn, err := c.Attach(ctx, procID, 0, 0)
	if err != nil {
		return -1, fmt.Errorf("build step: attaching to its command: %w", err)
	}
	defer conn.CloseNow()
	st, err := copyStepOutput(ctx, conn, out)
	if err != nil {
		return -1, err
	}
	if killedBySIGKILL(st.Signal, st.ExitCode) && oomBefore >= 0 && m.oomKills(ctx, id) > oomBefore {
		fmt.Fprintf(out, "\n[space] the step was killed by the kernel OOM killer: it hit the build sandbox's %d MiB memory limit\n", BuildStepLimits.MemoryMiB)
	}
	return st.ExitCode, nil
}

// copyStepOutput reads attach frames from the agent (untrusted: every
// frame is checked, replayed output is written once) until the exit
// frame, writing stdout and stderr to out in the order they come.
func copyStepOutput(ctx context.Context, conn *websocket.Conn, out io.Writer) (api.ExitStatus, error) {
	frames := agentclient.Frames(conn, agentclient.TrimOverlap())
	for {
		f, _, err := frames.Next(ctx)
		if err != nil {
			return api.ExitStatus{}, fmt.Errorf("build step: %w", err)
		}
		switch f.Type {
		case api.FrameStdout, api.FrameStderr:
			if _, err := out.Write(f.Data); err != nil {
				return api.ExitStatus{}, fmt.Errorf("build step: writing its output: %w", err)
			}
		case api.FrameDropped:
			if d := f.Dropped; d.To > d.From {
				fmt.Fprintf(out, "\n[space] %d bytes of %s output were lost (the reader fell behind)\n", d.To-d.From, d.Stream)
			}
		case api.FrameExit:
			return f.Exit, nil
		}
	}
}

// deleteStepSandbox force-deletes a step's sandbox and waits for it, with
// its own context: the step's may be cancelled already.
func (part *Builds) deleteStepSandbox(id string) error {
	m := part.m
	ctx, cancel := context.WithTimeout(context.Background(), buildCleanupTimeout)
	defer cancel()
	op, err := m.verbs.systemLifecycle(ctx, id, api.OpDelete, true)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	op, err = m.verbs.Wait(ctx, op.ID)
	if err != nil {
		return err
	}
	if op.State != api.OpSucceeded {
		return OpError(op)
	}
	return nil
}

// DeleteBuildSandboxes force-deletes every build step sandbox: the
// leftovers of builds a crash or restart interrupted. The server calls it
// after Reconcile, before it accepts builds (it would also kill the
// sandboxes of builds running in this process).
func (part *Builds) DeleteBuildSandboxes(ctx context.Context) (int, error) {
	m := part.m
	sbs, err := m.cfg.DB.ListSandboxes(ctx, store.SandboxFilter{Labels: map[string]string{BuildLabel: BuildLabelStep}})
	if err != nil {
		return 0, err
	}
	var errs []error
	n := 0
	for _, sb := range sbs {
		if err := m.builds.deleteStepSandbox(sb.ID); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", sb.ID, err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// stepPolicy is a build step's egress: none without network, whatever the
// server's default; with network, the build's policy, else every public
// destination.
func stepPolicy(s build.Step) *api.NetworkPolicy {
	switch {
	case !s.Network:
		return &api.NetworkPolicy{}
	case s.Policy != nil:
		p := ClonePolicy(*s.Policy)
		return &p
	default:
		return &api.NetworkPolicy{Internet: true}
	}
}
