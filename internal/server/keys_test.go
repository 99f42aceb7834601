package server

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// as does a request with key and returns the status and body.
func (ns *netServer) as(t *testing.T, key, method, path, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, ns.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (ns *netServer) newKey(t *testing.T, tenant string, scopes ...string) api.CreatedKey {
	t.Helper()
	b, _ := json.Marshal(api.CreateKeyRequest{Name: "k-" + tenant, Tenant: tenant, Scopes: scopes})
	var k api.CreatedKey
	ns.call(t, "POST", "/v1/keys", string(b), http.StatusCreated, &k)
	if !strings.HasPrefix(k.Key, "sk_") || k.ID == "" || k.Tenant != tenant {
		t.Fatalf("created key %+v", k)
	}
	return k
}

func errCode(t *testing.T, body string) string {
	t.Helper()
	var e api.Error
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("not an error body: %s", body)
	}
	return e.Error.Code
}

// TestTenantsSeeOnlyTheirOwn: a key acts for its tenant only; another
// tenant's sandbox answers 404 on every route, exactly as a missing one,
// and a missing scope answers 403.
func TestTenantsSeeOnlyTheirOwn(t *testing.T) {
	ns := newNetServer(t)
	a := ns.newKey(t, "team-a", "sandbox:write", "exec:write")
	b := ns.newKey(t, "team-b", "sandbox:write", "exec:write", "files:write", "network:write")

	code, body := ns.as(t, a.Key, "POST", "/v1/sandboxes", `{}`)
	if code != http.StatusAccepted {
		t.Fatalf("create as team-a: %d %s", code, body)
	}
	var res api.CreateSandboxResponse
	json.Unmarshal([]byte(body), &res)
	id := res.Sandbox.ID
	if res.Sandbox.Tenant != "team-a" {
		t.Fatalf("tenant %q, want team-a", res.Sandbox.Tenant)
	}
	if _, err := ns.s.mgr.Verbs().Wait(t.Context(), res.Operation.ID); err != nil {
		t.Fatal(err)
	}

	// Every route naming the sandbox: 404 for team-b, as for a missing id.
	for _, r := range []struct{ method, path, body string }{
		{"GET", "/v1/sandboxes/" + id, ""},
		{"DELETE", "/v1/sandboxes/" + id, ""},
		{"POST", "/v1/sandboxes/" + id + "/stop", ""},
		{"POST", "/v1/sandboxes/" + id + "/exec", `{"argv":["true"]}`},
		{"GET", "/v1/sandboxes/" + id + "/files?path=/etc/hostname", ""},
		{"PUT", "/v1/sandboxes/" + id + "/network", `{}`},
		{"GET", "/v1/operations/" + res.Operation.ID, ""},
	} {
		code, body := ns.as(t, b.Key, r.method, r.path, r.body)
		if code != http.StatusNotFound || errCode(t, body) != api.CodeNotFound {
			t.Errorf("team-b %s %s: %d %s, want 404", r.method, r.path, code, body)
		}
		missing := strings.Replace(r.path, id, "sb-aaaaaaaaaaaaaaaa", 1)
		if strings.Contains(r.path, "/operations/") {
			missing = "/v1/operations/op-aaaaaaaaaaaaaaaa"
		}
		if mcode, _ := ns.as(t, b.Key, r.method, missing, r.body); mcode != code {
			t.Errorf("%s %s: another tenant's sandbox answers %d, a missing one %d", r.method, r.path, code, mcode)
		}
	}
	var list api.SandboxList
	_, body = ns.as(t, b.Key, "GET", "/v1/sandboxes", "")
	json.Unmarshal([]byte(body), &list)
	if len(list.Sandboxes) != 0 {
		t.Errorf("team-b lists %d sandboxes, want none of team-a's", len(list.Sandboxes))
	}
	_, body = ns.as(t, a.Key, "GET", "/v1/sandboxes", "")
	json.Unmarshal([]byte(body), &list)
	if len(list.Sandboxes) != 1 || list.Sandboxes[0].ID != id {
		t.Errorf("team-a lists %+v, want its sandbox", list.Sandboxes)
	}
	// The admin key sees every tenant's.
	ns.call(t, "GET", "/v1/sandboxes/"+id, "", http.StatusOK, nil)

	// Own sandbox, missing scope: 403 naming the scope.
	code, body = ns.as(t, a.Key, "GET", "/v1/sandboxes/"+id+"/files?path=/etc/hostname", "")
	if code != http.StatusForbidden || errCode(t, body) != api.CodePermissionDenied || !strings.Contains(body, "files:read") {
		t.Errorf("files without files:read: %d %s", code, body)
	}
	// Only admin administers keys and tenants; a tenant sees its own tenant.
	if code, body := ns.as(t, a.Key, "POST", "/v1/keys", `{"name":"x","scopes":["admin"]}`); code != http.StatusForbidden {
		t.Errorf("team-a creating a key: %d %s", code, body)
	}
	if code, _ := ns.as(t, a.Key, "GET", "/v1/tenants/team-a", ""); code != http.StatusOK {
		t.Errorf("team-a reading its own tenant: %d", code)
	}
	if code, _ := ns.as(t, a.Key, "GET", "/v1/tenants/team-b", ""); code != http.StatusNotFound {
		t.Errorf("team-a reading team-b: %d, want 404", code)
	}

	// Listing keys never shows a key; revoking one ends it at once.
	var keys api.KeyList
	ns.call(t, "GET", "/v1/keys", "", http.StatusOK, &keys)
	all, _ := json.Marshal(keys)
	if len(keys.Keys) != 3 || strings.Contains(string(all), a.Key) || strings.Contains(string(all), ns.s.apiKey) {
		t.Errorf("key list %s", all)
	}
	ns.call(t, "DELETE", "/v1/keys/"+a.ID, "", http.StatusOK, nil)
	if code, body := ns.as(t, a.Key, "GET", "/v1/sandboxes", ""); code != http.StatusUnauthorized {
		t.Errorf("revoked key: %d %s", code, body)
	}
	// The last admin key cannot be revoked.
	ns.call(t, "GET", "/v1/keys?tenant=default", "", http.StatusOK, &keys)
	code, body = ns.as(t, ns.s.apiKey, "DELETE", "/v1/keys/"+keys.Keys[0].ID, "")
	if code != http.StatusConflict {
		t.Errorf("revoking the last admin key: %d %s", code, body)
	}
	// Bad input names the problem.
	for _, bad := range []string{`{"name":"x","scopes":["root"]}`, `{"name":"x","scopes":[]}`, `{"name":"x","tenant":"Team A","scopes":["admin"]}`, `{"name":"","scopes":["admin"]}`} {
		if code, body := ns.as(t, ns.s.apiKey, "POST", "/v1/keys", bad); code != http.StatusBadRequest {
			t.Errorf("create key %s: %d %s", bad, code, body)
		}
	}
}

