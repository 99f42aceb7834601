package server

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/http"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
)

// ExecStreamContentType is the body of POST …/exec/stream: attach frames
// (api.Frame*: started, stdout, stderr, dropped, exit last), each after
// its length as 4 big-endian bytes.
const ExecStreamContentType = "application/vnd.space.frames"

// execStream is POST /v1/sandboxes/{id}/exec/stream: one request runs a
// command session and streams its output as it is produced, what `space
// exec` without a TTY needs in one round trip instead of a command create
// and a WebSocket attach. The response header Space-Command-Id names the
// session, so a client can signal it or re-attach at the offsets it has
// if the stream breaks; a stream that ends without the exit frame broke.
func (s *Server) execStream(w http.ResponseWriter, r *http.Request) {
	var req api.ExecRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if req.TTY {
		writeError(w, r, fmt.Errorf("tty needs a command session and its attach (POST …/commands): %w", errdefs.ErrInvalidArgument))
		return
	}
	if req.MaxOutputBytes != 0 {
		writeError(w, r, fmt.Errorf("max_output_bytes is for synchronous exec; a stream is not capped: %w", errdefs.ErrInvalidArgument))
		return
	}
	stdin := req.Stdin
	req.Stdin = "" // a command session takes stdin as frames
	id := r.PathValue("id")
	cmd, err := s.mgr.Commands().CreateCommand(r.Context(), id, api.CreateCommandRequest{ExecRequest: req})
	if err != nil {
		writeError(w, r, err)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	att, err := s.mgr.Commands().AttachCommand(ctx, id, cmd.ID, 0, 0)
	if err != nil {
		writeError(w, r, err)
		return
	}
	defer att.Close()
	agent := att.Conn
	frames := agentclient.Frames(agent)
	for b := []byte(stdin); len(b) > 0; {
		n := min(len(b), api.MaxFrame-1)
		if err := agent.Write(ctx, websocket.MessageBinary, append([]byte{api.FrameStdin}, b[:n]...)); err != nil {
			writeError(w, r, fmt.Errorf("writing stdin: %v: %w", err, errdefs.ErrUnavailable))
			return
		}
		b = b[n:]
	}
	if err := agent.Write(ctx, websocket.MessageBinary, []byte{api.FrameCloseStdin}); err != nil {
		writeError(w, r, fmt.Errorf("closing stdin: %v: %w", err, errdefs.ErrUnavailable))
		return
	}
	w.Header().Set("Content-Type", ExecStreamContentType)
	w.Header().Set("Space-Command-Id", cmd.ID)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	send := func(b []byte) error {
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(b)))
		if _, err := w.Write(n[:]); err != nil {
			return err
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
		return rc.Flush()
	}
	// The agent may be hostile: its frames are checked by the reader the
	// attach proxy uses. A bad one ends the stream without an exit.
	for {
		f, b, err := frames.Next(ctx)
		if err != nil {
			return
		}
		if f.Type == api.FrameExit {
			_ = send(exitFrame(ctx, att, f.Exit))
			return
		}
		if err := send(b); err != nil {
			return
		}
	}
}
