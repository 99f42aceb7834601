package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

// The envd process service (process.Process) on space command sessions: a
// process is a command session started at once, its pid the one the agent
// reports, its output the session's replay buffer — so Connect after a
// dropped stream, or from another client, gets what it missed.

// Messages of process.proto, in protobuf's JSON mapping.
type (
	processConfig struct {
		Cmd  string            `json:"cmd"`
		Args []string          `json:"args,omitempty"`
		Envs map[string]string `json:"envs,omitempty"`
		Cwd  *string           `json:"cwd,omitempty"`
	}
	ptySize struct {
		Cols uint32 `json:"cols"`
		Rows uint32 `json:"rows"`
	}
	pty struct {
		Size *ptySize `json:"size,omitempty"`
	}
	processSelector struct {
		Pid *uint32 `json:"pid,omitempty"`
		Tag *string `json:"tag,omitempty"`
	}
	startRequest struct {
		Process *processConfig `json:"process"`
		Pty     *pty           `json:"pty,omitempty"`
		Tag     *string        `json:"tag,omitempty"`
		Stdin   *bool          `json:"stdin,omitempty"`
	}
	connectRequest struct {
		Process *processSelector `json:"process"`
	}
	processEvent struct {
		Start     *startEvent `json:"start,omitempty"`
		Data      *dataEvent  `json:"data,omitempty"`
		End       *endEvent   `json:"end,omitempty"`
		Keepalive *struct{}   `json:"keepalive,omitempty"`
	}
	startEvent struct {
		Pid uint32 `json:"pid"`
	}
	dataEvent struct {
		Stdout []byte `json:"stdout,omitempty"`
		Stderr []byte `json:"stderr,omitempty"`
		Pty    []byte `json:"pty,omitempty"`
	}
	endEvent struct {
		ExitCode int32   `json:"exitCode"`
		Exited   bool    `json:"exited"`
		Status   string  `json:"status"`
		Error    *string `json:"error,omitempty"`
	}
	// startResponse and connectResponse share the shape.
	eventResponse struct {
		Event processEvent `json:"event"`
	}
	processInfo struct {
		Config processConfig `json:"config"`
		Pid    uint32        `json:"pid"`
		Tag    *string       `json:"tag,omitempty"`
	}
	listResponse struct {
		Processes []processInfo `json:"processes"`
	}
	processInput struct {
		Stdin []byte `json:"stdin,omitempty"`
		Pty   []byte `json:"pty,omitempty"`
	}
	sendInputRequest struct {
		Process *processSelector `json:"process"`
		Input   *processInput    `json:"input"`
	}
	sendSignalRequest struct {
		Process *processSelector `json:"process"`
		Signal  json.RawMessage  `json:"signal"`
	}
	updateRequest struct {
		Process *processSelector `json:"process"`
		Pty     *pty             `json:"pty,omitempty"`
	}
	closeStdinRequest struct {
		Process *processSelector `json:"process"`
	}
	empty struct{}
)

func keepalive() any { return eventResponse{Event: processEvent{Keepalive: &struct{}{}}} }

func (h *Handler) envdRoutes() {
	a := func(f http.HandlerFunc) http.HandlerFunc { return h.authEnvd(false, f) }
	p := EnvdPrefix + "/process.Process/"
	h.route("POST "+p+"Start", a(serverStream(keepalive, h.proc.start)))
	h.route("POST "+p+"Connect", a(serverStream(keepalive, h.proc.connect)))
	h.route("POST "+p+"List", a(unary(h.proc.list)))
	h.route("POST "+p+"SendInput", a(unary(h.proc.sendInput)))
	h.route("POST "+p+"SendSignal", a(unary(h.proc.sendSignal)))
	h.route("POST "+p+"Update", a(unary(h.proc.update)))
	h.route("POST "+p+"CloseStdin", a(unary(h.proc.closeStdin)))
	h.route("POST "+p+"StreamInput", a(func(w http.ResponseWriter, r *http.Request) {
		writeUnaryError(w, r.Context(), rpcErrorf(codeUnimplemented, "StreamInput (client streaming) is not served: use SendInput"))
	}))
	(filesystemAPI{h}).filesystemRoutes()
	h.route("GET "+EnvdPrefix+"/health", func(w http.ResponseWriter, r *http.Request) {
		// E2B's SDK probes this to tell a dead sandbox (502) from a
		// dropped connection.
		id := r.Header.Get("E2b-Sandbox-Id")
		if id != "" {
			if sb, err := h.cfg.Manager.Get(r.Context(), id); err != nil || sb.State == api.StateDeleting || sb.State == api.StateError {
				w.WriteHeader(http.StatusBadGateway)
				return
			}
		}
		w.WriteHeader(http.StatusNoContent)
	})
	h.route(EnvdPrefix+"/", func(w http.ResponseWriter, r *http.Request) {
		writeUnaryError(w, r.Context(), rpcErrorf(codeUnimplemented, "%s %s is not an envd call this server implements", r.Method, r.URL.Path))
	})
}

