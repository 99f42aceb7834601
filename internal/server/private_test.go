package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
)

// TestTenantBoundaryAllowPrivate: a sandbox's allow_private (the private
// ranges its names may lead into) must lie inside its tenant's boundary's;
// a boundary without one refuses it, naming the field; the API keeps the
// field as written; a bad entry is a 400 naming it.
func TestTenantBoundaryAllowPrivate(t *testing.T) {
	ns := newNetServer(t)
	k := ns.newKey(t, "team-p", "sandbox:write", "network:write")
	ns.call(t, "PUT", "/v1/tenants/team-p", `{"boundary":{"allow_out":["*.internal.example"]}}`, http.StatusOK, nil)

	pol := `{"allow_out":["db.internal.example"],"allow_private":["10.1.0.0/16"]}`
	code, body := ns.as(t, k.Key, "POST", "/v1/sandboxes", `{"network":`+pol+`}`)
	if code != http.StatusBadRequest || !strings.Contains(body, `network.allow_private[0] \"10.1.0.0/16\"`) || !strings.Contains(body, "boundary") {
		t.Fatalf("create with allow_private outside a boundary without one: %d %s", code, body)
	}
	ns.call(t, "PUT", "/v1/tenants/team-p", `{"boundary":{"allow_out":["*.internal.example"],"allow_private":["10.0.0.0/8"]}}`, http.StatusOK, nil)
	code, body = ns.as(t, k.Key, "POST", "/v1/sandboxes", `{"network":`+pol+`}`)
	if code != http.StatusAccepted {
		t.Fatalf("create inside the boundary: %d %s", code, body)
	}
	var res api.CreateSandboxResponse
	json.Unmarshal([]byte(body), &res)
	ns.s.mgr.Verbs().Wait(t.Context(), res.Operation.ID)
	var info api.NetworkInfo
	ns.call(t, "GET", "/v1/sandboxes/"+res.Sandbox.ID+"/network", "", http.StatusOK, &info)
	if got := info.Policy.AllowPrivate; len(got) != 1 || got[0] != "10.1.0.0/16" {
		t.Fatalf("stored allow_private %v", got)
	}
	// A live update beyond the boundary's range is refused.
	code, body = ns.as(t, k.Key, "PUT", "/v1/sandboxes/"+res.Sandbox.ID+"/network", `{"allow_out":["db.internal.example"],"allow_private":["192.168.0.0/16"]}`)
	if code != http.StatusBadRequest || !strings.Contains(body, "allow_private[0]") {
		t.Fatalf("live update outside the boundary: %d %s", code, body)
	}
	// Narrowing the boundary under the sandbox's allow_private is refused.
	code, body = ns.as(t, ns.s.apiKey, "PUT", "/v1/tenants/team-p", `{"boundary":{"allow_out":["*.internal.example"]}}`)
	if code != http.StatusConflict || !strings.Contains(body, res.Sandbox.ID) {
		t.Fatalf("narrowing the boundary under a sandbox: %d %s", code, body)
	}
	// Invalid entries are 400s naming the field.
	for _, bad := range []string{`["db.internal.example"]`, `["10.0.0.0/8:5432"]`, `["8.8.8.0/24"]`} {
		code, body := ns.as(t, ns.s.apiKey, "POST", "/v1/sandboxes", `{"network":{"allow_private":`+bad+`}}`)
		if code != http.StatusBadRequest || !strings.Contains(body, "network.allow_private[0]") {
			t.Errorf("allow_private %s: %d %s", bad, code, body)
		}
	}
}
