package e2b

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// The envd services speak the Connect protocol. E2B's SDKs use its JSON
// encoding (the JS SDK creates its transport with useBinaryFormat: false),
// so that is the encoding served: unary calls are a JSON body in and out,
// server streams are "enveloped" JSON messages ending with an end-of-stream
// envelope that carries the error, if any. Binary protobuf is refused with
// 415 naming what is supported. Client streaming (StreamInput) cannot run
// over the SDK's fetch transport and is refused as unimplemented.

// maxMessage bounds one Connect request message.
const maxMessage = 1 << 20

// Connect error codes (connectrpc.com/docs/protocol#error-codes).
const (
	codeCanceled           = "canceled"
	codeUnknown            = "unknown"
	codeInvalidArgument    = "invalid_argument"
	codeDeadlineExceeded   = "deadline_exceeded"
	codeNotFound           = "not_found"
	codeAlreadyExists      = "already_exists"
	codePermissionDenied   = "permission_denied"
	codeResourceExhausted  = "resource_exhausted"
	codeFailedPrecondition = "failed_precondition"
	codeUnimplemented      = "unimplemented"
	codeInternal           = "internal"
	codeUnavailable        = "unavailable"
	codeUnauthenticated    = "unauthenticated"
	codeDataLoss           = "data_loss"
)

// connectStatus is the HTTP status of a unary error with each code.
var connectStatus = map[string]int{
	codeCanceled:           499,
	codeUnknown:            500,
	codeInvalidArgument:    400,
	codeDeadlineExceeded:   504,
	codeNotFound:           404,
	codeAlreadyExists:      409,
	codePermissionDenied:   403,
	codeResourceExhausted:  429,
	codeFailedPrecondition: 400,
	codeUnimplemented:      501,
	codeInternal:           500,
	codeUnavailable:        503,
	codeUnauthenticated:    401,
	codeDataLoss:           500,
}

// rpcError is an error with a Connect code.
type rpcError struct {
	code string
	msg  string
}

func (e *rpcError) Error() string { return e.code + ": " + e.msg }

func rpcErrorf(code, format string, args ...any) error {
	return &rpcError{code: code, msg: fmt.Sprintf(format, args...)}
}

// connectCode maps an error of this project (errdefs sentinels) or of a
// context to a Connect code.
func connectCode(ctx context.Context, err error) (string, string) {
	var re *rpcError
	if errors.As(err, &re) {
		return re.code, re.msg
	}
	msg := err.Error()
	switch {
	case errors.Is(err, context.DeadlineExceeded) || (ctx != nil && errors.Is(ctx.Err(), context.DeadlineExceeded)):
		return codeDeadlineExceeded, msg
	case errors.Is(err, context.Canceled):
		return codeCanceled, msg
	}
	switch errdefs.Code(err) {
	case api.CodeInvalidArgument, api.CodeTooLarge:
		return codeInvalidArgument, msg
	case api.CodeUnauthorized:
		return codeUnauthenticated, msg
	case api.CodePermissionDenied, api.CodePolicyDenied:
		return codePermissionDenied, msg
	case api.CodeQuotaExceeded:
		return codeResourceExhausted, msg
	case api.CodeNotFound:
		return codeNotFound, msg
	case api.CodeConflict, api.CodeUnprocessable:
		return codeFailedPrecondition, msg
	case api.CodeNotSupported, api.CodeMethodNotAllowed:
		return codeUnimplemented, msg
	case api.CodeUnavailable:
		return codeUnavailable, msg
	case api.CodeTimeout:
		return codeDeadlineExceeded, msg
	}
	return codeInternal, msg
}

type connectErrorBody struct {
	Code    string `json:"code"`
	Message string `json:"message,omitempty"`
}

// writeUnaryError answers a unary call with err.
func writeUnaryError(w http.ResponseWriter, ctx context.Context, err error) {
	code, msg := connectCode(ctx, err)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(connectStatus[code])
	json.NewEncoder(w).Encode(connectErrorBody{Code: code, Message: msg})
}

// rpcContext derives the call's context from Connect-Timeout-Ms.
func rpcContext(r *http.Request) (context.Context, context.CancelFunc, error) {
	t := r.Header.Get("Connect-Timeout-Ms")
	if t == "" {
		ctx, cancel := context.WithCancel(r.Context())
		return ctx, cancel, nil
	}
	ms, err := strconv.ParseInt(t, 10, 64)
	if err != nil || ms <= 0 || len(t) > 10 {
		return nil, nil, rpcErrorf(codeInvalidArgument, "Connect-Timeout-Ms %q is not a positive integer of at most 10 digits", t)
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(ms)*time.Millisecond)
	return ctx, cancel, nil
}

