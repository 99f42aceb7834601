package server

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// echoService stands in for a service in the sandbox: it answers with what
// it received, and echoes WebSocket messages on /ws.
func echoService(t *testing.T) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/ws" {
			c, err := websocket.Accept(w, r, nil)
			if err != nil {
				return
			}
			defer c.CloseNow()
			for {
				typ, b, err := c.Read(r.Context())
				if err != nil {
					return
				}
				if err := c.Write(r.Context(), typ, append([]byte("echo:"), b...)); err != nil {
					return
				}
			}
		}
		json.NewEncoder(w).Encode(map[string]string{
			"method": r.Method, "path": r.URL.Path, "query": r.URL.RawQuery, "host": r.Host,
			"auth": r.Header.Get("Authorization"), "token": r.Header.Get(api.PortTokenHeader),
			"cookie": r.Header.Get("Cookie"), "xfh": r.Header.Get("X-Forwarded-Host"),
		})
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

type echoed struct{ Method, Path, Query, Host, Auth, Token, Cookie, Xfh string }

// portGet does one request with headers h and returns status and, for a
// 200, what the service saw.
func (ns *netServer) portReq(t *testing.T, method, path, host string, h map[string]string) (int, echoed, *http.Response) {
	t.Helper()
	req, _ := http.NewRequest(method, ns.url+path, nil)
	if host != "" {
		req.Host = host
	}
	for k, v := range h {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var e echoed
	if resp.StatusCode == 200 {
		if err := json.Unmarshal(b, &e); err != nil {
			t.Fatalf("%s: %v: %s", path, err, b)
		}
	} else {
		var ae api.Error
		if err := json.Unmarshal(b, &ae); err != nil || ae.Error.Code == "" {
			t.Errorf("%s: status %d without a JSON error: %s", path, resp.StatusCode, b)
		}
	}
	return resp.StatusCode, e, resp
}

func TestPortProxy(t *testing.T) {
	ns := newNetServer(t)
	ns.netw.Serve(8000, echoService(t))
	id := ns.create(t, `{}`)
	base := "/v1/sandboxes/" + id + "/ports/8000"

	var pi api.PortInfo
	ns.call(t, "GET", base, "", 200, &pi)
	_, srvPort, _ := net.SplitHostPort(strings.TrimPrefix(ns.url, "http://"))
	if pi.Port != 8000 || pi.Public || !strings.HasPrefix(pi.Token, "spt2.") || pi.TokenExpiresAt == nil ||
		pi.URL != "http://8000-"+id+".localhost:"+srvPort+"/" || pi.PathURL != ns.url+base+"/" {
		t.Fatalf("port info %+v", pi)
	}
	tok := pi.Token
	hostRouted := "8000-" + id + ".localhost:" + srvPort

	// No credentials: 401, path- and host-routed.
	if code, _, _ := ns.portReq(t, "GET", base+"/a", "", nil); code != 401 {
		t.Errorf("no token: %d", code)
	}
	if code, _, _ := ns.portReq(t, "GET", "/x", hostRouted, nil); code != 401 {
		t.Errorf("host-routed, no token: %d", code)
	}
	if code, _, _ := ns.portReq(t, "GET", base+"/a", "", map[string]string{api.PortTokenHeader: "spt_wrong"}); code != 401 {
		t.Errorf("wrong token: %d", code)
	}

	// Header token, path-routed: prefix stripped, query kept, token gone.
	code, e, _ := ns.portReq(t, "POST", base+"/a/b%2Fc?x=1", "", map[string]string{api.PortTokenHeader: tok})
	if code != 200 || e.Method != "POST" || e.Path != "/a/b/c" || e.Query != "x=1" || e.Token != "" || e.Xfh == "" {
		t.Errorf("path-routed: %d %+v", code, e)
	}
	if code, e, _ := ns.portReq(t, "GET", base+"/", "", map[string]string{api.PortTokenHeader: tok}); code != 200 || e.Path != "/" {
		t.Errorf("path-routed root: %d %+v", code, e)
	}
	// Host-routed: path unchanged, Host kept.
	code, e, _ = ns.portReq(t, "GET", "/v1/info?y=2", hostRouted, map[string]string{api.PortTokenHeader: tok})
	if code != 200 || e.Path != "/v1/info" || e.Query != "y=2" || e.Host != hostRouted {
		t.Errorf("host-routed: %d %+v", code, e)
	}
	// Query token: stripped, kept in a cookie; the cookie alone then works
	// and is stripped too, other cookies pass.
	code, e, resp := ns.portReq(t, "GET", "/p?space_token="+tok+"&z=3", hostRouted, nil)
	var cookie *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == api.PortTokenCookie {
			cookie = c
		}
	}
	if code != 200 || e.Query != "z=3" || cookie == nil || cookie.Value != tok || !cookie.HttpOnly || cookie.Path != "/" {
		t.Fatalf("query token: %d %+v %v", code, e, resp.Header["Set-Cookie"])
	}
	code, e, _ = ns.portReq(t, "GET", "/p", hostRouted, map[string]string{"Cookie": "a=1; " + api.PortTokenCookie + "=" + tok + "; b=2"})
	if code != 200 || e.Cookie != "a=1; b=2" {
		t.Errorf("cookie: %d %+v", code, e)
	}
	// The API key works and is removed; a service's own Authorization passes.
	code, e, _ = ns.portReq(t, "GET", base+"/k", "", map[string]string{"Authorization": "Bearer " + ns.s.apiKey})
	if code != 200 || e.Auth != "" {
		t.Errorf("api key: %d %+v", code, e)
	}
	code, e, _ = ns.portReq(t, "GET", base+"/k", "", map[string]string{"Authorization": "Basic dXNlcjpwdw==", api.PortTokenHeader: tok})
	if code != 200 || e.Auth != "Basic dXNlcjpwdw==" {
		t.Errorf("service auth: %d %+v", code, e)
	}

	// Public, then private again.
	ns.call(t, "PUT", base, `{"public":true}`, 200, &pi)
	if !pi.Public {
		t.Fatalf("put public: %+v", pi)
	}
	var sb api.Sandbox
	ns.call(t, "GET", "/v1/sandboxes/"+id, "", 200, &sb)
	if len(sb.PublicPorts) != 1 || sb.PublicPorts[0] != 8000 {
		t.Errorf("sandbox public ports %v", sb.PublicPorts)
	}
	if code, _, _ := ns.portReq(t, "GET", base+"/pub", "", nil); code != 200 {
		t.Errorf("public: %d", code)
	}
	if code, _, _ := ns.portReq(t, "GET", "/pub", hostRouted, nil); code != 200 {
		t.Errorf("public host-routed: %d", code)
	}
	ns.call(t, "PUT", base, `{"public":false}`, 200, &pi)
	if code, _, _ := ns.portReq(t, "GET", base+"/pub", "", nil); code != 401 {
		t.Errorf("private again: %d", code)
	}

	// WebSocket through the proxy, path- and host-routed.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, host := range []string{"", hostRouted} {
		u := "ws" + strings.TrimPrefix(ns.url, "http") + base + "/ws"
		h := http.Header{api.PortTokenHeader: {tok}}
		if host != "" {
			u = "ws" + strings.TrimPrefix(ns.url, "http") + "/ws"
			h.Set("Host", host)
		}
		c, _, err := websocket.Dial(ctx, u, &websocket.DialOptions{HTTPHeader: h, Host: host})
		if err != nil {
			t.Fatalf("websocket %q: %v", host, err)
		}
		for i := range 3 {
			msg := fmt.Sprintf("hi %d", i)
			if err := c.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
				t.Fatal(err)
			}
			_, b, err := c.Read(ctx)
			if err != nil || string(b) != "echo:"+msg {
				t.Fatalf("websocket %q: %q %v", host, b, err)
			}
		}
		c.Close(websocket.StatusNormalClosure, "")
	}

	// Raw TCP over the tunnel (the SDK's DialPort, with the API key).
	cl, _ := sdk.New(ns.url, ns.s.apiKey)
	conn, err := cl.DialPort(ctx, id, 8000)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "GET /raw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	conn.(interface{ CloseWrite() error }).CloseWrite()
	raw, err := io.ReadAll(conn)
	conn.Close()
	if err != nil || !strings.HasPrefix(string(raw), "HTTP/1.1 200") || !strings.Contains(string(raw), `"path":"/raw"`) {
		t.Errorf("tunnel: %q %v", raw, err)
	}
	// The tunnel without credentials is refused.
	noKey, _ := sdk.New(ns.url, "")
	if _, err := noKey.DialPort(ctx, id, 8000); !strings.Contains(fmt.Sprint(err), "access token") {
		t.Errorf("tunnel without a key: %v", err)
	}

	// Errors: unknown sandbox, bad ports, nothing listening.
	unknown := "/v1/sandboxes/sb-zzzzzzzzzzzz/ports/8000"
	ns.call(t, "GET", unknown, "", 404, nil)
	if code, _, _ := ns.portReq(t, "GET", unknown+"/", "", map[string]string{api.PortTokenHeader: tok}); code != 404 {
		t.Errorf("unknown sandbox: %d", code)
	}
	if code, _, _ := ns.portReq(t, "GET", "/", "8000-sb-zzzzzzzzzzzz.localhost", nil); code != 404 {
		t.Errorf("unknown sandbox host-routed: %d", code)
	}
	for _, p := range []string{"0", "70000", "abc"} {
		ns.call(t, "GET", "/v1/sandboxes/"+id+"/ports/"+p, "", 400, nil)
		if code, _, _ := ns.portReq(t, "GET", "/v1/sandboxes/"+id+"/ports/"+p+"/", "", map[string]string{api.PortTokenHeader: tok}); code != 400 {
			t.Errorf("port %s: %d", p, code)
		}
	}
	if code, _, _ := ns.portReq(t, "GET", "/", "0-"+id+".localhost", nil); code != 400 {
		t.Errorf("host-routed port 0: %d", code)
	}
	if code, _, _ := ns.portReq(t, "GET", "/v1/sandboxes/"+id+"/ports/9/", "", map[string]string{api.PortTokenHeader: tok}); code != 503 {
		t.Errorf("nothing listening: %d", code)
	}
	// A paused sandbox is woken by a request.
	op, err := ns.s.mgr.Verbs().Lifecycle(ctx, id, api.OpPause, false)
	if err != nil {
		t.Fatal(err)
	}
	if op, err = ns.s.mgr.Verbs().Wait(ctx, op.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("pause: %v %+v", err, op)
	}
	if code, _, _ := ns.portReq(t, "GET", base+"/w", "", map[string]string{api.PortTokenHeader: tok}); code != 200 {
		t.Errorf("paused: %d", code)
	}
	if sb, _ := ns.s.mgr.Get(ctx, id); sb.State != api.StateRunning {
		t.Errorf("state %s after a request to a paused sandbox", sb.State)
	}

	// An ordinary API request is not taken for a port.
	ns.call(t, "GET", "/v1/sandboxes/"+id, "", 200, nil)
}