// TestTenantQuotas: over quota → 429 saying what is used, for creates and
// forks, and the quota frees up as sandboxes go.
func TestTenantQuotas(t *testing.T) {
	ns := newNetServer(t)
	k := ns.newKey(t, "team-q", "sandbox:write")
	ns.call(t, "PUT", "/v1/tenants/team-q", `{"quotas":{"sandboxes":2,"memory_mib":1040}}`, http.StatusOK, nil)

	create := func(body string) (int, string, api.CreateSandboxResponse) {
		code, b := ns.as(t, k.Key, "POST", "/v1/sandboxes", body)
		var res api.CreateSandboxResponse
		json.Unmarshal([]byte(b), &res)
		if code == http.StatusAccepted {
			ns.s.mgr.Verbs().Wait(t.Context(), res.Operation.ID)
		}
		return code, b, res
	}
	if code, b, _ := create(`{"limits":{"memory_mib":768}}`); code != http.StatusAccepted {
		t.Fatalf("first create: %d %s", code, b)
	}
	code, b, _ := create(`{"limits":{"memory_mib":512}}`)
	if code != http.StatusTooManyRequests || errCode(t, b) != api.CodeQuotaExceeded || !strings.Contains(b, "768 MiB used") {
		t.Fatalf("create over the memory quota: %d %s", code, b)
	}
	code, b, second := create(`{"limits":{"memory_mib":256}}`)
	if code != http.StatusAccepted {
		t.Fatalf("create within quota: %d %s", code, b)
	}
	code, b, _ = create(`{"limits":{"memory_mib":16}}`)
	if code != http.StatusTooManyRequests || !strings.Contains(b, "sandboxes: 2 used") {
		t.Fatalf("create over the sandbox quota: %d %s", code, b)
	}
	var tn api.Tenant
	ns.call(t, "GET", "/v1/tenants/team-q", "", http.StatusOK, &tn)
	if tn.Usage == nil || tn.Usage.Sandboxes != 2 || tn.Usage.MemoryMiB != 1024 {
		t.Errorf("usage %+v", tn.Usage)
	}
	// Another tenant's quota is its own.
	o := ns.newKey(t, "team-o", "sandbox:write")
	if code, b := ns.as(t, o.Key, "POST", "/v1/sandboxes", `{}`); code != http.StatusAccepted {
		t.Errorf("team-o create: %d %s", code, b)
	}
	// Deleting frees the quota.
	code, b = ns.as(t, k.Key, "DELETE", "/v1/sandboxes/"+second.Sandbox.ID+"?force=true", "")
	if code != http.StatusAccepted {
		t.Fatalf("delete: %d %s", code, b)
	}
	var op api.Operation
	json.Unmarshal([]byte(b), &op)
	ns.s.mgr.Verbs().Wait(t.Context(), op.ID)
	if code, b, _ := create(`{"limits":{"memory_mib":256}}`); code != http.StatusAccepted {
		t.Errorf("create after a delete freed the quota: %d %s", code, b)
	}
}

