package api

import (
	"encoding/binary"
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
