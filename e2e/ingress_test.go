package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cli"
)

// wsEcho is a WebSocket echo server in the sandbox's python3 stdlib (the
// base template has no websockets library): the handshake, then each
// client frame (masked) comes back unmasked with the same opcode.
const wsEcho = `
import base64, hashlib, socket, socketserver
G = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def rd(f, n):
    b = f.read(n)
    if len(b) < n: raise EOFError
    return b
class H(socketserver.StreamRequestHandler):
    def handle(self):
        key = None
        while True:
            line = self.rfile.readline().strip()
            if not line: break
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"sec-websocket-key": key = v.strip()
        acc = base64.b64encode(hashlib.sha1(key + G).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
        try:
            while True:
                b0, b1 = rd(self.rfile, 2)
                n = b1 & 127
                if n == 126: n = int.from_bytes(rd(self.rfile, 2), "big")
                elif n == 127: n = int.from_bytes(rd(self.rfile, 8), "big")
                mask = rd(self.rfile, 4) if b1 & 128 else b"\0\0\0\0"
                data = bytes(c ^ mask[i % 4] for i, c in enumerate(rd(self.rfile, n)))
                op = b0 & 15
                if op == 8:
                    self.wfile.write(bytes([0x88, 0])); return
                if op in (1, 2): data = b"echo:" + data
                hdr = bytes([0x80 | op])
                hdr += bytes([len(data)]) if len(data) < 126 else bytes([126]) + len(data).to_bytes(2, "big")
                self.wfile.write(hdr + data); self.wfile.flush()
        except EOFError:
            pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", 8765), H).serve_forever()
`

