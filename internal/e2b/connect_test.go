package e2b

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

type echoIn struct {
	Text string `json:"text"`
	N    int    `json:"n"`
}

func envelope(flags byte, msg string) []byte {
	b := make([]byte, 5+len(msg))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:], uint32(len(msg)))
	copy(b[5:], msg)
	return b
}

// readEnvelopes splits a server-stream body into its messages; the last
// one must be the end-of-stream envelope.
func readEnvelopes(t *testing.T, body []byte) (msgs []string, end string) {
	t.Helper()
	for len(body) > 0 {
		if len(body) < 5 {
			t.Fatalf("truncated envelope header: %q", body)
		}
		n := binary.BigEndian.Uint32(body[1:5])
		if int(n) > len(body)-5 {
			t.Fatalf("envelope of %d bytes, %d left", n, len(body)-5)
		}
		m := string(body[5 : 5+n])
		if body[0]&flagEndStream != 0 {
			if len(body) != int(5+n) {
				t.Fatalf("data after the end-of-stream envelope")
			}
			return msgs, m
		}
		msgs = append(msgs, m)
		body = body[5+n:]
	}
	t.Fatal("no end-of-stream envelope")
	return
}

func TestUnaryJSONAndErrors(t *testing.T) {
	h := unary(func(ctx context.Context, r *http.Request, in *echoIn) (*echoIn, error) {
		switch in.Text {
		case "missing":
			return nil, fmt.Errorf("no such thing: %w", errdefs.ErrNotFound)
		case "slow":
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return &echoIn{Text: strings.ToUpper(in.Text), N: in.N + 1}, nil
	})
	for _, c := range []struct {
		name, ct, body, timeout string
		status                  int
		want                    string
	}{
		{"ok", "application/json", `{"text":"hi","n":1,"futureField":true}`, "", 200, `{"text":"HI","n":2}`},
		{"empty body is the empty message", "application/json", ``, "", 200, `{"text":"","n":1}`},
		{"not found", "application/json", `{"text":"missing"}`, "", 404, `{"code":"not_found","message":"no such thing: not found"}`},
		{"bad json", "application/json", `{"text":`, "", 400, `"code":"invalid_argument"`},
		{"binary protobuf refused", "application/proto", `x`, "", 415, `binary protobuf`},
		{"deadline", "application/json", `{"text":"slow"}`, "50", 504, `"code":"deadline_exceeded"`},
		{"bad timeout header", "application/json", `{}`, "soon", 400, `Connect-Timeout-Ms`},
	} {
		t.Run(c.name, func(t *testing.T) {
			req := httptest.NewRequest("POST", "/x", strings.NewReader(c.body))
			req.Header.Set("Content-Type", c.ct)
			if c.timeout != "" {
				req.Header.Set("Connect-Timeout-Ms", c.timeout)
			}
			rec := httptest.NewRecorder()
			h(rec, req)
			if rec.Code != c.status || !strings.Contains(rec.Body.String(), c.want) {
				t.Fatalf("got %d %s, want %d containing %s", rec.Code, rec.Body, c.status, c.want)
			}
		})
	}
	// A message over the bound is refused, not read whole.
	req := httptest.NewRequest("POST", "/x", strings.NewReader(`{"text":"`+strings.Repeat("a", maxMessage)+`"}`))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h(rec, req)
	if rec.Code != 429 || !strings.Contains(rec.Body.String(), "resource_exhausted") {
		t.Fatalf("oversized: %d %s", rec.Code, rec.Body)
	}
}

func TestServerStream(t *testing.T) {
	h := serverStream(func() any { return map[string]any{"keepalive": map[string]any{}} },
		func(ctx context.Context, r *http.Request, in *echoIn, s *stream) error {
			for i := 0; i < in.N; i++ {
				if err := s.send(echoIn{Text: in.Text, N: i}); err != nil {
					return err
				}
			}
			switch in.Text {
			case "fail":
				return fmt.Errorf("it broke: %w", errdefs.ErrUnavailable)
			case "wait":
				<-ctx.Done()
				return nil
			}
			return nil
		})
	srv := httptest.NewServer(h)
	defer srv.Close()
	call := func(msg string, hdr map[string]string) (int, []string, string) {
		req, _ := http.NewRequest("POST", srv.URL, bytes.NewReader(envelope(0, msg)))
		req.Header.Set("Content-Type", "application/connect+json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		msgs, end := readEnvelopes(t, body)
		return res.StatusCode, msgs, end
	}
	st, msgs, end := call(`{"text":"a","n":3}`, nil)
	if st != 200 || len(msgs) != 3 || end != "{}" {
		t.Fatalf("got %d %q end %q", st, msgs, end)
	}
	var m echoIn
	json.Unmarshal([]byte(msgs[2]), &m)
	if m.Text != "a" || m.N != 2 {
		t.Fatalf("third message %q", msgs[2])
	}
	_, msgs, end = call(`{"text":"fail","n":1}`, nil)
	if len(msgs) != 1 || !strings.Contains(end, `"code":"unavailable"`) || !strings.Contains(end, "it broke") {
		t.Fatalf("error end %q after %q", end, msgs)
	}
	// The call's own deadline ends the stream with deadline_exceeded; the
	// client asked for keep-alive pings every second and gets them meanwhile.
	start := time.Now()
	_, msgs, end = call(`{"text":"wait","n":0}`, map[string]string{"Connect-Timeout-Ms": "2300", "Keepalive-Ping-Interval": "1"})
	if !strings.Contains(end, "deadline_exceeded") || time.Since(start) > 10*time.Second {
		t.Fatalf("deadline: end %q after %v", end, time.Since(start))
	}
	if len(msgs) < 2 || !strings.Contains(msgs[0], "keepalive") {
		t.Fatalf("want ≥2 keep-alive pings, got %q", msgs)
	}
	// A request that is not an envelope ends the stream with
	// invalid_argument; a unary content type is refused with 415.
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/connect+json")
	res, _ := http.DefaultClient.Do(req)
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if _, end := readEnvelopes(t, body); !strings.Contains(end, "invalid_argument") {
		t.Fatalf("bad envelope: %q", end)
	}
	req, _ = http.NewRequest("POST", srv.URL, bytes.NewReader(envelope(0, `{}`)))
	req.Header.Set("Content-Type", "application/json")
	res, _ = http.DefaultClient.Do(req)
	res.Body.Close()
	if res.StatusCode != 415 {
		t.Fatalf("unary content type on a stream: %d", res.StatusCode)
	}
}

// TestConnectCodeOfEverySentinel: every class of error the layers below
// return reaches E2B's SDK as the Connect code that means it; a policy
// refusal is permission_denied, not internal (the SDK shows internal as a
// server bug).
func TestConnectCodeOfEverySentinel(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{errdefs.ErrPolicyDenied, codePermissionDenied},
		{errdefs.ErrPermissionDenied, codePermissionDenied},
		{errdefs.ErrInvalidArgument, codeInvalidArgument},
		{errdefs.ErrTooLarge, codeInvalidArgument},
		{errdefs.ErrUnauthorized, codeUnauthenticated},
		{errdefs.ErrNotFound, codeNotFound},
		{errdefs.ErrConflict, codeFailedPrecondition},
		{errdefs.ErrUnprocessable, codeFailedPrecondition},
		{errdefs.ErrNotSupported, codeUnimplemented},
		{errdefs.ErrUnavailable, codeUnavailable},
		{errdefs.ErrTimeout, codeDeadlineExceeded},
		{errdefs.ErrQuotaExceeded, codeResourceExhausted},
		{errors.New("a bug"), codeInternal},
	} {
		if got, _ := connectCode(context.Background(), fmt.Errorf("wrapped: %w", c.err)); got != c.want {
			t.Errorf("%v: %s, want %s", c.err, got, c.want)
		}
	}
}
