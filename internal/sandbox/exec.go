package sandbox

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/store"
)

type agentClient = agentclient.Client

// AttachTokenTTL is how long an attach token stays valid.
const AttachTokenTTL = 10 * time.Minute

// Agent returns the live agent client of a running sandbox (waking it if
// needed) and a release func the caller must call when its request ends; while
// held, the sandbox counts as active for its idle policy.
func (m *Manager) Agent(ctx context.Context, id string) (*agentclient.Client, func(), error) {
	c, _, release, err := m.agent(ctx, id)
	return c, release, err
}

// agent is Agent that also returns the sandbox record it found running, so
// callers that need its env or workdir do not read it again.
func (m *Manager) agent(ctx context.Context, id string) (*agentclient.Client, api.Sandbox, func(), error) {
	e, c, sb, err := m.verbs.ensureRunning(ctx, id)
	if err != nil {
		return nil, sb, nil, err
	}
	e.active.Add(1)
	return c, sb, func() {
		e.lastActive.Store(time.Now().UnixNano())
		e.active.Add(-1)
	}, nil
}

func mergeEnv(base, extra map[string]string) []string {
	all := map[string]string{}
	for k, v := range base {
		all[k] = v
	}
	for k, v := range extra {
		all[k] = v
	}
	out := make([]string, 0, len(all))
	for k, v := range all {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

func (m *Manager) oomKills(ctx context.Context, id string) int64 {
	e := m.peek(id)
	if e == nil {
		return -1
	}
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	if inst == nil {
		return -1
	}
	// The counter alone where the runtime can read it cheaply: this runs
	// around every exec, and a whole sample may start a process (gvisor)
	// or ask the guest (microvm).
	if oc, ok := inst.(runtime.OOMCounter); ok {
		n, err := oc.OOMKills()
		if err != nil {
			return -1
		}
		return n
	}
	st, err := inst.Stats(ctx)
	if err != nil {
		return -1
	}
	return st.OOMKills
}

func killedBySIGKILL(sig string, code int) bool {
	s := strings.TrimPrefix(strings.ToUpper(sig), "SIG")
	return s == "KILL" || s == "9" || (sig == "" && code == 137)
}

// Exec runs a command to completion (the synchronous exec endpoint).
func (part *Commands) Exec(ctx context.Context, id string, req api.ExecRequest) (api.ExecResult, error) {
	m := part.m
	if err := validateExec(&req); err != nil {
		return api.ExecResult{}, err
	}
	if req.TTY {
		return api.ExecResult{}, invalid("tty needs a command session (POST …/commands), not synchronous exec")
	}
	// Decided from the record, before the sandbox is woken: a refused
	// exec must not restore a suspended sandbox.
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.ExecResult{}, err
	}
	workdir, user := req.Workdir, req.User
	// A process chrooted into Root resolves paths and users in that tree:
	// the sandbox's own defaults name things of the sandbox's tree.
	if workdir == "" && req.Root == "" {
		workdir = sb.Workdir
	}
	if user == "" && req.Root == "" {
		user = sb.User
	}
	if err := m.decide(ctx, sb, actions.Action{Kind: actions.Exec, Argv: req.Cmd, User: user, Cwd: workdir}); err != nil {
		return api.ExecResult{}, err
	}
	c, sb, release, err := m.agent(ctx, id)
	if err != nil {
		return api.ExecResult{}, err
	}
	defer release()
	m.obs.Exec("sync")
	oomBefore := m.oomKills(ctx, id)
	m.aud.auditCommandStart(ctx, sb, "exec", "exec", req.Cmd, user, workdir, nil)
	res, err := c.Exec(ctx, agentproto.ExecRequest{
		Cmd: req.Cmd, Env: mergeEnv(sb.Env, req.Env), Workdir: workdir, User: user, Root: req.Root,
		Stdin: []byte(req.Stdin), TimeoutSeconds: req.TimeoutSeconds, MaxOutputBytes: req.MaxOutputBytes,
	})
	if err != nil {
		m.aud.auditCommandExit(ctx, id, sb.Tenant, "exec", api.ExitStatus{ExitCode: -1, Reason: "failed: " + err.Error()})
		return res, err
	}
	if killedBySIGKILL(res.Signal, res.ExitCode) && oomBefore >= 0 && m.oomKills(ctx, id) > oomBefore {
		res.OOMKilled = true
	}
	m.aud.auditExecExit(ctx, sb, res)
	return res, nil
}

func newToken() (token, hash string) {
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	token = "sat_" + hex.EncodeToString(b[:])
	return token, hashToken(token)
}

func hashToken(t string) string {
	h := sha256.Sum256([]byte(t))
	return hex.EncodeToString(h[:])
}

func attachURL(sandboxID, cmdID string) string {
	return "/v1/sandboxes/" + sandboxID + "/commands/" + cmdID + "/attach"
}

// CreateCommand records a command session. The process starts on first
// attach, or now when detached.
func (part *Commands) CreateCommand(ctx context.Context, id string, req api.CreateCommandRequest) (api.Command, error) {
	m := part.m
	if err := validateExec(&req.ExecRequest); err != nil {
		return api.Command{}, err
	}
	if req.Stdin != "" {
		return api.Command{}, invalid("stdin is sent as frames after attaching, not in the create request")
	}
	if req.Rows == 0 {
		req.Rows = 24
	}
	if req.Cols == 0 {
		req.Cols = 80
	}
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.Command{}, err
	}
	if req.Workdir == "" && req.Root == "" {
		req.Workdir = sb.Workdir
	}
	if req.User == "" && req.Root == "" {
		req.User = sb.User
	}
	token, hash := newToken()
	rec := store.CommandRecord{
		Command: api.Command{ID: newID("cmd"), SandboxID: id, Cmd: req.Cmd, TTY: req.TTY, State: api.CommandCreated, CreatedAt: time.Now().UTC()},
		Spec:    req.ExecRequest, TokenHash: hash, TokenExpiry: time.Now().Add(AttachTokenTTL), Detached: req.Detached,
	}
	if err := m.cfg.DB.PutCommand(ctx, rec); err != nil {
		return api.Command{}, err
	}
	if req.Detached {
		// Decided before the sandbox is woken.
		if err := m.cmds.decideCommand(ctx, sb, &rec); err != nil {
			return api.Command{}, err
		}
		c, sb, release, err := m.agent(ctx, id)
		if err != nil {
			return api.Command{}, err
		}
		err = m.cmds.startCommand(ctx, c, sb, &rec, false)
		release()
		if err != nil {
			return api.Command{}, err
		}
	}
	out := rec.Command
	out.AttachURL = attachURL(id, rec.ID)
	out.AttachToken = token
	return out, nil
}

