package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

func (s *Server) info(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, 200, s.mgr.Info(r.Context()))
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) {
	var req api.CreateSandboxRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	wait, err := waitParam(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	sb, op, err := s.mgr.Creates().Create(withIdempotencyKey(r.Context(), r.Header.Get(api.IdempotencyKeyHeader)), req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	// ?wait= saves a caller that wants a running sandbox the long-poll of
	// the operation and the read of the sandbox after it: two round trips
	// on the path of every create.
	if wait > 0 {
		if done, err := s.mgr.GetOperation(r.Context(), op.ID, wait); err == nil && done.Done() {
			if now, err := s.mgr.Get(r.Context(), sb.ID); err == nil {
				writeJSON(w, http.StatusOK, api.CreateSandboxResponse{Sandbox: now, Operation: done})
				return
			}
		}
	}
	writeJSON(w, http.StatusAccepted, api.CreateSandboxResponse{Sandbox: sb, Operation: op})
}

// waitParam is the ?wait= long-poll of a request: a Go duration (or
// seconds), at most 60s; 0 when absent.
func waitParam(r *http.Request) (time.Duration, error) {
	ws := r.URL.Query().Get("wait")
	if ws == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(ws)
	if err != nil {
		if secs, err2 := strconv.ParseFloat(ws, 64); err2 == nil {
			d, err = time.Duration(secs*float64(time.Second)), nil
		}
	}
	if err != nil || d < 0 || d > 60*time.Second {
		return 0, fmt.Errorf("wait must be a duration between 0 and 60s, got %q: %w", ws, errdefs.ErrInvalidArgument)
	}
	return d, nil
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	labels, err := labelFilter(q)
	if err != nil {
		writeError(w, r, err)
		return
	}
	sbs, err := s.mgr.List(r.Context(), q.Get("state"), labels)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if sbs == nil {
		sbs = []api.Sandbox{}
	}
	writeJSON(w, 200, api.SandboxList{Sandboxes: sbs})
}

// labelFilter is a list's label=key=value filters (all must match).
func labelFilter(q url.Values) (map[string]string, error) {
	labels := map[string]string{}
	for _, l := range q["label"] {
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("label filter %q must be key=value: %w", truncateQuery(l), errdefs.ErrInvalidArgument)
		}
		labels[k] = v
	}
	return labels, nil
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	sb, err := s.mgr.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, sb)
}

func parseBool(q, name string) (bool, error) {
	if q == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(q)
	if err != nil {
		return false, fmt.Errorf("%s must be true or false, got %q: %w", name, q, errdefs.ErrInvalidArgument)
	}
	return b, nil
}

func (s *Server) deleteSandbox(w http.ResponseWriter, r *http.Request) {
	force, err := parseBool(r.URL.Query().Get("force"), "force")
	if err != nil {
		writeError(w, r, err)
		return
	}
	op, err := s.mgr.Verbs().Lifecycle(r.Context(), r.PathValue("id"), api.OpDelete, force)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusAccepted, op)
}

// lifecycle answers POST /v1/sandboxes/{id}/{verb} for one of the verbs
// without a request body.
func (s *Server) lifecycle(verb string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		// These take no body; tolerate an empty JSON object.
		if r.ContentLength > 0 {
			var empty struct{}
			if err := decodeJSON(w, r, &empty); err != nil {
				writeError(w, r, err)
				return
			}
		}
		op, err := s.mgr.Verbs().Lifecycle(r.Context(), r.PathValue("id"), verb, false)
		if err != nil {
			writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusAccepted, op)
	}
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	var req api.ForkRequest
	if r.ContentLength != 0 {
		if err := decodeJSON(w, r, &req); err != nil {
			writeError(w, r, err)
			return
		}
	}
	// The manager validates the count (1..api.MaxForkCount, 0 = 1) and
	// asks the policy.
	op, err := s.mgr.Verbs().Fork(r.Context(), r.PathValue("id"), req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusAccepted, op)
}

// unknownVerb answers a POST to a sandbox sub-path that is no verb.
func (s *Server) unknownVerb(w http.ResponseWriter, r *http.Request) {
	writeError(w, r, fmt.Errorf("unknown lifecycle verb %q (%s): %w", r.PathValue("verb"), strings.Join(lifecycleVerbs, ", "), errdefs.ErrNotFound))
}

func (s *Server) getOperation(w http.ResponseWriter, r *http.Request) {
	wait, err := waitParam(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	id := r.PathValue("id")
	// Another tenant's operation is not found. The check comes first, so
	// a wait never tells anything about it either; an operation whose
	// sandbox is gone (a finished delete) is shown to whoever has its id.
	if op, err := s.mgr.GetOperation(r.Context(), id, 0); err == nil {
		if _, err := s.mgr.Tenancy().Visible(r.Context(), op.SandboxID); err != nil {
			if _, gerr := s.mgr.Get(r.Context(), op.SandboxID); gerr == nil {
				writeError(w, r, fmt.Errorf("operation %s not found: %w", id, errdefs.ErrNotFound))
				return
			}
		}
	}
	op, err := s.mgr.GetOperation(r.Context(), id, wait)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, op)
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	var req api.ExecRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	res, err := s.mgr.Commands().Exec(r.Context(), r.PathValue("id"), req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, res)
}

