package server

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// serveTest serves s (no store, no manager: only what fails before them is
// reachable) with HTTPServer on a loopback port.
func serveTest(t *testing.T, s *Server) string {
	t.Helper()
	s.handler = s.routes()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := s.HTTPServer()
	go hs.Serve(l)
	t.Cleanup(func() { hs.Close() })
	return l.Addr().String()
}

// rawRequest writes head (and body) on a new connection and reads one
// response, failing if none comes within wait.
func rawRequest(t *testing.T, addr, head, body string, wait time.Duration) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, head+"\r\n"+body); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(wait))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no response within %s: %v", wait, err)
	}
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestBodyAnnouncedTooLarge: a JSON body announced larger than the limit is
// answered 413 from the header at once, not waited for.
func TestBodyAnnouncedTooLarge(t *testing.T) {
	s := withKeys(t, &Server{metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890"})
	addr := serveTest(t, s)
	for _, path := range []string{"/v1/sandboxes", "/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/stop", "/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/fork"} {
		head := "POST " + path + " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + s.apiKey +
			"\r\nContent-Type: application/json\r\nContent-Length: 2000000000\r\n"
		resp, body := rawRequest(t, addr, head, "{", 5*time.Second)
		var e api.Error
		if resp.StatusCode != http.StatusRequestEntityTooLarge || json.Unmarshal([]byte(body), &e) != nil || e.Error.Code != api.CodeTooLarge {
			t.Errorf("%s: %d %s", path, resp.StatusCode, body)
		}
	}
}

// TestStalledBodyIsCut: a body that stops arriving gets an error answer and
// frees the connection once bodyTimeout has passed.
func TestStalledBodyIsCut(t *testing.T) {
	defer func(d time.Duration) { bodyTimeout = d }(bodyTimeout)
	bodyTimeout = 300 * time.Millisecond
	s := withKeys(t, &Server{metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890"})
	addr := serveTest(t, s)
	head := "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + s.apiKey +
		"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
	t0 := time.Now()
	resp, body := rawRequest(t, addr, head, `{"template":`, 5*time.Second)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "did not arrive in time") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if d := time.Since(t0); d > 3*time.Second {
		t.Fatalf("answered after %s", d)
	}
}

// TestBodyDeadlineLifted: a handler that read its whole body runs on past
// bodyTimeout with its context intact (a ReadTimeout would cancel it), and
// an upload whose pieces keep coming may take longer than bodyIdleTimeout.
func TestBodyDeadlineLifted(t *testing.T) {
	defer func(a, b time.Duration) { bodyTimeout, bodyIdleTimeout = a, b }(bodyTimeout, bodyIdleTimeout)
	bodyTimeout, bodyIdleTimeout = 200*time.Millisecond, 300*time.Millisecond
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		kind := bodySmall
		if r.URL.Path == "/stream" {
			kind = bodyStream
		}
		guardBody(w, r, kind)
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		select {
		case <-r.Context().Done():
			http.Error(w, "context cancelled", 500)
			return
		case <-time.After(3 * bodyTimeout):
		}
		w.Write(b)
	})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go hs.Serve(l)
	defer hs.Close()
	resp, body := rawRequest(t, l.Addr().String(), "POST /small HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n", "{}", 5*time.Second)
	if resp.StatusCode != 200 || body != "{}" {
		t.Errorf("small: %d %s", resp.StatusCode, body)
	}
	// An upload in pieces 150 ms apart: 1.2 s in all, each within 300 ms.
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "PUT /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n")
	for i := 0; i < 8; i++ {
		time.Sleep(150 * time.Millisecond)
		io.WriteString(c, "x")
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err = http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(b) != "xxxxxxxx" {
		t.Errorf("stream: %d %s", resp.StatusCode, b)
	}
}

func TestHTTPServerTimeouts(t *testing.T) {
	hs := (&Server{}).HTTPServer()
	if hs.ReadHeaderTimeout <= 0 || hs.IdleTimeout <= 0 {
		t.Errorf("header timeout %s, idle timeout %s", hs.ReadHeaderTimeout, hs.IdleTimeout)
	}
	if hs.ReadTimeout != 0 || hs.WriteTimeout != 0 {
		t.Errorf("read/write timeouts %s/%s would cut streams, long-polls and attach", hs.ReadTimeout, hs.WriteTimeout)
	}
}