// decideCommand asks the policy about the recorded process, if it has not
// started yet. Callers ask before they wake the sandbox to start it.
func (part *Commands) decideCommand(ctx context.Context, sb api.Sandbox, rec *store.CommandRecord) error {
	m := part.m
	if rec.State != api.CommandCreated {
		return nil
	}
	return m.decide(ctx, sb, actions.Action{Kind: actions.Exec, Argv: rec.Spec.Cmd, User: rec.Spec.User, Cwd: rec.Spec.Workdir})
}

// startCommand starts the recorded process through c, the agent of the
// running sandbox sb, if it has not started yet; the caller has had it
// decided (decideCommand). attaching says the caller attaches next: the
// agent then keeps the output from the first byte for it, so a fast
// producer cannot overwrite output before the attach exists.
func (part *Commands) startCommand(ctx context.Context, c *agentclient.Client, sb api.Sandbox, rec *store.CommandRecord, attaching bool) error {
	m := part.m
	if rec.State != api.CommandCreated {
		return nil
	}
	m.obs.Exec("session")
	info, err := c.StartProc(ctx, agentproto.ProcStart{
		ID: rec.ID, Cmd: rec.Spec.Cmd, Env: mergeEnv(sb.Env, rec.Spec.Env), Workdir: rec.Spec.Workdir,
		User: rec.Spec.User, Root: rec.Spec.Root, TTY: rec.Spec.TTY, Rows: rec.Spec.Rows, Cols: rec.Spec.Cols,
		HoldForAttach: attaching,
	})
	m.aud.auditCommandStart(ctx, sb, rec.ID, commandHow(rec), rec.Spec.Cmd, rec.Spec.User, rec.Spec.Workdir, err)
	if err != nil {
		return err
	}
	rec.State = api.CommandRunning
	rec.Pid = info.Pid
	now := time.Now().UTC()
	rec.StartedAt = &now
	return m.cfg.DB.PutCommand(ctx, *rec)
}

