package replica

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacehq/space/internal/e2b"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// own is the replica's handler of each route of the server's table it
// serves itself (ServeHere), fans out (FanOut), or forwards to the
// sandbox's node in its own way (ForwardToNode with more to do than a
// proxy: a lost node's row, a deletion recorded first, a move on wake).
// Those routes' keys are checked with the table's scope before the
// handler; the public ones (no key) are plain handlers.
func (r *Replica) own() map[string]any {
	// MCP: the same tools as a node's, whose calls come back to this
	// replica (and so reach every node).
	mcpH := server.NewMCPHandler(r.self.Transport, r.cfg.Logger)
	return map[string]any{
		"GET /healthz": http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			server.WriteJSON(w, 200, map[string]bool{"ok": true})
		}),
		"GET /metrics":                    promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{}),
		"POST /mcp":                       handlerFunc(func(w http.ResponseWriter, req *http.Request, _ principal.Principal) { mcpH.ServeHTTP(w, req) }),
		"GET /v1/info":                    handlerFunc(r.nodeAdmin.info),
		"POST /v1/sandboxes":              handlerFunc(r.sandboxes.create),
		"GET /v1/sandboxes":               handlerFunc(r.sandboxes.list),
		"GET /v1/sandboxes/{id}":          handlerFunc(r.sandboxes.get),
		"DELETE /v1/sandboxes/{id}":       handlerFunc(r.sandboxes.delete),
		"POST /v1/sandboxes/{id}/wake":    handlerFunc(r.sandboxes.wake),
		"GET /v1/operations/{id}":         handlerFunc(r.sandboxes.operation),
		"POST /v1/keys":                   handlerFunc(r.keys.createKey),
		"GET /v1/keys":                    handlerFunc(r.keys.listKeys),
		"DELETE /v1/keys/{keyid}":         handlerFunc(r.keys.revokeKey),
		"GET /v1/tenants":                 handlerFunc(r.settings.listTenants),
		"GET /v1/tenants/{name}":          handlerFunc(r.settings.getTenant),
		"PUT /v1/tenants/{name}":          handlerFunc(r.settings.putTenant),
		"GET /v1/policy/rules":            handlerFunc(r.settings.listRules),
		"GET /v1/policy/rules/{scope}":    handlerFunc(r.settings.getRules),
		"PUT /v1/policy/rules/{scope}":    handlerFunc(r.settings.putRules),
		"DELETE /v1/policy/rules/{scope}": handlerFunc(r.settings.deleteRules),
		"GET /v1/templates":               handlerFunc(r.templates.list),
		"GET /v1/templates/{ref}":         handlerFunc(r.templates.read),
		"GET /v1/templates/{ref}/export":  handlerFunc(r.templates.read),
		"POST /v1/templates":              handlerFunc(r.templates.write),
		"POST /v1/templates/pull":         handlerFunc(r.templates.write),
		"POST /v1/templates/build":        handlerFunc(r.templates.write),
		"GET /v1/pools":                   handlerFunc(r.pools.list),
		"PUT /v1/pools":                   handlerFunc(r.pools.put),
		"GET /v1/pools/{id}":              handlerFunc(r.pools.get),
		"DELETE /v1/pools/{id}":           handlerFunc(r.pools.delete),
		"GET /v1/approvals":               handlerFunc(r.approvals.list),
		"POST /v1/approvals/{id}/approve": handlerFunc(r.approvals.answer),
		"POST /v1/approvals/{id}/deny":    handlerFunc(r.approvals.answer),
		"GET /v1/secrets":                 handlerFunc(r.secrets.list),
		"GET /v1/secrets/{name}":          handlerFunc(r.secrets.get),
		"PUT /v1/secrets/{name}":          handlerFunc(r.secrets.set),
		"DELETE /v1/secrets/{name}":       handlerFunc(r.secrets.delete),
		"GET /v1/audit":                   handlerFunc(r.nodeAdmin.nodeAudit),
		"GET /v1/audit/export":            handlerFunc(r.nodeAdmin.nodeAudit),
		"GET /v1/audit/key":               handlerFunc(r.nodeAdmin.nodeAudit),
	}
}

// refuse answers a route a replica does not serve (Refuse, and any path
// no route names).
func refuse(w http.ResponseWriter, req *http.Request) {
	server.WriteError(w, req, fmt.Errorf("%s %s is not served by a cluster replica (it serves sandboxes, their operations, templates, warm pools, keys, tenants, policy rules, approvals, secrets, nodes and their audit logs); call a node's own API for the rest: %w",
		req.Method, req.URL.Path, errdefs.ErrNotSupported))
}