// processes holds the per-process state the store does not: tags, and
// the input attachment of processes that were sent stdin, signals or
// resizes (one per process, reused, closed when the process ends or the
// layer closes).
type processes struct {
	h      *Handler
	mu     sync.Mutex
	tags   map[string]string // sandbox/cmd → tag
	inputs map[string]*inputConn
	closed bool
}

type inputConn struct {
	mu  sync.Mutex
	att *sandbox.Attachment
	ctx context.Context
}

func newProcesses(h *Handler) *processes {
	return &processes{h: h, tags: map[string]string{}, inputs: map[string]*inputConn{}}
}

func (p *processes) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for k, in := range p.inputs {
		in.att.Close()
		delete(p.inputs, k)
	}
}

// defaultUser is the user of an envd call that names none: the sandbox's
// own default, else E2B's "user".
func defaultUser(sb api.Sandbox, user string) string {
	if user != "" {
		return user
	}
	if sb.User != "" {
		return sb.User
	}
	return "user"
}

func home(user string) string {
	if user == "root" || user == "0" {
		return "/root"
	}
	return path.Join("/home", user)
}

func (p *processes) start(ctx context.Context, r *http.Request, in *startRequest, s *stream) error {
	c := caller(ctx)
	if in.Process == nil || in.Process.Cmd == "" {
		return rpcErrorf(codeInvalidArgument, "process.cmd is required")
	}
	user := defaultUser(c.sb, c.user)
	env := map[string]string{}
	for k, v := range in.Process.Envs {
		env[k] = v
	}
	if _, ok := env["HOME"]; !ok {
		if _, ok := c.sb.Env["HOME"]; !ok {
			env["HOME"] = home(user)
		}
	}
	if _, ok := env["USER"]; !ok {
		env["USER"] = user
	}
	cwd := c.sb.Workdir
	if in.Process.Cwd != nil && *in.Process.Cwd != "" {
		cwd = *in.Process.Cwd
	}
	if cwd == "" {
		cwd = home(user)
	}
	req := api.CreateCommandRequest{Detached: true, ExecRequest: api.ExecRequest{
		Cmd: append([]string{in.Process.Cmd}, in.Process.Args...), Env: env, Workdir: cwd, User: user,
	}}
	if in.Pty != nil {
		req.TTY = true
		if in.Pty.Size != nil {
			req.Rows, req.Cols = clampSize(in.Pty.Size.Rows), clampSize(in.Pty.Size.Cols)
		}
	}
	cmd, err := p.h.cfg.Manager.Commands().CreateCommand(ctx, c.sb.ID, req)
	if err != nil {
		return err
	}
	if in.Tag != nil {
		p.mu.Lock()
		p.tags[c.sb.ID+"/"+cmd.ID] = *in.Tag
		p.mu.Unlock()
	}
	stdin := in.Pty != nil || (in.Stdin != nil && *in.Stdin)
	return p.follow(ctx, c.sb.ID, cmd.ID, cmd.TTY, !stdin, s)
}

func clampSize(v uint32) uint16 {
	if v == 0 {
		return 0
	}
	if v > 1000 {
		return 1000
	}
	return uint16(v)
}

func (p *processes) connect(ctx context.Context, r *http.Request, in *connectRequest, s *stream) error {
	c := caller(ctx)
	cmd, err := p.find(ctx, c.sb.ID, in.Process)
	if err != nil {
		return err
	}
	return p.follow(ctx, c.sb.ID, cmd.ID, cmd.TTY, false, s)
}

