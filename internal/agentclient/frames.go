package agentclient

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// ErrBadFrame is wrapped, with errdefs.ErrUnavailable, by FrameReader.Next's
// error for a message the agent may not send: not binary, over
// api.MaxFrame, not a frame api.DecodeFrame accepts, a type that only goes
// to the agent, or a frame out of the stream's order.
var ErrBadFrame = errors.New("the agent sent a malformed frame")

// FrameReader reads a process's attach stream (Client.Attach) from an agent
// that is not trusted: the one place on the host that checks the agent's
// frames, for the callers that consume them and the proxies that pass them
// on.
type FrameReader struct {
	conn    *websocket.Conn
	trim    bool
	next    [3]int64 // TrimOverlap: the next offset of stdout (index 1) and stderr (2)
	started bool
	exited  bool
}

// FramesOption configures a FrameReader.
type FramesOption func(*FrameReader)

// TrimOverlap makes Next return each byte of stdout and stderr once: the
// part of an output frame below what the stream already returned (output
// replayed again) is cut off, and a frame wholly inside it is skipped.
// Output past it, a gap the agent announces with FrameDropped, passes as it
// is. Without it the frames' offsets are the caller's to judge (a proxy's
// client re-attaches by them).
func TrimOverlap() FramesOption { return func(r *FrameReader) { r.trim = true } }

// Frames reads conn's agent frames, from one goroutine; it sets conn's
// read limit to api.MaxFrame. The reader does not close conn, but a read
// that ctx cuts short or an oversize message leaves it closed (as
// coder/websocket does).
func Frames(conn *websocket.Conn, opts ...FramesOption) *FrameReader {
	conn.SetReadLimit(api.MaxFrame)
	r := &FrameReader{conn: conn}
	for _, o := range opts {
		o(r)
	}
	return r
}

// Next returns the next frame and its bytes as the agent sent them, for a
// proxy to pass on (re-encoded when TrimOverlap cut the frame). Data aliases
// those bytes. The stream is FrameStarted, then FrameStdout, FrameStderr
// and FrameDropped in any order, then FrameExit; after FrameExit, Next
// returns io.EOF without reading. The error is ctx.Err() when ctx ended;
// otherwise it wraps errdefs.ErrUnavailable, and ErrBadFrame too when the
// agent sent something it may not (any other message ends the stream: the
// connection broke or closed before the exit frame).
func (r *FrameReader) Next(ctx context.Context) (api.Frame, []byte, error) {
	for {
		if r.exited {
			return api.Frame{}, nil, io.EOF
		}
		typ, b, err := r.conn.Read(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return api.Frame{}, nil, ctx.Err()
			}
			if errors.Is(err, websocket.ErrMessageTooBig) {
				return api.Frame{}, nil, badFrame("a message over %d bytes", api.MaxFrame)
			}
			return api.Frame{}, nil, fmt.Errorf("the sandbox's agent went away before the process exited: %s: %w", sanitize(err.Error()), errdefs.ErrUnavailable)
		}
		if typ != websocket.MessageBinary {
			return api.Frame{}, nil, badFrame("a text message")
		}
		f, err := api.DecodeFrame(b)
		if err != nil {
			return api.Frame{}, nil, badFrame("%s", sanitize(err.Error()))
		}
		switch f.Type {
		case api.FrameStarted:
			if r.started {
				return api.Frame{}, nil, badFrame("a second started frame")
			}
			r.started = true
			return f, b, nil
		case api.FrameStdout, api.FrameStderr, api.FrameDropped, api.FrameExit:
			if !r.started {
				return api.Frame{}, nil, badFrame("frame type %d before the started frame", f.Type)
			}
		default:
			return api.Frame{}, nil, badFrame("frame type %d, which only goes to the agent", f.Type)
		}
		switch f.Type {
		case api.FrameExit:
			r.exited = true
		case api.FrameStdout, api.FrameStderr:
			if !r.trim {
				break
			}
			next := &r.next[f.Type]
			if skip := *next - f.Offset; skip > 0 {
				if skip >= int64(len(f.Data)) {
					continue // all of it was returned before
				}
				f.Offset, f.Data = *next, f.Data[skip:]
				b = api.EncodeOutput(f.Type, f.Offset, f.Data)
				f.Data = b[len(b)-len(f.Data):] // alias the re-encoded bytes, as untrimmed frames do
			}
			*next = f.Offset + int64(len(f.Data))
		}
		return f, b, nil
	}
}

func badFrame(format string, a ...any) error {
	return fmt.Errorf("%w: %s: %w", ErrBadFrame, fmt.Sprintf(format, a...), errdefs.ErrUnavailable)
}