func (s *Server) createCommand(w http.ResponseWriter, r *http.Request) {
	var req api.CreateCommandRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	cmd, err := s.mgr.Commands().CreateCommand(r.Context(), r.PathValue("id"), req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, cmd)
}

func (s *Server) listCommands(w http.ResponseWriter, r *http.Request) {
	cmds, err := s.mgr.Commands().ListCommands(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, api.CommandList{Commands: cmds})
}

func (s *Server) getCommand(w http.ResponseWriter, r *http.Request) {
	cmd, err := s.mgr.Commands().GetCommand(r.Context(), r.PathValue("id"), r.PathValue("cid"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, cmd)
}

func (s *Server) signalCommand(w http.ResponseWriter, r *http.Request) {
	var req api.SignalRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if err := s.mgr.Commands().SignalCommand(r.Context(), r.PathValue("id"), r.PathValue("cid"), req.Signal); err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) refreshToken(w http.ResponseWriter, r *http.Request) {
	cmd, err := s.mgr.Commands().RefreshToken(r.Context(), r.PathValue("id"), r.PathValue("cid"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, cmd)
}

func parseOffset(q, name string) (int64, error) {
	if q == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(q, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s must be a non-negative integer, got %q: %w", name, q, errdefs.ErrInvalidArgument)
	}
	return n, nil
}

// attach proxies a client WebSocket to the agent's, validating every frame in
// both directions: the client may be buggy, the agent may be hostile.
func (s *Server) attach(w http.ResponseWriter, r *http.Request) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		tok = r.URL.Query().Get("token")
	}
	rec, err := s.mgr.Commands().AuthorizeAttach(r.Context(), r.PathValue("id"), r.PathValue("cid"), tok)
	if err != nil {
		writeError(w, r, err)
		return
	}
	so, err := parseOffset(r.URL.Query().Get("stdout_offset"), "stdout_offset")
	if err != nil {
		writeError(w, r, err)
		return
	}
	se, err := parseOffset(r.URL.Query().Get("stderr_offset"), "stderr_offset")
	if err != nil {
		writeError(w, r, err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	att, err := s.mgr.Commands().Attach(ctx, rec, so, se)
	if err != nil {
		writeError(w, r, err)
		return
	}
	defer att.Close()
	client, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true})
	if err != nil {
		return
	}
	defer client.CloseNow()
	client.SetReadLimit(api.MaxFrame)
	agent := att.Conn
	frames := agentclient.Frames(agent)

	// client → agent
	go func() {
		defer cancel()
		for {
			typ, b, err := client.Read(ctx)
			if err != nil {
				return
			}
			if typ != websocket.MessageBinary || len(b) == 0 {
				client.Close(websocket.StatusUnsupportedData, "frames must be binary and non-empty")
				return
			}
			switch b[0] {
			case api.FrameStdin, api.FrameCloseStdin, api.FrameResize, api.FrameSignal:
			default:
				client.Close(websocket.StatusPolicyViolation, fmt.Sprintf("frame type %d is not allowed from a client", b[0]))
				return
			}
			if err := agent.Write(ctx, websocket.MessageBinary, b); err != nil {
				return
			}
		}
	}()
	// agent → client
	for {
		f, b, err := frames.Next(ctx)
		switch {
		case errors.Is(err, agentclient.ErrBadFrame):
			client.Close(websocket.StatusInternalError, "the agent sent a malformed frame")
			return
		case err != nil:
			if ctx.Err() == nil {
				client.Close(websocket.StatusGoingAway, "the sandbox's agent went away")
			}
			return
		case f.Type == api.FrameExit:
			client.Write(ctx, websocket.MessageBinary, exitFrame(ctx, att, f.Exit))
			client.Close(websocket.StatusNormalClosure, "exited")
			return
		}
		if err := client.Write(ctx, websocket.MessageBinary, b); err != nil {
			return
		}
	}
}

// exitFrame bounds the agent's exit status (its words are untrusted),
// records it through the attachment and returns the FrameExit to relay.
func exitFrame(ctx context.Context, att *sandbox.Attachment, st api.ExitStatus) []byte {
	if len(st.Reason) > 1024 {
		st.Reason = st.Reason[:1024]
	}
	if len(st.Signal) > 16 {
		st.Signal = st.Signal[:16]
	}
	out, _ := json.Marshal(att.Exited(ctx, st))
	return append([]byte{api.FrameExit}, out...)
}
