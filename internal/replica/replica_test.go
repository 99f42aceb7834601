package replica

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/tenancy"
)

func TestReplicaPassesOnlyTokenRoutesWithoutAKey(t *testing.T) {
	for _, c := range []struct {
		method, rest string
		token        bool
	}{
		{"GET", "commands/cmd-1/attach", true},
		{"POST", "commands/cmd-1/attach", false},
		{"GET", "commands/cmd-1", false},
		{"POST", "commands/cmd-1/token", false},
		{"GET", "ports/8080/tcp", true},
		{"PUT", "ports/8080/x/y", true},
		{"PUT", "ports/8080", false},
		{"POST", "exec", false},
		{"GET", "files", false},
	} {
		if got := tokenRoute(c.method, c.rest); got != c.token {
			t.Errorf("%s %s: token route %v, want %v", c.method, c.rest, got, c.token)
		}
	}
}

func TestIdempotencyKeyFormat(t *testing.T) {
	for _, ok := range []string{"", "a", "create-1", strings.Repeat("x", 128), "A~!#"} {
		if err := checkIdempotencyKey(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{strings.Repeat("x", 129), "a b", "a\tb", "ключ", "a\x00"} {
		if err := checkIdempotencyKey(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: %v, want invalid argument", bad, err)
		}
	}
}

// TestReplicaServesEveryRouteAsMarked sends each route of the server's
// table to a replica over a fake cluster store with two fake nodes (real
// mutual TLS from a test CA) and checks it is served as its disposition
// says: refused with the replica's JSON 422, proxied whole to the node of
// the sandbox its path names (as the caller the replica vouches for, or as
// nobody for a token route), asked of every ready node, or answered by
// the replica's own handler (by itself or through one node it picks).
func TestReplicaServesEveryRouteAsMarked(t *testing.T) {
	ca := t.TempDir()
	if err := clustertls.NewCA(ca, time.Hour); err != nil {
		t.Fatal(err)
	}
	issue := func(role, name string, hosts []string) *clustertls.Identity {
		out := filepath.Join(ca, name)
		if err := clustertls.Issue(ca, role, name, hosts, out, time.Hour); err != nil {
			t.Fatal(err)
		}
		id, err := clustertls.Load(filepath.Join(ca, clustertls.CACertFile), out+".crt", out+".key")
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	st := &fakeStore{key: "sk_test_replica_key_0123456789"}
	calls := map[string]*nodeCalls{}
	for _, name := range []string{"n1", "n2"} {
		tlsCfg, err := issue(clustertls.RoleNode, name, []string{"127.0.0.1"}).ServerConfig()
		if err != nil {
			t.Fatal(err)
		}
		nc := &nodeCalls{}
		ts := httptest.NewUnstartedServer(nc)
		ts.TLS = tlsCfg
		ts.StartTLS()
		t.Cleanup(ts.Close)
		calls[name] = nc
		st.nodes = append(st.nodes, clusterstore.Node{NodeStatus: clusterstore.NodeStatus{ID: name, Address: ts.URL, Templates: []string{"base:latest"}}, State: clusterstore.NodeReady})
	}
	r := assemble(Config{Logger: slog.New(slog.DiscardHandler)}, st.parts(), issue(clustertls.RoleReplica, "r1", nil))
	t.Cleanup(r.Close)
	mux, err := r.mux()
	if err != nil {
		t.Fatal(err)
	}
	h := r.Handler()

	fill := strings.NewReplacer("{id}", "sb-aaaaaaaaaaaaaaaa", "{cid}", "cmd-aaaaaaaaaaaaaaaa", "{ref}", "base:latest",
		"{port}", "8000", "{path...}", "some/path", "{name}", "default", "{scope}", "server", "{keyid}", "key-1", "{verb}", "frobnicate")
	seen := map[server.Disposition]int{}
	for _, rt := range server.Routes() {
		seen[rt.Cluster]++
		method, pattern, _ := strings.Cut(rt.Pattern, " ")
		path := fill.Replace(pattern)
		req := httptest.NewRequest(method, path+"?node=n1", strings.NewReader("{}"))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+st.key)
		if _, got := mux.Handler(req); got != rt.Pattern {
			t.Errorf("%s %s is served by the replica's %q, not its own route", method, path, got)
			continue
		}
		for _, nc := range calls {
			nc.reset()
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var e api.Error
		refused := rec.Code == http.StatusUnprocessableEntity && json.Unmarshal(rec.Body.Bytes(), &e) == nil &&
			e.Error.Code == api.CodeNotSupported && strings.Contains(e.Error.Message, "is not served by a cluster replica")
		got := calls["n1"].all()
		asked := len(got)
		if len(calls["n2"].all()) > 0 {
			asked++
		}
		switch rt.Cluster {
		case server.Refuse:
			if !refused || asked != 0 {
				t.Errorf("%s (refuse): %d %s, %d nodes asked; want the replica's JSON 422 and no node", rt.Pattern, rec.Code, rec.Body, asked)
			}
		case server.ForwardToNode:
			if len(got) != 1 || got[0].method != method || got[0].path != path || len(calls["n2"].all()) != 0 || rec.Header().Get("Space-Node") != "n1" {
				t.Errorf("%s (forward): %d %s; node n1 got %+v, n2 %+v; want the call whole at n1 only", rt.Pattern, rec.Code, rec.Body, got, calls["n2"].all())
				continue
			}
			if rt.KeyChecked != (got[0].principal && !got[0].authorization) {
				t.Errorf("%s (forward): principal vouched %v, key passed on %v; want the caller vouched for (never the key) exactly when the route takes a key", rt.Pattern, got[0].principal, got[0].authorization)
			}
		case server.FanOut:
			if refused || len(got) != 1 || len(calls["n2"].all()) != 1 {
				t.Errorf("%s (fan out): %d %s; n1 got %+v, n2 %+v; want one call at each ready node", rt.Pattern, rec.Code, rec.Body, got, calls["n2"].all())
			}
		case server.ServeHere:
			if refused || rec.Code == http.StatusUnauthorized || asked > 1 {
				t.Errorf("%s (serve here): %d %s, %d nodes asked; want the replica's own answer", rt.Pattern, rec.Code, rec.Body, asked)
			}
		default:
			t.Errorf("%s has no cluster disposition", rt.Pattern)
		}
	}
	for _, d := range []server.Disposition{server.ServeHere, server.ForwardToNode, server.FanOut, server.Refuse} {
		if seen[d] == 0 {
			t.Errorf("no route is marked %s", d)
		}
	}
	// A table route the replica serves by a key checks the table's scope.
	req := httptest.NewRequest(http.MethodGet, "/v1/keys", nil)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusUnauthorized {
		t.Errorf("GET /v1/keys without a key: %d", rec.Code)
	}
}

// nodeCall is what a fake node saw of one call.
type nodeCall struct {
	method, path             string
	principal, authorization bool
}

// nodeCalls is a fake node: it records each call and answers {} (404 to
// the lookups a fan-out must ask every node, so each is asked).
type nodeCalls struct {
	mu    sync.Mutex
	calls []nodeCall
}

func (n *nodeCalls) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	io.Copy(io.Discard, req.Body)
	n.mu.Lock()
	n.calls = append(n.calls, nodeCall{req.Method, req.URL.Path, req.Header.Get(server.PrincipalHeader) != "", req.Header.Get("Authorization") != ""})
	n.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if strings.HasPrefix(req.URL.Path, "/v1/operations/") || (req.Method == http.MethodPost && strings.HasPrefix(req.URL.Path, "/v1/approvals/")) {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"error":{"code":"not_found","message":"not here"}}`)
		return
	}
	fmt.Fprint(w, `{}`)
}

func (n *nodeCalls) reset() { n.mu.Lock(); n.calls = nil; n.mu.Unlock() }

func (n *nodeCalls) all() []nodeCall {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]nodeCall(nil), n.calls...)
}

// fakeStore is a cluster of ready nodes, one admin key, and one running
// sandbox on the first node; writes succeed and store nothing.
type fakeStore struct {
	key   string
	nodes []clusterstore.Node
}

// parts gives the fake as every part of the store (each through the
// replica's narrow interfaces for that part).
func (f *fakeStore) parts() storeParts {
	return storeParts{nodes: f, sandboxes: f, keys: f, settings: f, secrets: f, audit: f}
}

var errFake = fmt.Errorf("not in the fake store: %w", errdefs.ErrNotFound)

func (f *fakeStore) Nodes(context.Context) ([]clusterstore.Node, error) { return f.nodes, nil }
func (f *fakeStore) GetSandbox(_ context.Context, id string) (clusterstore.Sandbox, error) {
	return clusterstore.Sandbox{ID: id, Node: f.nodes[0].ID, Tenant: "default", State: api.StateRunning}, nil
}
func (f *fakeStore) PlaceExcept(_ context.Context, _ string, _ int64, _ time.Duration, exclude []string) (clusterstore.Node, error) {
	return f.nodes[len(exclude)%len(f.nodes)], nil
}
func (f *fakeStore) Keys(context.Context, string) ([]api.APIKey, error) {
	return []api.APIKey{{ID: "key-1", Name: "admin", Tenant: "default", Scopes: []string{"admin"}}}, nil
}
func (f *fakeStore) LiveKey(_ context.Context, digest string) (api.APIKey, error) {
	if digest != tenancy.Digest(f.key) {
		return api.APIKey{}, fmt.Errorf("unknown key: %w", errdefs.ErrUnauthorized)
	}
	return api.APIKey{ID: "key-1", Name: "admin", Tenant: "default", Scopes: []string{"admin"}}, nil
}
func (f *fakeStore) AddFirstKey(context.Context, api.APIKey, string) (bool, error) { return false, nil }
func (f *fakeStore) AddKey(context.Context, api.APIKey, string) error              { return nil }
func (f *fakeStore) RevokeKey(context.Context, string) (api.APIKey, error) {
	return api.APIKey{}, errFake
}
func (f *fakeStore) Tenant(_ context.Context, name string) (api.Tenant, error) {
	return api.Tenant{Name: name}, nil
}
func (f *fakeStore) CountSandboxes(context.Context, string) (int, error) { return 1, nil }
func (f *fakeStore) Sandboxes(context.Context, string) ([]clusterstore.Sandbox, error) {
	return nil, nil
}
func (f *fakeStore) SandboxByKey(context.Context, string, string) (clusterstore.Sandbox, error) {
	return clusterstore.Sandbox{}, errFake
}
func (f *fakeStore) SetDesired(context.Context, string, string) error        { return nil }
func (f *fakeStore) ClaimMove(context.Context, string, string, string) error { return errFake }
func (f *fakeStore) EndMove(context.Context, string, string, string, error) error {
	return nil
}
func (f *fakeStore) Settings(context.Context) (clusterstore.Settings, error) {
	return clusterstore.Settings{}, nil
}
func (f *fakeStore) PutTenant(context.Context, api.Tenant) error         { return nil }
func (f *fakeStore) PutRules(context.Context, api.PolicyRuleSet) error   { return nil }
func (f *fakeStore) DeleteRules(context.Context, string) error           { return nil }
func (f *fakeStore) Drain(context.Context, string, string) error         { return nil }
func (f *fakeStore) Undrain(context.Context, string) error               { return nil }
func (f *fakeStore) ForgetAuditHead(context.Context, string) error       { return nil }
func (f *fakeStore) PutPool(context.Context, string, api.PoolSpec) error { return nil }
func (f *fakeStore) DeletePool(context.Context, string) error            { return nil }
func (f *fakeStore) AuditHeads(context.Context) ([]clusterstore.AuditHead, error) {
	return nil, nil
}
func (f *fakeStore) PutSecret(context.Context, string, string, []string, string, func(int) ([]byte, error)) (clusterstore.Secret, bool, error) {
	return clusterstore.Secret{}, false, errFake
}
func (f *fakeStore) Secrets(context.Context, string) ([]clusterstore.Secret, error) { return nil, nil }
func (f *fakeStore) GetSecret(context.Context, string, string) (clusterstore.Secret, error) {
	return clusterstore.Secret{}, errFake
}
func (f *fakeStore) DeleteSecret(context.Context, string, string) error { return nil }