// TestIngress reaches services listening in a real native sandbox through
// the server: path- and host-routed HTTP with and without the access
// token, a public port, a WebSocket, space port-forward, and a paused
// sandbox woken by a request.
func TestIngress(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	id := sb.ID
	if out, code := sh(t, e, id, "mkdir -p /srv/site && echo hello > /srv/site/marker-file.txt && cd /srv/site && (nohup python3 -m http.server 8000 >/dev/null 2>&1 &)"); code != 0 {
		t.Fatalf("starting http.server: %d %s", code, out)
	}
	ctx := ctxT(t, 3*time.Minute)
	pi, err := e.client.Port(ctx, id, 8000)
	if err != nil {
		t.Fatal(err)
	}
	if pi.Token == "" || pi.Public || !strings.Contains(pi.URL, "8000-"+id+".localhost:"+strconv.Itoa(e.apiPort)) {
		t.Fatalf("port info %+v", pi)
	}
	pathURL := e.url + "/v1/sandboxes/" + id + "/ports/8000/"
	hostRouted := fmt.Sprintf("8000-%s.localhost:%d", id, e.apiPort)
	get := func(u, host string, h map[string]string) (int, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, "GET", u, nil)
		if host != "" {
			req.Host = host
		}
		for k, v := range h {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", u, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	withTok := map[string]string{api.PortTokenHeader: pi.Token}
	// Wait for the server in the sandbox to listen (503 until then).
	var code int
	var body string
	for range 100 {
		if code, body = get(pathURL, "", withTok); code != http.StatusServiceUnavailable {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if code != 200 || !strings.Contains(body, "marker-file.txt") {
		t.Fatalf("path-routed: %d %s", code, body)
	}
	if code, body = get(e.url+"/marker-file.txt", hostRouted, withTok); code != 200 || strings.TrimSpace(body) != "hello" {
		t.Fatalf("host-routed: %d %s", code, body)
	}
	if code, body = get(pathURL+"marker-file.txt?space_token="+pi.Token, "", nil); code != 200 || strings.TrimSpace(body) != "hello" {
		t.Fatalf("query token: %d %s", code, body)
	}
	if code, _ = get(pathURL, "", nil); code != http.StatusUnauthorized {
		t.Fatalf("no token: %d", code)
	}
	if code, _ = get(e.url+"/", hostRouted, nil); code != http.StatusUnauthorized {
		t.Fatalf("host-routed, no token: %d", code)
	}
	if code, body = get(e.url+"/v1/sandboxes/"+id+"/ports/8001/", "", withTok); code != http.StatusServiceUnavailable || !strings.Contains(body, "nothing listens on port 8001") {
		t.Fatalf("closed port: %d %s", code, body)
	}

	// The CLI makes it public; no token needed then.
	if out, errOut, c := e.spaceCLI(t, "", "port", id, "8000", "--public"); c != 0 || !strings.Contains(out, "8000-"+id+".localhost") {
		t.Fatalf("space port --public: %d %s %s", c, out, errOut)
	}
	if code, body = get(e.url+"/", hostRouted, nil); code != 200 || !strings.Contains(body, "marker-file.txt") {
		t.Fatalf("public: %d %s", code, body)
	}
	if out, errOut, c := e.spaceCLI(t, "", "port", id, "8000", "--private"); c != 0 || !strings.Contains(out, "space_token=spt2.") {
		t.Fatalf("space port --private: %d %s %s", c, out, errOut)
	}
	if code, _ = get(pathURL, "", nil); code != http.StatusUnauthorized {
		t.Fatalf("private again: %d", code)
	}

	// A WebSocket, path-routed, to an echo server in the sandbox.
	if out, code := sh(t, e, id, "cat > /tmp/ws.py <<'EOF'\n"+wsEcho+"\nEOF\n(nohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &)"); code != 0 {
		t.Fatalf("starting the echo server: %d %s", code, out)
	}
	wsURL := "ws" + strings.TrimPrefix(e.url, "http") + "/v1/sandboxes/" + id + "/ports/8765/"
	var ws *websocket.Conn
	for range 100 {
		ws, _, err = websocket.Dial(ctx, wsURL, &websocket.DialOptions{HTTPHeader: http.Header{api.PortTokenHeader: {pi.Token}}})
		if err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		out, _ := sh(t, e, id, "cat /tmp/ws.log")
		t.Fatalf("websocket: %v (%s)", err, out)
	}
	for i := range 3 {
		msg := fmt.Sprintf("hello %d", i)
		if err := ws.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		if _, b, err := ws.Read(ctx); err != nil || string(b) != "echo:"+msg {
			t.Fatalf("websocket echo: %q %v", b, err)
		}
	}
	ws.Close(websocket.StatusNormalClosure, "")

	// space port-forward: raw TCP from a local port into the sandbox.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	local := l.Addr().(*net.TCPAddr).Port
	l.Close()
	fwdCtx, stop := context.WithCancel(ctx)
	fwdDone := make(chan int, 1)
	go func() {
		var o, s strings.Builder
		fwdDone <- cliExecute(fwdCtx, e, []string{"port-forward", id, fmt.Sprintf("%d:8000", local)}, &o, &s)
	}()
	fwdURL := fmt.Sprintf("http://127.0.0.1:%d/marker-file.txt", local)
	for range 100 {
		if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", local)); err == nil {
			c.Close()
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	for i := range 2 { // two connections through one forward
		if code, body = get(fwdURL, "", nil); code != 200 || strings.TrimSpace(body) != "hello" {
			t.Fatalf("port-forward GET %d: %d %s", i, code, body)
		}
	}
	stop()
	select {
	case c := <-fwdDone:
		if c != 0 {
			t.Errorf("port-forward exited %d", c)
		}
	case <-time.After(30 * time.Second):
		t.Error("port-forward did not stop")
	}

	// The connections are ingress events of the sandbox.
	n := 0
	for _, ev := range networkEvents(t, e, id) {
		if ev.Protocol == "ingress" && ev.Port == 8000 && ev.Verdict == api.VerdictAllow {
			n++
		}
	}
	if n == 0 {
		t.Error("no ingress events")
	}

	// A paused sandbox is woken by a request.
	op, err := e.client.Pause(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if op, err = e.client.WaitOperation(ctx, op.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("pause: %v %+v", err, op)
	}
	if got, _ := e.client.GetSandbox(ctx, id); got.State != api.StatePaused {
		t.Fatalf("state %s after pause", got.State)
	}
	if code, body = get(pathURL+"marker-file.txt", "", withTok); code != 200 || strings.TrimSpace(body) != "hello" {
		t.Fatalf("request to a paused sandbox: %d %s", code, body)
	}
	if got, _ := e.client.GetSandbox(ctx, id); got.State != api.StateRunning {
		t.Fatalf("state %s after a request woke it", got.State)
	}
}

// cliExecute runs the CLI in-process against the shared server until ctx
// ends (spaceCLI for commands that run until interrupted).
func cliExecute(ctx context.Context, e *env, args []string, stdout, stderr io.Writer) int {
	all := append([]string{"--url", e.url, "--api-key", e.key}, args...)
	return cli.Execute(ctx, all, strings.NewReader(""), stdout, stderr)
}
