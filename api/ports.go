package api

import "time"

// PortInfo is GET /v1/sandboxes/{id}/ports/{port}: how to reach a service
// listening on that port inside the sandbox, through the server.
type PortInfo struct {
	Port int `json:"port"`
	// URL is host-routed: http://<port>-<id>.<domain>/ (the form E2B's
	// getHost returns). Any request whose Host has that shape is proxied.
	URL string `json:"url"`
	// PathURL is path-routed: <server>/v1/sandboxes/{id}/ports/{port}/.
	PathURL string `json:"path_url"`
	// Token is the sandbox's access token: send it as the header
	// X-Space-Port-Token or the query parameter space_token (then kept in
	// a cookie for that host), or use the API key. Not needed when Public.
	Token  string `json:"token"`
	Public bool   `json:"public"`
	// TokenExpiresAt is when Token stops working (GET …?ttl=, default
	// 24h); ask again for a fresh one.
	TokenExpiresAt *time.Time `json:"token_expires_at,omitempty"`
}

// PortSettings is the body of PUT /v1/sandboxes/{id}/ports/{port}.
type PortSettings struct {
	// Public makes the port reachable without the access token.
	Public bool `json:"public"`
}

// Ingress credentials.
const (
	// PortTokenHeader carries a sandbox's access token.
	PortTokenHeader = "X-Space-Port-Token"
	// PortTokenQuery is the query parameter form of the access token.
	PortTokenQuery = "space_token"
	// PortTokenCookie keeps a token given in the query for later requests.
	PortTokenCookie = "space_port_token"
)
