package server

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/templatesvc"
	"github.com/spacehq/space/internal/testenv"
)

// netServer is a Server over the fake runtime and a FakeNetwork, served
// over real HTTP; done receives once per finished request to the events
// route.
type netServer struct {
	s    *Server
	netw *sandbox.FakeNetwork
	url  string
	done chan string
}

func newNetServer(t *testing.T) *netServer {
	t.Helper()
	testenv.RequireRoot(t) // template imports keep ownership
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), log)
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	if _, err := tmpl.ImportDir(context.Background(), src, template.ImportOptions{Tags: []string{"tiny:latest"}, Source: "dir"}); err != nil {
		t.Fatal(err)
	}
	rt := fakeruntime.New(runtime.Config{DataDir: filepath.Join(dir, "fake"), AgentBinary: testenv.AgentBinary(t)})
	netw := sandbox.NewFakeNetwork()
	keys := testKeyStore(t, db, "sk_test_key_1234567890")
	tenants := &tenantsOf{keys: keys}
	mgr := sandbox.New(sandbox.Config{DB: db, Templates: tmpl, Runtimes: map[string]runtime.Runtime{fakeruntime.Name: rt},
		Logger: log, BaseTemplateRef: "tiny:latest", Network: netw, Tenants: tenants})
	tenants.tsvc = templatesvc.New(templatesvc.Config{Templates: tmpl, Sandboxes: mgr.TemplateUsers(), Logger: log, Owners: keys})
	s := &Server{cfg: Config{Logger: log}, db: db, tmpl: tmpl, mgr: mgr, metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890",
		keys: keys, tmplsvc: tenants.tsvc, audit: audit.Nop{}, portSecret: []byte("0123456789abcdef0123456789abcdef")}
	withKeys(t, s)
	s.handler = s.routes()
	ns := &netServer{s: s, netw: netw, done: make(chan string, 16)}
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.handler.ServeHTTP(w, r)
		if strings.HasSuffix(r.URL.Path, "/network/events") {
			ns.done <- r.URL.RawQuery
		}
	}))
	ns.url = hs.URL
	t.Cleanup(func() {
		ctx := context.Background()
		sbs, _ := db.ListSandboxes(ctx, store.SandboxFilter{})
		for _, sb := range sbs {
			if op, err := mgr.Verbs().Lifecycle(ctx, sb.ID, api.OpDelete, true); err == nil {
				mgr.Verbs().Wait(ctx, op.ID)
			}
		}
		hs.Close()
		mgr.Close()
		tmpl.Close()
		db.Close()
	})
	return ns
}

func (ns *netServer) do(t *testing.T, ctx context.Context, method, path, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, method, ns.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+ns.s.apiKey)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// call does a JSON request and decodes the answer into out, checking status.
func (ns *netServer) call(t *testing.T, method, path, body string, status int, out any) {
	t.Helper()
	resp := ns.do(t, context.Background(), method, path, body)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("%s %s: status %d, want %d: %s", method, path, resp.StatusCode, status, b)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, b)
		}
	}
}

func (ns *netServer) create(t *testing.T, body string) string {
	t.Helper()
	var res api.CreateSandboxResponse
	ns.call(t, "POST", "/v1/sandboxes", body, http.StatusAccepted, &res)
	op, err := ns.s.mgr.Verbs().Wait(context.Background(), res.Operation.ID)
	if err != nil || op.State != api.OpSucceeded {
		t.Fatalf("create: %v %+v", err, op.Error)
	}
	return res.Sandbox.ID
}

