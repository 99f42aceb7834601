package sdk

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// seen is one request as the server received it.
type seen struct {
	Method, Path, Query, Body, ContentType, Auth string
}

// recorder answers every request with reply (JSON) and records it.
func recorder(t *testing.T, status int, reply any) (*Client, *[]seen) {
	t.Helper()
	var got []seen
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got = append(got, seen{r.Method, r.URL.EscapedPath(), r.URL.RawQuery, string(b), r.Header.Get("Content-Type"), r.Header.Get("Authorization")})
		w.WriteHeader(status)
		if reply != nil {
			json.NewEncoder(w).Encode(reply)
		}
	}))
	t.Cleanup(srv.Close)
	c, _ := New(srv.URL, testKey)
	return c, &got
}

func TestRoutesAndEncoding(t *testing.T) {
	ctx := context.Background()
	c, got := recorder(t, 200, map[string]any{})
	type call struct {
		do   func() error
		want seen
	}
	calls := []call{
		{func() error { _, err := c.WriteFile(ctx, "sb", "/a b&c", strings.NewReader("data"), 0o755); return err },
			seen{Method: "PUT", Path: "/v1/sandboxes/sb/files", Query: "mode=0755&path=%2Fa+b%26c", Body: "data", ContentType: "application/octet-stream"}},
		{func() error { return c.RemoveFile(ctx, "sb", "/d", true) },
			seen{Method: "DELETE", Path: "/v1/sandboxes/sb/files", Query: "path=%2Fd&recursive=true"}},
		{func() error { _, err := c.StatFile(ctx, "sb", "/x"); return err },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/files/stat", Query: "path=%2Fx"}},
		{func() error { _, err := c.ListDir(ctx, "sb", "/"); return err },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/files/list", Query: "path=%2F"}},
		{func() error { _, err := c.Mkdir(ctx, "sb", "/p/q", 0o700); return err },
			seen{Method: "POST", Path: "/v1/sandboxes/sb/files/mkdir", Body: `{"path":"/p/q","mode":448}`, ContentType: "application/json"}},
		{func() error { return c.Rename(ctx, "sb", "/a", "/b") },
			seen{Method: "POST", Path: "/v1/sandboxes/sb/files/rename", Body: `{"from":"/a","to":"/b"}`, ContentType: "application/json"}},
		{func() error { return c.UploadTar(ctx, "sb", "/dst", strings.NewReader("TAR")) },
			seen{Method: "PUT", Path: "/v1/sandboxes/sb/files/tar", Query: "path=%2Fdst", Body: "TAR", ContentType: "application/x-tar"}},
		{func() error { _, err := c.GetTemplate(ctx, "base:latest"); return err },
			seen{Method: "GET", Path: "/v1/templates/base:latest"}},
		{func() error { _, err := c.GetTemplate(ctx, "we/ird"); return err },
			seen{Method: "GET", Path: "/v1/templates/we%2Fird"}},
		{func() error { return c.RemoveTemplate(ctx, "py:3", false) },
			seen{Method: "DELETE", Path: "/v1/templates/py:3"}},
		{func() error { _, err := c.ImportTemplate(ctx, "py:3", strings.NewReader("T")); return err },
			seen{Method: "POST", Path: "/v1/templates", Query: "tag=py%3A3", Body: "T", ContentType: "application/x-tar"}},
		{func() error { _, err := c.DeleteSandbox(ctx, "sb", true); return err },
			seen{Method: "DELETE", Path: "/v1/sandboxes/sb", Query: "force=true"}},
		{func() error { _, err := c.Stop(ctx, "sb"); return err },
			seen{Method: "POST", Path: "/v1/sandboxes/sb/stop"}},
		{func() error { _, err := c.Fork(ctx, "sb", api.ForkRequest{Count: 2}); return err },
			seen{Method: "POST", Path: "/v1/sandboxes/sb/fork", Body: `{"count":2}`, ContentType: "application/json"}},
		{func() error { _, err := c.GetOperation(ctx, "op", 30e9); return err },
			seen{Method: "GET", Path: "/v1/operations/op", Query: "wait=30s"}},
		{func() error { return c.SignalCommand(ctx, "sb", "c1", "TERM") },
			seen{Method: "POST", Path: "/v1/sandboxes/sb/commands/c1/signal", Body: `{"signal":"TERM"}`, ContentType: "application/json"}},
		{func() error { _, err := c.Port(ctx, "sb", 8000); return err },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/ports/8000"}},
		{func() error { _, err := c.SetPortPublic(ctx, "sb", 8000, true); return err },
			seen{Method: "PUT", Path: "/v1/sandboxes/sb/ports/8000", Body: `{"public":true}`, ContentType: "application/json"}},
		{func() error { _, err := c.SandboxNetwork(ctx, "sb"); return err },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/network"}},
		{func() error {
			_, err := c.SetSandboxNetwork(ctx, "sb", api.NetworkPolicy{AllowOut: []string{"pypi.org:443"}, Internet: true})
			return err
		}, seen{Method: "PUT", Path: "/v1/sandboxes/sb/network", Body: `{"allow_out":["pypi.org:443"],"internet":true}`, ContentType: "application/json"}},
		{func() error { _, err := c.SetSandboxNetwork(ctx, "sb", api.NetworkPolicy{}); return err },
			seen{Method: "PUT", Path: "/v1/sandboxes/sb/network", Body: `{}`, ContentType: "application/json"}},
		{func() error {
			_, err := c.CreateSandbox(ctx, api.CreateSandboxRequest{Network: &api.NetworkPolicy{DenyOut: []string{"10.0.0.0/8"}}})
			return err
		}, seen{Method: "POST", Path: "/v1/sandboxes", Body: `{"limits":{},"network":{"deny_out":["10.0.0.0/8"]}}`, ContentType: "application/json"}},
		{func() error { _, err := c.Stats(ctx, "sb"); return err },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/stats"}},
		{func() error {
			return c.FollowStats(ctx, "sb", 1500*time.Millisecond, func(api.SandboxStats) error { return nil })
		}, seen{Method: "GET", Path: "/v1/sandboxes/sb/stats", Query: "follow=true&interval=1.5s"}},
		{func() error { return c.FollowStats(ctx, "sb", 0, func(api.SandboxStats) error { return nil }) },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/stats", Query: "follow=true"}},
		{func() error { _, err := c.ListCommands(ctx, "sb"); return err },
			seen{Method: "GET", Path: "/v1/sandboxes/sb/commands"}},
		{func() error {
			_, err := c.Exec(ctx, "sb", api.ExecRequest{Cmd: []string{"true"}, TimeoutSeconds: 2})
			return err
		}, seen{Method: "POST", Path: "/v1/sandboxes/sb/exec", Body: `{"cmd":["true"],"timeout_seconds":2}`, ContentType: "application/json"}},
	}
	for i, cl := range calls {
		if err := cl.do(); err != nil {
			t.Fatalf("call %d (%s %s): %v", i, cl.want.Method, cl.want.Path, err)
		}
		g := (*got)[len(*got)-1]
		g.Body = strings.TrimSpace(g.Body)
		if g.Auth != "Bearer "+testKey {
			t.Errorf("call %d: auth %q", i, g.Auth)
		}
		g.Auth = ""
		if g != cl.want {
			t.Errorf("call %d:\n got %+v\nwant %+v", i, g, cl.want)
		}
	}
}

func TestLocalValidation(t *testing.T) {
	c, got := recorder(t, 200, map[string]any{})
	ctx := context.Background()
	for name, err := range map[string]error{
		"empty path":     func() error { _, err := c.StatFile(ctx, "sb", ""); return err }(),
		"dotdot id":      func() error { _, err := c.GetSandbox(ctx, ".."); return err }(),
		"empty command":  func() error { _, err := c.Exec(ctx, "sb", api.ExecRequest{}); return err }(),
		"negative fork":  func() error { _, err := c.Fork(ctx, "sb", api.ForkRequest{Count: -1}); return err }(),
		"empty signal":   c.SignalCommand(ctx, "sb", "c", ""),
		"empty rename":   c.Rename(ctx, "sb", "", "/b"),
		"nil attach cmd": func() error { _, err := c.Attach(ctx, nil, AttachOptions{}); return err }(),
		"network bad id": func() error { _, err := c.SandboxNetwork(ctx, ".."); return err }(),
		"stats bad id":   func() error { _, err := c.Stats(ctx, ".."); return err }(),
		"stats interval": c.FollowStats(ctx, "sb", -time.Second, func(api.SandboxStats) error { return nil }),
		"nil read cmd":   func() error { _, err := c.ReadOutput(ctx, nil, AttachOptions{}); return err }(),
	} {
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if len(*got) != 0 {
		t.Fatalf("invalid calls reached the server: %+v", *got)
	}
}

func TestBuildBaseTemplateStream(t *testing.T) {
	for _, tc := range []struct {
		body    string
		wantErr error
		phases  int
	}{
		{`{"phase":"a","done":1,"total":2}` + "\n\n" + `{"phase":"b","done":2,"total":2}` + "\n" + `{"template":{"digest":"sha256:ab","tags":["base:latest"]}}` + "\n", nil, 2},
		{`{"phase":"a"}` + "\n" + `{"error":{"code":"unavailable","message":"mirror down"}}` + "\n", errdefs.ErrUnavailable, 1},
		{`{"phase":"a"}` + "\n", errdefs.ErrUnavailable, 1}, // stream cut before a result
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, tc.body) }))
		c, _ := New(srv.URL, "")
		n := 0
		tpl, err := c.BuildBaseTemplate(context.Background(), func(BuildProgress) { n++ })
		srv.Close()
		if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && (tpl == nil || tpl.Digest != "sha256:ab")) || n != tc.phases {
			t.Errorf("body %q: tpl %v err %v progress %d", tc.body, tpl, err, n)
		}
	}
}

func TestNetworkEventsStream(t *testing.T) {
	var query string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		query = r.URL.RawQuery
		w.Header().Set("Content-Type", "application/x-ndjson")
		io.WriteString(w, `{"seq":3,"time":"2026-01-02T03:04:05Z","protocol":"dns","name":"a.example","verdict":"deny"}`+"\n\n"+
			`{"seq":4,"time":"2026-01-02T03:04:06Z","protocol":"tcp","ip":"1.2.3.4","port":443,"verdict":"allow"}`+"\n")
	}))
	defer srv.Close()
	c, _ := New(srv.URL, testKey)
	var got []api.NetworkEvent
	err := c.NetworkEvents(context.Background(), "sb", 2, true, func(ev api.NetworkEvent) error { got = append(got, ev); return nil })
	if err != nil || len(got) != 2 || got[0].Name != "a.example" || got[1].Port != 443 || query != "after=2&follow=true" {
		t.Fatalf("%v %+v %q", err, got, query)
	}
	stop := errors.New("enough")
	if err := c.NetworkEvents(context.Background(), "sb", 0, false, func(api.NetworkEvent) error { return stop }); err != stop || query != "" {
		t.Fatalf("fn error: %v %q", err, query)
	}
}