// TestTenantTemplates: a sandbox can be created only from a template its
// tenant sees (shared or its own); another tenant's is not found.
func TestTenantTemplates(t *testing.T) {
	ns := newNetServer(t)
	a := ns.newKey(t, "team-a", "sandbox:write", "templates:write")
	b := ns.newKey(t, "team-b", "sandbox:write", "templates:write")
	if code, body := ns.as(t, a.Key, "POST", "/v1/templates/tiny:latest/tags", `{"tag":"a-app:1"}`); code != http.StatusOK {
		t.Fatalf("team-a tagging the shared template: %d %s", code, body)
	}
	if code, body := ns.as(t, b.Key, "POST", "/v1/sandboxes", `{"template":"a-app:1"}`); code != http.StatusNotFound {
		t.Errorf("team-b creating from team-a's template: %d %s, want 404", code, body)
	}
	if code, body := ns.as(t, b.Key, "GET", "/v1/templates/a-app:1", ""); code != http.StatusNotFound {
		t.Errorf("team-b reading team-a's template: %d %s, want 404", code, body)
	}
	if code, body := ns.as(t, a.Key, "POST", "/v1/sandboxes", `{"template":"a-app:1"}`); code != http.StatusAccepted {
		t.Errorf("team-a creating from its template: %d %s", code, body)
	}
	if code, body := ns.as(t, b.Key, "POST", "/v1/sandboxes", `{"template":"tiny:latest"}`); code != http.StatusAccepted {
		t.Errorf("team-b creating from the shared template: %d %s", code, body)
	}
	if code, body := ns.as(t, b.Key, "POST", "/v1/templates/gc", ""); code != http.StatusForbidden {
		t.Errorf("team-b gc: %d %s, want 403 (admin only)", code, body)
	}
}