// GetCommand returns a command session, refreshing its state from the agent.
func (part *Commands) GetCommand(ctx context.Context, id, cmdID string) (api.Command, error) {
	m := part.m
	rec, err := m.cmds.command(ctx, id, cmdID)
	if err != nil {
		return api.Command{}, err
	}
	m.cmds.refreshCommand(ctx, &rec)
	return rec.Command, nil
}

// refreshCommand asks the agent (only when the sandbox is running; a status
// read must not wake a sandbox) how a running process is doing.
func (part *Commands) refreshCommand(ctx context.Context, rec *store.CommandRecord) {
	m := part.m
	if rec.State != api.CommandRunning {
		return
	}
	e := m.peek(rec.SandboxID)
	if e == nil {
		return
	}
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c == nil {
		return
	}
	info, err := c.Proc(ctx, rec.ID)
	if err != nil {
		return
	}
	if info.Running || info.Exit == nil {
		// The agent's word, used only as where a reader of "the output
		// so far" stops; never negative.
		rec.StdoutBytes, rec.StderrBytes = max(info.StdoutEnd, 0), max(info.StderrEnd, 0)
		return
	}
	rec.State = api.CommandExited
	rec.Exit = info.Exit
	m.cfg.DB.PutCommand(ctx, *rec)
	m.aud.auditCommandExit(ctx, rec.SandboxID, "", rec.ID, *info.Exit)
}

// ListCommands lists a sandbox's command sessions.
func (part *Commands) ListCommands(ctx context.Context, id string) ([]api.Command, error) {
	m := part.m
	if _, err := m.Get(ctx, id); err != nil {
		return nil, err
	}
	recs, err := m.cfg.DB.ListCommands(ctx, id)
	if err != nil {
		return nil, err
	}
	out := make([]api.Command, 0, len(recs))
	for i := range recs {
		m.cmds.refreshCommand(ctx, &recs[i])
		out = append(out, recs[i].Command)
	}
	return out, nil
}

// RefreshToken issues a new attach token for a command session.
func (part *Commands) RefreshToken(ctx context.Context, id, cmdID string) (api.Command, error) {
	m := part.m
	rec, err := m.cmds.command(ctx, id, cmdID)
	if err != nil {
		return api.Command{}, err
	}
	token, hash := newToken()
	rec.TokenHash, rec.TokenExpiry = hash, time.Now().Add(AttachTokenTTL)
	if err := m.cfg.DB.PutCommand(ctx, rec); err != nil {
		return api.Command{}, err
	}
	out := rec.Command
	out.AttachURL = attachURL(id, cmdID)
	out.AttachToken = token
	return out, nil
}

