package server

import "github.com/spacehq/space/internal/actions"

// FrontDoorActions is, for every route of the server's table, the policy
// action kinds a request to it can cause. None of them is decided here:
// files in sandbox.FileSession, exec and command start in the manager's
// exec path, lifecycle verbs in Verbs.Lifecycle and Verbs.Fork, ports
// in Networking.DialPort (every connection in) and Networking.SetPortPublic. The list
// exists so that a new route must say what it does (TestEveryRouteSaysItsActions)
// and the e2e front-door matrix must try each pair (e2e/frontdoor_test.go).
// An empty list: the route causes no action a policy rule decides
// (metadata, administration, the policy itself).
var FrontDoorActions = func() map[string][]string {
	files := func(kinds ...string) []string { return kinds }
	m := map[string][]string{
		"POST /mcp": {actions.Exec, actions.FileRead, actions.FileWrite, actions.FileDelete, actions.Lifecycle},

		"DELETE /v1/sandboxes/{id}":               {actions.Lifecycle},
		"POST /v1/sandboxes/{id}/exec":            {actions.Exec},
		"POST /v1/sandboxes/{id}/exec/stream":     {actions.Exec},
		"POST /v1/sandboxes/{id}/commands":        {actions.Exec},
		"GET /v1/sandboxes/{id}/files":            files(actions.FileRead),
		"PUT /v1/sandboxes/{id}/files":            files(actions.FileWrite),
		"DELETE /v1/sandboxes/{id}/files":         files(actions.FileDelete),
		"GET /v1/sandboxes/{id}/files/stat":       files(actions.FileRead),
		"GET /v1/sandboxes/{id}/files/list":       files(actions.FileRead),
		"POST /v1/sandboxes/{id}/files/mkdir":     files(actions.FileWrite),
		"POST /v1/sandboxes/{id}/files/rename":    files(actions.FileDelete, actions.FileWrite),
		"GET /v1/sandboxes/{id}/files/tar":        files(actions.FileRead),
		"PUT /v1/sandboxes/{id}/files/tar":        files(actions.FileWrite),
		"GET /v1/sandboxes/{id}/files/watch":      files(actions.FileRead),
		"PUT /v1/sandboxes/{id}/ports/{port}":     {actions.Port},
		"POST /v1/sandboxes/{id}/{verb}":          nil, // unknown verbs: refused before any action
		"GET /v1/sandboxes/{id}/ports/{port}/tcp": {actions.Port},
	}
	for _, verb := range lifecycleVerbs {
		m["POST /v1/sandboxes/{id}/"+verb] = []string{actions.Lifecycle}
	}
	for _, meth := range proxyMethods {
		m[meth+" /v1/sandboxes/{id}/ports/{port}/{path...}"] = []string{actions.Port}
	}
	for _, p := range []string{
		"GET /healthz", "GET /openapi.yaml", "GET /metrics", "GET /v1/info",
		"POST /v1/sandboxes", "GET /v1/sandboxes", "GET /v1/sandboxes/{id}", "GET /v1/operations/{id}",
		"GET /v1/sandboxes/{id}/commands", "GET /v1/sandboxes/{id}/commands/{cid}",
		"POST /v1/sandboxes/{id}/commands/{cid}/signal", "POST /v1/sandboxes/{id}/commands/{cid}/token",
		"GET /v1/sandboxes/{id}/commands/{cid}/attach", "GET /v1/sandboxes/{id}/stats",
		"GET /v1/sandboxes/{id}/network", "PUT /v1/sandboxes/{id}/network", "GET /v1/sandboxes/{id}/network/events",
		"GET /v1/sandboxes/{id}/ports/{port}",
		"GET /v1/sandboxes/{id}/secrets", "PUT /v1/sandboxes/{id}/secrets/{name}", "DELETE /v1/sandboxes/{id}/secrets/{name}",
		"GET /v1/secrets", "PUT /v1/secrets/{name}", "GET /v1/secrets/{name}", "DELETE /v1/secrets/{name}",
		"GET /v1/policy/rules", "GET /v1/policy/rules/{scope}", "PUT /v1/policy/rules/{scope}", "DELETE /v1/policy/rules/{scope}",
		"GET /v1/approvals", "POST /v1/approvals/{id}/approve", "POST /v1/approvals/{id}/deny",
		"GET /v1/templates", "POST /v1/templates", "POST /v1/templates/base", "POST /v1/templates/pull",
		"POST /v1/templates/build", "POST /v1/templates/gc", "GET /v1/templates/{ref}", "DELETE /v1/templates/{ref}",
		"POST /v1/templates/{ref}/tags", "GET /v1/templates/{ref}/export",
		"POST /v1/keys", "GET /v1/keys", "DELETE /v1/keys/{keyid}", "GET /v1/tenants", "GET /v1/tenants/{name}", "PUT /v1/tenants/{name}",
		"GET /v1/pools", "PUT /v1/pools", "GET /v1/pools/{id}", "DELETE /v1/pools/{id}",
		"GET /v1/audit", "GET /v1/audit/export", "GET /v1/audit/key",
	} {
		if _, dup := m[p]; !dup {
			m[p] = nil
		}
	}
	return m
}()