// follow streams command cmdID's events from the start of its replay
// buffer: start, data (as pty output when tty), end. It returns when the process ends, the client
// goes away (the process keeps running) or the call's deadline passes.
func (p *processes) follow(ctx context.Context, id, cmdID string, tty, closeStdin bool, s *stream) error {
	att, err := p.h.cfg.Manager.Commands().AttachCommand(ctx, id, cmdID, 0, 0)
	if err != nil {
		return err
	}
	defer att.Close()
	conn := att.Conn
	frames := agentclient.Frames(conn)
	if closeStdin {
		if err := conn.Write(ctx, websocket.MessageBinary, []byte{api.FrameCloseStdin}); err != nil {
			return fmt.Errorf("closing stdin: %w: %w", err, errdefs.ErrUnavailable)
		}
	}
	// The reader holds the agent to the stream's order: started first,
	// once; exit last.
	for {
		f, _, err := frames.Next(ctx)
		if err != nil {
			return err
		}
		var ev processEvent
		switch f.Type {
		case api.FrameStarted:
			ev.Start = &startEvent{Pid: uint32(f.Started.Pid)}
		case api.FrameStdout, api.FrameStderr:
			data := append([]byte(nil), f.Data...)
			switch {
			case tty:
				ev.Data = &dataEvent{Pty: data}
			case f.Type == api.FrameStdout:
				ev.Data = &dataEvent{Stdout: data}
			default:
				ev.Data = &dataEvent{Stderr: data}
			}
		case api.FrameDropped:
			// Output the replay buffer no longer holds: E2B has no event
			// for it; the stream goes on with what is there.
			continue
		case api.FrameExit:
			st := att.Exited(context.WithoutCancel(ctx), f.Exit)
			end := &endEvent{ExitCode: int32(st.ExitCode), Exited: st.Signal == "", Status: exitStatus(st)}
			if st.Reason != "" {
				reason := st.Reason
				end.Error = &reason
			}
			s.send(eventResponse{Event: processEvent{End: end}})
			p.forget(id, cmdID)
			return nil
		}
		if err := s.send(eventResponse{Event: ev}); err != nil {
			// The client went away; the process goes on.
			return nil
		}
	}
}

// exitStatus is envd's status text: "exit status N" or "signal: NAME".
func exitStatus(st api.ExitStatus) string {
	if st.Signal != "" {
		return "signal: " + st.Signal
	}
	return fmt.Sprintf("exit status %d", st.ExitCode)
}

// find resolves a process selector to a command session: by pid (the
// running one with that pid, else the newest that had it), or by tag.
func (p *processes) find(ctx context.Context, id string, sel *processSelector) (api.Command, error) {
	if sel == nil || (sel.Pid == nil && sel.Tag == nil) {
		return api.Command{}, rpcErrorf(codeInvalidArgument, "process selector (pid or tag) is required")
	}
	cmds, err := p.h.cfg.Manager.Commands().ListCommands(ctx, id)
	if err != nil {
		return api.Command{}, err
	}
	var best *api.Command
	for i := range cmds {
		c := &cmds[i]
		switch {
		case sel.Pid != nil:
			if c.Pid == 0 || uint32(c.Pid) != *sel.Pid {
				continue
			}
		default:
			p.mu.Lock()
			tag, ok := p.tags[id+"/"+c.ID]
			p.mu.Unlock()
			if !ok || tag != *sel.Tag {
				continue
			}
		}
		if best == nil || (c.State == api.CommandRunning && best.State != api.CommandRunning) ||
			(c.State == best.State && c.CreatedAt.After(best.CreatedAt)) {
			best = c
		}
	}
	if best == nil {
		if sel.Pid != nil {
			return api.Command{}, rpcErrorf(codeNotFound, "process with pid %d not found", *sel.Pid)
		}
		return api.Command{}, rpcErrorf(codeNotFound, "process with tag %q not found", truncate(*sel.Tag, 64))
	}
	return *best, nil
}

// findRunning is find for calls that act on a live process.
func (p *processes) findRunning(ctx context.Context, id string, sel *processSelector) (api.Command, error) {
	cmd, err := p.find(ctx, id, sel)
	if err != nil {
		return cmd, err
	}
	if cmd.State != api.CommandRunning {
		return cmd, rpcErrorf(codeNotFound, "process %d is not running", cmd.Pid)
	}
	return cmd, nil
}

func (p *processes) list(ctx context.Context, r *http.Request, in *empty) (*listResponse, error) {
	c := caller(ctx)
	cmds, err := p.h.cfg.Manager.Commands().ListCommands(ctx, c.sb.ID)
	if err != nil {
		return nil, err
	}
	out := &listResponse{Processes: []processInfo{}}
	for _, cmd := range cmds {
		if cmd.State != api.CommandRunning || len(cmd.Cmd) == 0 {
			continue
		}
		pi := processInfo{Config: processConfig{Cmd: cmd.Cmd[0], Args: cmd.Cmd[1:], Envs: map[string]string{}}, Pid: uint32(cmd.Pid)}
		p.mu.Lock()
		if tag, ok := p.tags[c.sb.ID+"/"+cmd.ID]; ok {
			pi.Tag = &tag
		}
		p.mu.Unlock()
		out.Processes = append(out.Processes, pi)
	}
	return out, nil
}

