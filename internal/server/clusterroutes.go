package server

// Disposition says what a cluster's API replica (internal/replica), which
// holds no sandbox, does with a route of the table. The zero value is no
// disposition: every route must have one (TestEveryRouteHasADisposition).
type Disposition int

const (
	// ServeHere: the replica's own handler answers, from PostgreSQL or
	// itself, or through the one node it chooses (placement, a holder of
	// the template, a ready node, the node ?node= names).
	ServeHere Disposition = iota + 1
	// ForwardToNode: proxied to the node the path's sandbox row names,
	// which checks the call as on a single box.
	ForwardToNode
	// FanOut: asked of every ready node; the answers are merged, or the
	// first node that holds the thing answers.
	FanOut
	// Refuse: answered 422 (not supported) with the routes a replica
	// serves; the caller must ask a node's own API.
	Refuse
)

func (d Disposition) String() string {
	switch d {
	case ServeHere:
		return "serve here"
	case ForwardToNode:
		return "forward to the sandbox's node"
	case FanOut:
		return "fan out to every node"
	case Refuse:
		return "refuse"
	}
	return "no disposition"
}

// Route is one route of the server's table as a cluster replica needs it.
type Route struct {
	Pattern string // "METHOD /path", as the mux writes it
	// KeyChecked: the caller's API key is checked (with Scope) before the
	// handler; otherwise the route is public or carries its own token,
	// which the handler checks.
	KeyChecked bool
	Scope      string // what the key must hold; "" = any valid key
	Cluster    Disposition
}

// Routes is the server's route table (routeTable) without its handlers:
// it builds the table over an empty Server whose handlers it drops, never
// calls.
func Routes() []Route {
	rs := (&Server{metrics: newMetrics(nil)}).routeTable()
	out := make([]Route, 0, len(rs))
	for _, rt := range rs {
		out = append(out, Route{Pattern: rt.pattern, KeyChecked: rt.access == apiKey, Scope: rt.scope, Cluster: rt.cluster})
	}
	return out
}