// SignalCommand sends a signal to a running command session.
func (part *Commands) SignalCommand(ctx context.Context, id, cmdID, sig string) error {
	m := part.m
	if sig == "" || len(sig) > 16 {
		return invalid("signal must be a name like TERM or a number")
	}
	rec, err := m.cmds.command(ctx, id, cmdID)
	if err != nil {
		return err
	}
	if rec.State != api.CommandRunning {
		return fmt.Errorf("command %s is %s; only a running command can be signalled: %w", cmdID, rec.State, errdefs.ErrConflict)
	}
	c, release, err := m.Agent(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	return c.Signal(ctx, cmdID, sig)
}

// AuthorizeAttach checks an attach token against a command session.
func (part *Commands) AuthorizeAttach(ctx context.Context, id, cmdID, token string) (store.CommandRecord, error) {
	m := part.m
	rec, err := m.cmds.command(ctx, id, cmdID)
	if err != nil {
		return rec, err
	}
	if token == "" || subtle.ConstantTimeCompare([]byte(hashToken(token)), []byte(rec.TokenHash)) != 1 {
		return rec, fmt.Errorf("attach token is not valid for this command: %w", errdefs.ErrUnauthorized)
	}
	if time.Now().After(rec.TokenExpiry) {
		return rec, fmt.Errorf("attach token expired; request a new one with POST …/token: %w", errdefs.ErrUnauthorized)
	}
	return rec, nil
}

// Attachment is a live attach to a process in a sandbox.
type Attachment struct {
	Conn    *websocket.Conn
	release func()
	m       *Manager
	rec     store.CommandRecord
	oom     int64
}

// Attach starts the process if needed and attaches to it in the agent.
func (part *Commands) Attach(ctx context.Context, rec store.CommandRecord, stdoutOff, stderrOff int64) (*Attachment, error) {
	m := part.m
	if stdoutOff < 0 || stderrOff < 0 {
		return nil, invalid("offsets must not be negative")
	}
	if rec.State == api.CommandCreated {
		// The process starts on this attach: decided before the wake.
		sb, err := m.Get(ctx, rec.SandboxID)
		if err != nil {
			return nil, err
		}
		if err := m.cmds.decideCommand(ctx, sb, &rec); err != nil {
			return nil, err
		}
	}
	c, sb, release, err := m.agent(ctx, rec.SandboxID)
	if err != nil {
		return nil, err
	}
	if err := m.cmds.startCommand(ctx, c, sb, &rec, true); err != nil {
		release()
		return nil, err
	}
	oom := m.oomKills(ctx, rec.SandboxID)
	conn, err := c.Attach(ctx, rec.ID, stdoutOff, stderrOff)
	if err != nil {
		release()
		return nil, err
	}
	return &Attachment{Conn: conn, release: release, m: m, rec: rec, oom: oom}, nil
}

// Exited records the process's exit (with the host's OOM verdict, which the
// agent cannot know) and returns the status to send to the client.
func (a *Attachment) Exited(ctx context.Context, st api.ExitStatus) api.ExitStatus {
	st.OOMKilled = false
	if killedBySIGKILL(st.Signal, st.ExitCode) && a.oom >= 0 && a.m.oomKills(ctx, a.rec.SandboxID) > a.oom {
		st.OOMKilled = true
		st.Reason = "killed by the kernel OOM killer: the sandbox hit its memory limit"
	}
	// One exit record however many attachments see the exit.
	if cur, err := a.m.cfg.DB.GetCommand(ctx, a.rec.SandboxID, a.rec.ID); err != nil || cur.State != api.CommandExited {
		a.m.aud.auditCommandExit(ctx, a.rec.SandboxID, "", a.rec.ID, st)
	}
	a.rec.State = api.CommandExited
	a.rec.Exit = &st
	a.m.cfg.DB.PutCommand(ctx, a.rec)
	return st
}

// Close ends the attachment (the process keeps running).
func (a *Attachment) Close() {
	a.Conn.CloseNow()
	a.release()
}

func (part *Commands) markCommandsExited(id, reason string) {
	m := part.m
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	recs, err := m.cfg.DB.ListCommands(ctx, id)
	if err != nil {
		return
	}
	for _, r := range recs {
		if r.State == api.CommandExited {
			continue
		}
		r.State = api.CommandExited
		r.Exit = &api.ExitStatus{ExitCode: 137, Signal: "KILL", Reason: reason}
		m.cfg.DB.PutCommand(ctx, r)
		if r.StartedAt != nil {
			m.aud.auditCommandExit(ctx, id, "", r.ID, *r.Exit)
		}
	}
}

// command loads a command session after checking both ids are well formed.
func (part *Commands) command(ctx context.Context, id, cmdID string) (store.CommandRecord, error) {
	m := part.m
	for _, x := range []string{id, cmdID} {
		if err := ValidID(x); err != nil {
			return store.CommandRecord{}, err
		}
	}
	return m.cfg.DB.GetCommand(ctx, id, cmdID)
}

// AttachCommand attaches to command cmdID of sandbox id from inside the
// server (no attach token: the caller has authorised the request already),
// starting it first if it has not started.
func (part *Commands) AttachCommand(ctx context.Context, id, cmdID string, stdoutOff, stderrOff int64) (*Attachment, error) {
	m := part.m
	rec, err := m.cmds.command(ctx, id, cmdID)
	if err != nil {
		return nil, err
	}
	return m.cmds.Attach(ctx, rec, stdoutOff, stderrOff)
}