// TestPortTokensExpireAndStayInTheirSandbox: a port token opens its own
// sandbox's ports until it expires, never another sandbox's.
func TestPortTokensExpireAndStayInTheirSandbox(t *testing.T) {
	ns := newNetServer(t)
	id1 := ns.create(t, `{}`)
	id2 := ns.create(t, `{}`)
	sb1, _ := ns.s.mgr.Get(t.Context(), id1)
	sb2, _ := ns.s.mgr.Get(t.Context(), id2)
	now := time.Now()
	tok := (portsAPI{ns.s}).portTokenUntil(sb1, now.Add(time.Hour))
	if !(portsAPI{ns.s}).validPortToken(sb1, tok, now) {
		t.Fatal("a fresh token does not open its sandbox")
	}
	if (portsAPI{ns.s}).validPortToken(sb2, tok, now) {
		t.Error("a token opens another sandbox")
	}
	if (portsAPI{ns.s}).validPortToken(sb1, tok, now.Add(time.Hour+time.Second)) {
		t.Error("an expired token still opens its sandbox")
	}
	// Moving the expiry breaks the MAC.
	forged := strings.Replace(tok, fmt.Sprint(now.Add(time.Hour).Unix()), fmt.Sprint(now.Add(100*time.Hour).Unix()), 1)
	if forged == tok || (portsAPI{ns.s}).validPortToken(sb1, forged, now) {
		t.Error("a token with a moved expiry is accepted")
	}
	var pi api.PortInfo
	ns.call(t, "GET", "/v1/sandboxes/"+id1+"/ports/8000?ttl=5m", "", 200, &pi)
	if d := time.Until(*pi.TokenExpiresAt); d < 4*time.Minute || d > 6*time.Minute {
		t.Errorf("ttl=5m token expires in %s", d)
	}
	if code, body := ns.as(t, ns.s.apiKey, "GET", "/v1/sandboxes/"+id1+"/ports/8000?ttl=1000h", ""); code != 400 {
		t.Errorf("ttl=1000h: %d %s", code, body)
	}
}

// TestTenantBoundary: a create or a live update whose policy is not inside
// the tenant's boundary is refused naming the entries outside; a boundary
// an existing sandbox is outside of is refused naming the sandbox.
func TestTenantBoundary(t *testing.T) {
	ns := newNetServer(t)
	k := ns.newKey(t, "team-n", "sandbox:write", "network:write")
	ns.call(t, "PUT", "/v1/tenants/team-n", `{"boundary":{"allow_out":["*.example.com:443","pypi.org"]}}`, http.StatusOK, nil)

	code, body := ns.as(t, k.Key, "POST", "/v1/sandboxes", `{"network":{"allow_out":["api.example.com:443","pypi.org"]}}`)
	if code != http.StatusAccepted {
		t.Fatalf("create inside the boundary: %d %s", code, body)
	}
	var res api.CreateSandboxResponse
	json.Unmarshal([]byte(body), &res)
	ns.s.mgr.Verbs().Wait(t.Context(), res.Operation.ID)
	for _, c := range []struct{ policy, names string }{
		{`{"allow_out":["evil.com"]}`, "evil.com"},
		{`{"internet":true}`, "internet"},
		{`{"allow_out":["api.example.com:443","1.2.3.0/24"]}`, "1.2.3.0/24"},
		{`{"allow_out":["api.example.com"]}`, "api.example.com"},
	} {
		code, body := ns.as(t, k.Key, "POST", "/v1/sandboxes", `{"network":`+c.policy+`}`)
		if code != http.StatusBadRequest || !strings.Contains(body, c.names) || !strings.Contains(body, "boundary") {
			t.Errorf("create with %s: %d %s", c.policy, code, body)
		}
		code, body = ns.as(t, k.Key, "PUT", "/v1/sandboxes/"+res.Sandbox.ID+"/network", c.policy)
		if code != http.StatusBadRequest || !strings.Contains(body, c.names) {
			t.Errorf("live update to %s: %d %s", c.policy, code, body)
		}
	}
	// No policy: the server default (no egress) is inside any boundary.
	if code, body := ns.as(t, k.Key, "POST", "/v1/sandboxes", `{}`); code != http.StatusAccepted {
		t.Errorf("create without a policy: %d %s", code, body)
	}
	// Narrowing the boundary below a live sandbox's policy is refused.
	code, body = ns.as(t, ns.s.apiKey, "PUT", "/v1/tenants/team-n", `{"boundary":{"allow_out":["pypi.org"]}}`)
	if code != http.StatusConflict || !strings.Contains(body, res.Sandbox.ID) {
		t.Errorf("narrowing the boundary under a sandbox: %d %s", code, body)
	}
	// Another tenant has no boundary.
	o := ns.newKey(t, "team-free", "sandbox:write")
	if code, body := ns.as(t, o.Key, "POST", "/v1/sandboxes", `{"network":{"internet":true}}`); code != http.StatusAccepted {
		t.Errorf("team-free: %d %s", code, body)
	}
}