// input sends one attach frame to a running process through its input
// attachment, opening it on first use.
func (p *processes) input(ctx context.Context, id string, sel *processSelector, frame []byte) error {
	cmd, err := p.findRunning(ctx, id, sel)
	if err != nil {
		return err
	}
	key := id + "/" + cmd.ID
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fmt.Errorf("shutting down: %w", errdefs.ErrUnavailable)
	}
	in := p.inputs[key]
	if in == nil {
		in = &inputConn{}
		p.inputs[key] = in
	}
	p.mu.Unlock()
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.att == nil {
		// The attachment outlives this call: it is closed when the process
		// ends (its reader sees the exit) or the layer closes.
		actx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		att, err := p.h.cfg.Manager.Commands().AttachCommand(actx, id, cmd.ID, 1<<62, 1<<62)
		if err != nil {
			cancel()
			p.mu.Lock()
			delete(p.inputs, key)
			p.mu.Unlock()
			return err
		}
		att.Conn.SetReadLimit(api.MaxFrame)
		in.att, in.ctx = att, actx
		go p.drain(key, in, cancel)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := in.att.Conn.Write(wctx, websocket.MessageBinary, frame); err != nil {
		return fmt.Errorf("sending to process %d: %w: %w", cmd.Pid, err, errdefs.ErrUnavailable)
	}
	return nil
}

// drain reads and discards an input attachment's output until the process
// ends or the attachment breaks, then forgets it.
func (p *processes) drain(key string, in *inputConn, cancel context.CancelFunc) {
	defer cancel()
	for {
		_, b, err := in.att.Conn.Read(in.ctx)
		if err != nil || (len(b) > 0 && b[0] == api.FrameExit) {
			break
		}
	}
	p.mu.Lock()
	if p.inputs[key] == in {
		delete(p.inputs, key)
	}
	p.mu.Unlock()
	in.mu.Lock()
	in.att.Close()
	in.mu.Unlock()
}

// forget drops the state of an ended process.
func (p *processes) forget(id, cmdID string) {
	key := id + "/" + cmdID
	p.mu.Lock()
	delete(p.tags, key)
	p.mu.Unlock()
}

func (p *processes) sendInput(ctx context.Context, r *http.Request, in *sendInputRequest) (*empty, error) {
	if in.Input == nil || (in.Input.Stdin == nil && in.Input.Pty == nil) {
		return nil, rpcErrorf(codeInvalidArgument, "input.stdin or input.pty is required")
	}
	data := in.Input.Stdin
	if data == nil {
		data = in.Input.Pty
	}
	id := caller(ctx).sb.ID
	for len(data) > 0 {
		n := min(len(data), api.MaxFrame-1)
		if err := p.input(ctx, id, in.Process, append([]byte{api.FrameStdin}, data[:n]...)); err != nil {
			return nil, err
		}
		data = data[n:]
	}
	return &empty{}, nil
}

func (p *processes) closeStdin(ctx context.Context, r *http.Request, in *closeStdinRequest) (*empty, error) {
	if err := p.input(ctx, caller(ctx).sb.ID, in.Process, []byte{api.FrameCloseStdin}); err != nil {
		return nil, err
	}
	return &empty{}, nil
}

func (p *processes) sendSignal(ctx context.Context, r *http.Request, in *sendSignalRequest) (*empty, error) {
	var sig string
	switch string(in.Signal) {
	case `"SIGNAL_SIGKILL"`, "9":
		sig = "KILL"
	case `"SIGNAL_SIGTERM"`, "15":
		sig = "TERM"
	default:
		return nil, rpcErrorf(codeInvalidArgument, "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, got %s", truncate(string(in.Signal), 32))
	}
	id := caller(ctx).sb.ID
	cmd, err := p.findRunning(ctx, id, in.Process)
	if err != nil {
		return nil, err
	}
	if err := p.h.cfg.Manager.Commands().SignalCommand(ctx, id, cmd.ID, sig); err != nil {
		if errors.Is(err, errdefs.ErrConflict) {
			return nil, rpcErrorf(codeNotFound, "process %d is not running", cmd.Pid)
		}
		return nil, err
	}
	return &empty{}, nil
}

func (p *processes) update(ctx context.Context, r *http.Request, in *updateRequest) (*empty, error) {
	if in.Pty == nil || in.Pty.Size == nil {
		return &empty{}, nil
	}
	b, _ := json.Marshal(api.Resize{Rows: clampSize(in.Pty.Size.Rows), Cols: clampSize(in.Pty.Size.Cols)})
	if err := p.input(ctx, caller(ctx).sb.ID, in.Process, append([]byte{api.FrameResize}, b...)); err != nil {
		return nil, err
	}
	return &empty{}, nil
}