// unary serves one unary RPC: decode In from the JSON body, call fn,
// encode its Out.
func unary[In, Out any](fn func(ctx context.Context, r *http.Request, in *In) (*Out, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel, err := rpcContext(r)
		if err != nil {
			writeUnaryError(w, r.Context(), err)
			return
		}
		defer cancel()
		if ct := mediaType(r); ct != "application/json" {
			w.Header().Set("Accept-Post", "application/json")
			writeUnsupportedMedia(w, ct, "application/json")
			return
		}
		var in In
		if err := decodeMessage(io.LimitReader(r.Body, maxMessage+1), &in); err != nil {
			writeUnaryError(w, ctx, err)
			return
		}
		out, err := fn(ctx, r, &in)
		if err != nil {
			writeUnaryError(w, ctx, err)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(out)
	}
}

func writeUnsupportedMedia(w http.ResponseWriter, got, want string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusUnsupportedMediaType)
	json.NewEncoder(w).Encode(connectErrorBody{Code: codeUnimplemented,
		Message: fmt.Sprintf("content type %q is not served: this envd speaks Connect with JSON (%s); binary protobuf and gRPC are not supported", got, want)})
}

func mediaType(r *http.Request) string {
	ct := r.Header.Get("Content-Type")
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	return strings.TrimSpace(strings.ToLower(ct))
}

// decodeMessage reads one JSON message of at most maxMessage bytes.
// Unknown fields are ignored, as protobuf's JSON parsing does for a newer
// client's additions.
func decodeMessage(r io.Reader, v any) error {
	b, err := io.ReadAll(r)
	if err != nil {
		return rpcErrorf(codeInvalidArgument, "reading request: %v", err)
	}
	if len(b) > maxMessage {
		return rpcErrorf(codeResourceExhausted, "request message larger than %d bytes", maxMessage)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return rpcErrorf(codeInvalidArgument, "request message is not valid JSON for this method: %v", err)
	}
	return nil
}

// stream is the response side of a server-streaming call.
type stream struct {
	w       http.ResponseWriter
	mu      sync.Mutex
	flusher http.Flusher
	ended   bool
}

const (
	flagEndStream  = 0x02
	flagCompressed = 0x01
)

// serverStream serves one server-streaming RPC. fn sends messages with
// s.send; its error (or nil) becomes the end-of-stream message. When the
// client asked for keep-alive pings (Keepalive-Ping-Interval, seconds),
// ping() is sent at that interval while fn runs.
func serverStream[In any](ping func() any, fn func(ctx context.Context, r *http.Request, in *In, s *stream) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if ct := mediaType(r); ct != "application/connect+json" {
			writeUnsupportedMedia(w, ct, "application/connect+json")
			return
		}
		s := &stream{w: w}
		s.flusher, _ = w.(http.Flusher)
		w.Header().Set("Content-Type", "application/connect+json")
		ctx, cancel, err := rpcContext(r)
		if err != nil {
			w.WriteHeader(http.StatusOK)
			s.end(r.Context(), err)
			return
		}
		defer cancel()
		var in In
		if err := readEnvelope(r.Body, &in); err != nil {
			w.WriteHeader(http.StatusOK)
			s.end(ctx, err)
			return
		}
		w.WriteHeader(http.StatusOK)
		s.flush()
		if iv := r.Header.Get("Keepalive-Ping-Interval"); iv != "" && ping != nil {
			if secs, err := strconv.Atoi(iv); err == nil && secs > 0 {
				if secs < 1 {
					secs = 1
				}
				done := make(chan struct{})
				defer close(done)
				go func() {
					t := time.NewTicker(time.Duration(secs) * time.Second)
					defer t.Stop()
					for {
						select {
						case <-done:
							return
						case <-ctx.Done():
							return
						case <-t.C:
							if s.send(ping()) != nil {
								cancel()
								return
							}
						}
					}
				}()
			}
		}
		err = fn(ctx, r, &in, s)
		if err == nil && ctx.Err() != nil && r.Context().Err() == nil {
			// The call's own deadline ended it.
			err = ctx.Err()
		}
		s.end(ctx, err)
	}
}

// readEnvelope reads the one enveloped request message of a server stream.
func readEnvelope(r io.Reader, v any) error {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return rpcErrorf(codeInvalidArgument, "request is not an enveloped Connect message: %v", err)
	}
	if hdr[0]&flagCompressed != 0 {
		return rpcErrorf(codeUnimplemented, "compressed request messages are not supported")
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > maxMessage {
		return rpcErrorf(codeResourceExhausted, "request message of %d bytes is larger than %d", n, maxMessage)
	}
	return decodeMessage(io.LimitReader(r, int64(n)), v)
}

// send writes one message envelope and flushes it.
func (s *stream) send(msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	return s.write(0, b)
}

func (s *stream) write(flags byte, b []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return errors.New("stream ended")
	}
	if flags&flagEndStream != 0 {
		s.ended = true
	}
	var hdr [5]byte
	hdr[0] = flags
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(b)))
	if _, err := s.w.Write(hdr[:]); err != nil {
		return err
	}
	if _, err := s.w.Write(b); err != nil {
		return err
	}
	s.flushLocked()
	return nil
}

func (s *stream) flush() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushLocked()
}

func (s *stream) flushLocked() {
	if s.flusher != nil {
		s.flusher.Flush()
	}
}

// end writes the end-of-stream message.
func (s *stream) end(ctx context.Context, err error) {
	type endStream struct {
		Error    *connectErrorBody   `json:"error,omitempty"`
		Metadata map[string][]string `json:"metadata,omitempty"`
	}
	var m endStream
	if err != nil {
		code, msg := connectCode(ctx, err)
		m.Error = &connectErrorBody{Code: code, Message: msg}
	}
	b, _ := json.Marshal(m)
	s.write(flagEndStream, b)
}
