package api

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
)

// Attach protocol: every WebSocket message is binary; byte 0 is the frame type,
// the rest is the payload. The same framing is used between client and server
// and between server and agent, so the server can validate and forward frames.
//
// Output frames (stdout/stderr) carry the absolute offset of their first byte
// in the stream as 8 big-endian bytes before the data, so a client that
// re-attaches with ?stdout_offset=N&stderr_offset=M gets exactly what it missed.
const (
	FrameStdin      byte = 0 // client → process: raw bytes
	FrameStdout     byte = 1 // process → client: offset(8) + bytes
	FrameStderr     byte = 2 // process → client: offset(8) + bytes
	FrameResize     byte = 3 // client → process: JSON Resize
	FrameSignal     byte = 4 // client → process: JSON SignalRequest
	FrameExit       byte = 5 // process → client: JSON ExitStatus; last frame
	FrameDropped    byte = 6 // process → client: JSON Dropped (output lost from the replay buffer)
	FrameCloseStdin byte = 7 // client → process: EOF on stdin
	FrameStarted    byte = 8 // process → client: JSON Started (pid), first frame of an attach
)

// MaxFrame bounds one attach frame (type byte + payload) in either direction.
const MaxFrame = 64 << 10

// Resize is the payload of FrameResize.
type Resize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// Dropped says that bytes [From, To) of Stream were overwritten in the replay
// buffer before this client could receive them.
type Dropped struct {
	Stream string `json:"stream"` // "stdout" | "stderr"
	From   int64  `json:"from"`
	To     int64  `json:"to"`
}

// Started is the payload of FrameStarted.
type Started struct {
	Pid int `json:"pid"`
}

// EncodeOutput builds a stdout/stderr frame.
func EncodeOutput(typ byte, offset int64, data []byte) []byte {
	b := make([]byte, 9+len(data))
	b[0] = typ
	binary.BigEndian.PutUint64(b[1:9], uint64(offset))
	copy(b[9:], data)
	return b
}

// DecodeOutput splits a stdout/stderr frame payload (frame without type byte).
func DecodeOutput(payload []byte) (offset int64, data []byte, err error) {
	if len(payload) < 8 {
		return 0, nil, errors.New("output frame shorter than its offset")
	}
	off := binary.BigEndian.Uint64(payload[:8])
	if off > 1<<62 {
		return 0, nil, fmt.Errorf("output frame offset %d out of range", off)
	}
	return int64(off), payload[8:], nil
}

// Frame is one decoded attach frame. Type says which field is set: Data
// (FrameStdin; FrameStdout and FrameStderr with Offset), Resize, Signal,
// Exit, Dropped or Started; FrameCloseStdin carries nothing.
type Frame struct {
	Type    byte
	Offset  int64  // FrameStdout, FrameStderr: absolute offset of Data[0]
	Data    []byte // aliases the decoded buffer
	Resize  Resize
	Signal  SignalRequest
	Exit    ExitStatus
	Dropped Dropped
	Started Started
}

// MaxExitCode is the largest exit code a process can report (128 + signal
// number for a signalled one).
const MaxExitCode = 255

// DecodeFrame decodes and validates one attach frame (type byte + payload)
// from a peer that is not trusted: a known type, at most MaxFrame bytes,
// an output offset in range, JSON payloads that parse, an exit code in
// [0, MaxExitCode], a dropped range 0 <= From <= To of a named stream, a
// non-negative pid. It does not judge direction: a reader refuses the
// types its peer must not send.
func DecodeFrame(b []byte) (Frame, error) {
	if len(b) == 0 {
		return Frame{}, errors.New("empty frame")
	}
	if len(b) > MaxFrame {
		return Frame{}, fmt.Errorf("frame of %d bytes is over the limit of %d", len(b), MaxFrame)
	}
	f := Frame{Type: b[0]}
	payload := b[1:]
	var err error
	switch f.Type {
	case FrameStdin:
		f.Data = payload
	case FrameStdout, FrameStderr:
		f.Offset, f.Data, err = DecodeOutput(payload)
	case FrameResize:
		err = decodeFramePayload(payload, &f.Resize, "resize")
	case FrameSignal:
		err = decodeFramePayload(payload, &f.Signal, "signal")
	case FrameExit:
		if err = decodeFramePayload(payload, &f.Exit, "exit"); err == nil && (f.Exit.ExitCode < 0 || f.Exit.ExitCode > MaxExitCode) {
			err = fmt.Errorf("exit frame: exit code %d out of range 0-%d", f.Exit.ExitCode, MaxExitCode)
		}
	case FrameDropped:
		d := &f.Dropped
		if err = decodeFramePayload(payload, d, "dropped"); err != nil {
			break
		}
		if d.Stream != "stdout" && d.Stream != "stderr" {
			err = fmt.Errorf("dropped frame names unknown stream %q", d.Stream)
		} else if d.From < 0 || d.To < d.From {
			err = fmt.Errorf("dropped frame: bad range [%d, %d)", d.From, d.To)
		}
	case FrameCloseStdin:
	case FrameStarted:
		if err = decodeFramePayload(payload, &f.Started, "started"); err == nil && f.Started.Pid < 0 {
			err = fmt.Errorf("started frame: pid %d", f.Started.Pid)
		}
	default:
		err = fmt.Errorf("unknown frame type %d", f.Type)
	}
	if err != nil {
		return Frame{}, err
	}
	return f, nil
}

func decodeFramePayload(payload []byte, v any, what string) error {
	if err := json.Unmarshal(payload, v); err != nil {
		return fmt.Errorf("%s frame: %w", what, err)
	}
	return nil
}
