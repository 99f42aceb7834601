package e2b

import (
	"net/http"

	"github.com/spacehq/space/internal/actions"
)

// FrontDoorActions is, for every route this handler serves, the policy
// action kinds a request to it can cause, as server.FrontDoorActions is for
// space's own API. None is decided here: files in sandbox.FileSession, a
// process start in the manager's exec path, lifecycle verbs in
// sandbox.Verbs (kill, pause, connect's wake, fork, a deadline brought
// closer). A new route must say what it does (TestEveryRouteSaysItsActions)
// and the e2e front-door matrix must try each route that can cause one
// (e2e/frontdoor_routes_test.go). An empty list: the route causes no action
// a policy rule decides.
var FrontDoorActions = func() map[string][]string {
	fs := EnvdPrefix + "/filesystem.Filesystem/"
	proc := EnvdPrefix + "/process.Process/"
	m := map[string][]string{
		"DELETE " + Prefix + "/sandboxes/{id}":          {actions.Lifecycle},
		"POST " + Prefix + "/sandboxes/{id}/timeout":    {actions.Lifecycle},
		"POST " + Prefix + "/sandboxes/{id}/refreshes":  {actions.Lifecycle},
		"POST " + Prefix + "/sandboxes/{id}/pause":      {actions.Lifecycle},
		"POST " + Prefix + "/v2/sandboxes/{id}/connect": {actions.Lifecycle},
		"POST " + Prefix + "/sandboxes/{id}/resume":     {actions.Lifecycle},
		"POST " + Prefix + "/sandboxes/{id}/fork":       {actions.Lifecycle},
		"POST " + fs + "Stat":                           {actions.FileRead},
		"POST " + fs + "ListDir":                        {actions.FileRead},
		"POST " + fs + "MakeDir":                        {actions.FileWrite},
		"POST " + fs + "Move":                           {actions.FileDelete, actions.FileWrite},
		"POST " + fs + "Remove":                         {actions.FileDelete},
		"POST " + fs + "WatchDir":                       {actions.FileRead},
		"POST " + fs + "CreateWatcher":                  {actions.FileRead},
		"GET " + EnvdPrefix + "/files":                  {actions.FileRead},
		"POST " + EnvdPrefix + "/files":                 {actions.FileWrite},
		"GET " + SignedFilesPath:                        {actions.FileRead},
		"POST " + SignedFilesPath:                       {actions.FileWrite},
		"POST " + proc + "Start":                        {actions.Exec},
	}
	for _, p := range []string{
		"POST " + Prefix + "/v2/sandboxes", "POST " + Prefix + "/sandboxes", "GET " + Prefix + "/v2/sandboxes",
		"GET " + Prefix + "/sandboxes", "GET " + Prefix + "/sandboxes/{id}", "GET " + Prefix + "/sandboxes/{id}/metrics",
		// The network policy is the caller's to set, as PUT /v1/…/network.
		"PUT " + Prefix + "/sandboxes/{id}/network",
		// A snapshot's fork is the platform's own, as a template commit
		// from a sandbox is through space's API.
		"POST " + Prefix + "/sandboxes/{id}/snapshots",
		"GET " + Prefix + "/snapshots", "DELETE " + Prefix + "/templates/{id}", Prefix + "/",
		"POST " + fs + "GetWatcherEvents", "POST " + fs + "RemoveWatcher",
		// Commands already started: attach, input, signals, the PTY size.
		"POST " + proc + "Connect", "POST " + proc + "List", "POST " + proc + "SendInput", "POST " + proc + "SendSignal",
		"POST " + proc + "Update", "POST " + proc + "CloseStdin", "POST " + proc + "StreamInput",
		"GET " + EnvdPrefix + "/health", EnvdPrefix + "/", SignedFilesPath,
	} {
		m[p] = nil
	}
	return m
}()

// route registers fn for pattern and remembers the pattern, so a test can
// hold every route to FrontDoorActions.
func (h *Handler) route(pattern string, fn http.HandlerFunc) {
	h.patterns = append(h.patterns, pattern)
	h.mux.HandleFunc(pattern, fn)
}