// tableHandler is the replica's handler of one route of the server's
// table, as its disposition says; an error names a route the replica
// cannot serve as marked.
func (r *Replica) tableHandler(rt server.Route, own map[string]any) (http.Handler, error) {
	h, mine := own[rt.Pattern]
	switch rt.Cluster {
	case server.Refuse:
		if mine {
			return nil, fmt.Errorf("route %s is marked %s but the replica has a handler for it", rt.Pattern, rt.Cluster)
		}
		return http.HandlerFunc(refuse), nil
	case server.ForwardToNode:
		if !mine {
			return r.sandboxes.toNode(rt.KeyChecked), nil
		}
	case server.ServeHere, server.FanOut:
		if !mine {
			return nil, fmt.Errorf("route %s is marked %s but the replica has no handler for it", rt.Pattern, rt.Cluster)
		}
	default:
		return nil, fmt.Errorf("route %s has no cluster disposition", rt.Pattern)
	}
	switch h := h.(type) {
	case handlerFunc:
		if !rt.KeyChecked {
			return nil, fmt.Errorf("route %s: the replica checks a key the server's table does not ask for", rt.Pattern)
		}
		return r.keys.authed(rt.Scope, h), nil
	case http.Handler:
		if rt.KeyChecked {
			return nil, fmt.Errorf("route %s: the server's table asks for a key the replica's handler does not check", rt.Pattern)
		}
		return h, nil
	}
	return nil, fmt.Errorf("route %s: handler %T", rt.Pattern, h)
}

// mux is the replica's routes: each of the server's table as its
// disposition says, then the replica's own.
func (r *Replica) mux() (*http.ServeMux, error) {
	mux := http.NewServeMux()
	own := r.own()
	for _, rt := range server.Routes() {
		h, err := r.tableHandler(rt, own)
		if err != nil {
			return nil, err
		}
		mux.Handle(rt.Pattern, h)
		delete(own, rt.Pattern)
	}
	for p := range own {
		return nil, fmt.Errorf("the replica has a handler for %s, which is not a route of the server's table", p)
	}
	// Any other call under a sandbox goes to its node, which answers it
	// as it would.
	mux.HandleFunc("/v1/sandboxes/{id}/{rest...}", r.sandboxes.anyCall)
	// An approval's answer other than approve or deny is refused as the
	// replica always has (404, naming the two).
	mux.HandleFunc("POST /v1/approvals/{id}/{verb}", r.keys.authed(principal.ScopePolicyWrite, r.approvals.answer))
	// The cluster's own routes.
	mux.HandleFunc("GET /v1/nodes", r.keys.authed(principal.ScopeAdmin, r.nodeAdmin.list))
	mux.HandleFunc("POST /v1/nodes/{node}/drain", r.keys.authed(principal.ScopeAdmin, r.nodeAdmin.drain))
	mux.HandleFunc("POST /v1/nodes/{node}/undrain", r.keys.authed(principal.ScopeAdmin, r.nodeAdmin.drain))
	mux.HandleFunc("GET /v1/audit/heads", r.keys.authed(principal.ScopeAdmin, r.nodeAdmin.auditHeads))
	mux.HandleFunc("DELETE /v1/audit/heads/{node}", r.keys.authed(principal.ScopeAdmin, r.nodeAdmin.forgetAuditHead))
	// E2B's API: control plane and envd, each call to its sandbox's node.
	mux.HandleFunc(e2b.Prefix+"/", r.e2b.serve)
	mux.HandleFunc(e2b.SignedFilesPath, r.e2b.serve)
	mux.HandleFunc("/", refuse)
	return mux, nil
}

// Handler is the replica's API.
func (r *Replica) Handler() http.Handler {
	mux, err := r.mux()
	if err != nil {
		// The server's table and the replica disagree: a build that
		// TestReplicaServesEveryRouteAsMarked fails.
		panic(err)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		sw, status := server.StatusRecorder(w)
		defer func() { r.requests.WithLabelValues(req.Method, strconv.Itoa(status())).Inc() }()
		// Host-routed port traffic (<port>-<id>.<domain>) goes to the
		// sandbox's node with its Host, as a node's own would be served.
		if id, _, ok := server.HostRoute(req.Host); ok {
			r.sandboxes.hostCall(sw, req, id)
			return
		}
		mux.ServeHTTP(sw, req)
	})
}
