package server

// What a cluster's API replica (internal/replica) shares with the server,
// exported one small piece at a time: the replica imports the server, never
// the other way round, and answers in the server's shapes (errors, JSON,
// time limits, the route table).

import (
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"time"

	"github.com/spacehq/space/api"
)

// WriteError answers err as the server does (writeError: the one place
// errors become HTTP).
func WriteError(w http.ResponseWriter, r *http.Request, err error) { writeError(w, r, err) }

// WriteJSON answers v as JSON with status.
func WriteJSON(w http.ResponseWriter, status int, v any) { writeJSON(w, status, v) }

// DecodeJSON reads a request's bounded JSON body into v as a server
// handler does (unknown fields and trailing data refused).
func DecodeJSON(w http.ResponseWriter, r *http.Request, v any) error { return decodeJSON(w, r, v) }

// NewHTTPServer is an http.Server for h with the server's connection time
// limits (headers 10 s, kept-alive idle 2 min; no overall deadline).
func NewHTTPServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: headerTimeout, IdleTimeout: idleTimeout}
}

// StatusRecorder wraps w so that status tells the status it answered with
// (0 before any).
func StatusRecorder(w http.ResponseWriter) (_ http.ResponseWriter, status func() int) {
	sw := &statusWriter{ResponseWriter: w}
	return sw, func() int { return sw.code }
}

// HostRoute reports whether host (a Host header) names a sandbox port,
// <port>-<id>.<anything>, as the server routes it.
func HostRoute(host string) (id, port string, ok bool) { return hostRoute(host) }

// RequestScheme is the scheme r's caller used ("http" or "https").
func RequestScheme(r *http.Request) string { return requestScheme(r) }

// LoadOrCreateAPIKey reads dir/api-key, or makes it (0600) and says so on
// notice.
func LoadOrCreateAPIKey(dir string, notice *os.File) (string, error) {
	return loadOrCreateAPIKey(dir, notice)
}

// NewMCPHandler is the stateless MCP handler (POST /mcp) whose tool calls
// go, as the caller's key, to the handler behind self.
func NewMCPHandler(self func() http.RoundTripper, logger *slog.Logger) http.Handler {
	return newMCPHandler(self, logger)
}

// SelfConn is a handler's in-process connection to itself (selfConn),
// for the MCP handler's tool calls.
type SelfConn struct{ c selfConn }

// NewSelfConn is a connection to the http.Server serve makes, started on
// first use.
func NewSelfConn(serve func() *http.Server) *SelfConn { return &SelfConn{c: selfConn{serve: serve}} }

// Transport is the connection's RoundTripper (an error after Close).
func (c *SelfConn) Transport() http.RoundTripper { return c.c.transport() }

// Close stops the in-process server, if it was started.
func (c *SelfConn) Close() { c.c.close() }

// Query parameters, parsed as the server's handlers parse them.

// WaitParam is a request's ?wait= long-poll (at most 60 s; 0 when absent).
func WaitParam(r *http.Request) (time.Duration, error) { return waitParam(r) }

// LabelFilter is a list's label=key=value filters.
func LabelFilter(q url.Values) (map[string]string, error) { return labelFilter(q) }

// ParseBool is a boolean parameter named name ("" is false).
func ParseBool(q, name string) (bool, error) { return parseBool(q, name) }

// TruncateQuery shortens a caller's value for an error message.
func TruncateQuery(s string) string { return truncateQuery(s) }

// MaxSecretBody bounds PUT /v1/secrets/{name}.
const MaxSecretBody = maxSecretBody

// SecretValue is the one value of a set-secret request (value or
// value_base64).
func SecretValue(req api.SetSecretRequest) ([]byte, error) { return secretValue(req) }