func TestNetworkRoutes(t *testing.T) {
	ns := newNetServer(t)
	id := ns.create(t, `{"network":{"allow_out":["pypi.org"]}}`)
	var info api.NetworkInfo
	ns.call(t, "GET", "/v1/sandboxes/"+id+"/network", "", 200, &info)
	if !info.Attached || !reflect.DeepEqual(info.Policy.AllowOut, []string{"pypi.org"}) || info.Address == "" {
		t.Fatalf("get %+v", info)
	}
	var sb api.Sandbox
	ns.call(t, "GET", "/v1/sandboxes/"+id, "", 200, &sb)
	if sb.Network == nil || sb.Network.AllowOut[0] != "pypi.org" {
		t.Fatalf("sandbox network %+v", sb.Network)
	}

	info = api.NetworkInfo{}
	ns.call(t, "PUT", "/v1/sandboxes/"+id+"/network", `{"internet":true,"deny_out":["10.0.0.0/8"]}`, 200, &info)
	want := api.NetworkPolicy{Internet: true, DenyOut: []string{"10.0.0.0/8"}}
	if !reflect.DeepEqual(info.Policy, want) || !info.Attached {
		t.Fatalf("put answered %+v", info)
	}
	if got, _ := ns.netw.Policy(id); !reflect.DeepEqual(got, want) {
		t.Fatalf("gateway has %+v", got)
	}

	for _, tc := range []struct{ body, field string }{
		{`{"allow_outt":["x"]}`, `allow_outt`},
		{`{"allow_out":"pypi.org"}`, `allow_out`},
		{`{"rules":[{"domain":"a.b","set_headers":{"X":1}}]}`, `set_headers`},
		{``, `empty`},
	} {
		var e api.Error
		ns.call(t, "PUT", "/v1/sandboxes/"+id+"/network", tc.body, 400, &e)
		if e.Error.Code != api.CodeInvalidArgument || !strings.Contains(e.Error.Message, tc.field) {
			t.Errorf("body %q: %+v", tc.body, e)
		}
	}
	if got, _ := ns.netw.Policy(id); !reflect.DeepEqual(got, want) {
		t.Fatalf("a refused body changed the policy: %+v", got)
	}

	var e api.Error
	ns.call(t, "GET", "/v1/sandboxes/sb-nosuchsandbox1/network", "", 404, &e)
	ns.call(t, "PUT", "/v1/sandboxes/sb-nosuchsandbox1/network", `{}`, 404, &e)
	ns.call(t, "GET", "/v1/sandboxes/sb-nosuchsandbox1/network/events", "", 404, &e)
	ns.call(t, "GET", "/v1/sandboxes/"+id+"/network/events?after=-1", "", 400, &e)
	if !strings.Contains(e.Error.Message, "after") {
		t.Fatalf("bad after: %+v", e)
	}
	ns.call(t, "GET", "/v1/sandboxes/"+id+"/network/events?follow=maybe", "", 400, &e)
}

// readEvents reads NDJSON events from resp until it ends or n are read.
func readEvents(t *testing.T, resp *http.Response, n int) []api.NetworkEvent {
	t.Helper()
	if ct := resp.Header.Get("Content-Type"); ct != "application/x-ndjson" {
		t.Fatalf("content type %q", ct)
	}
	var out []api.NetworkEvent
	sc := bufio.NewScanner(resp.Body)
	for len(out) < n && sc.Scan() {
		var ev api.NetworkEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		out = append(out, ev)
	}
	return out
}

func TestNetworkEventsStream(t *testing.T) {
	ns := newNetServer(t)
	id := ns.create(t, `{}`)
	first := ns.netw.Push(id, api.NetworkEvent{Time: time.Now().UTC(), Protocol: "dns", Name: "evil.example", Verdict: api.VerdictDeny, Reason: "not allowed"})
	ns.netw.Push(id, api.NetworkEvent{Time: time.Now().UTC(), Protocol: "tcp", IP: "1.2.3.4", Port: 443, Verdict: api.VerdictAllow})

	// Without follow: the buffered events, then the end.
	resp := ns.do(t, context.Background(), "GET", "/v1/sandboxes/"+id+"/network/events", "")
	evs := readEvents(t, resp, 10)
	resp.Body.Close()
	if len(evs) != 2 || evs[0].Name != "evil.example" || evs[1].Port != 443 {
		t.Fatalf("events %+v", evs)
	}
	resp = ns.do(t, context.Background(), "GET", "/v1/sandboxes/"+id+"/network/events?after="+jsonNum(first.Seq), "")
	evs = readEvents(t, resp, 10)
	resp.Body.Close()
	if len(evs) != 1 || evs[0].Verdict != api.VerdictAllow {
		t.Fatalf("events after %d: %+v", first.Seq, evs)
	}
	<-ns.done
	<-ns.done

	// With follow: new events arrive as they happen; the stream ends when
	// the client goes away.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp = ns.do(t, ctx, "GET", "/v1/sandboxes/"+id+"/network/events?follow=true&after=2", "")
	defer resp.Body.Close()
	go func() {
		time.Sleep(50 * time.Millisecond)
		ns.netw.Push(id, api.NetworkEvent{Protocol: "udp", Verdict: api.VerdictDrop})
	}()
	evs = readEvents(t, resp, 1)
	if len(evs) != 1 || evs[0].Protocol != "udp" || evs[0].Seq != 3 {
		t.Fatalf("followed %+v", evs)
	}
	cancel()
	select {
	case q := <-ns.done:
		if !strings.Contains(q, "follow") {
			t.Fatalf("finished request %q", q)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a followed stream did not end after its client went away")
	}
}

func jsonNum(n uint64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
