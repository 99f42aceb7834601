// Package sdk is the Go client of the space REST API (/v1).
//
// A Client has one typed method per route; the JSON bodies are the types of
// package api. Errors returned by the server come back as *APIError, which
// also matches the sentinel error for its code (see ErrNotFound and the
// others in errors.go), so callers write
//
//	if errors.Is(err, sdk.ErrNotFound) { … }
//
// on either side of the wire. Command sessions are streamed over WebSocket
// by Attach (see Session) and Run.
package sdk

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// DefaultURL is where a local `space server` listens unless told otherwise.
const DefaultURL = "http://127.0.0.1:7070"

// Bounds on what the client reads from a server, so a broken or hostile
// endpoint cannot make it allocate without limit.
const (
	maxJSONResponse  = 256 << 20 // exec results carry whole outputs
	maxErrorResponse = 64 << 10
)

// Client talks to one space server. Its fields may be set directly; New fills
// them from a base URL that may also be "unix:///path/to/socket".
type Client struct {
	// BaseURL is the server's root, e.g. "http://127.0.0.1:7070". For a unix
	// socket New sets it to "http://unix" and routes HTTP over the socket.
	BaseURL string
	// APIKey is sent as "Authorization: Bearer <APIKey>" when non-empty.
	APIKey string
	// HTTP carries every request, WebSocket handshakes included. It must not
	// set a Timeout: long-polls and streams are bounded by contexts instead.
	HTTP *http.Client
	// UserAgent is sent with every request when non-empty.
	UserAgent string
}

// Option configures a Client built by New.
type Option func(*Client)

// WithHTTPClient replaces the HTTP client (for custom TLS, proxies, tests).
// For a unix base URL its Transport must be an *http.Transport (or nil), whose
// DialContext New then points at the socket.
func WithHTTPClient(h *http.Client) Option { return func(c *Client) { c.HTTP = h } }

// WithUserAgent sets the User-Agent header.
func WithUserAgent(ua string) Option { return func(c *Client) { c.UserAgent = ua } }

// New returns a client for baseURL ("http://host:port", "https://…",
// "unix:///run/space.sock" or "unix:/run/space.sock").
func New(baseURL, apiKey string, opts ...Option) (*Client, error) {
	c := &Client{APIKey: apiKey}
	for _, o := range opts {
		o(c)
	}
	if c.HTTP == nil {
		c.HTTP = &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	}
	if baseURL == "" {
		baseURL = DefaultURL
	}
	if sock, ok := unixSocketPath(baseURL); ok {
		if sock == "" {
			return nil, fmt.Errorf("base URL %q: empty unix socket path: %w", baseURL, errdefs.ErrInvalidArgument)
		}
		tr, err := unixTransport(c.HTTP, sock)
		if err != nil {
			return nil, err
		}
		h := *c.HTTP
		h.Transport = tr
		c.HTTP = &h
		c.BaseURL = "http://unix"
		return c, nil
	}
	u, err := url.Parse(baseURL)
	if err != nil {
		return nil, fmt.Errorf("base URL %q: %w: %w", baseURL, err, errdefs.ErrInvalidArgument)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("base URL %q: want http://host:port, https://host or unix:///path: %w", baseURL, errdefs.ErrInvalidArgument)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("base URL %q: must not carry a query or fragment: %w", baseURL, errdefs.ErrInvalidArgument)
	}
	c.BaseURL = strings.TrimRight(u.String(), "/")
	return c, nil
}

func unixSocketPath(base string) (string, bool) {
	switch {
	case strings.HasPrefix(base, "unix://"):
		return strings.TrimPrefix(base, "unix://"), true
	case strings.HasPrefix(base, "unix:"):
		return strings.TrimPrefix(base, "unix:"), true
	}
	return "", false
}

func unixTransport(h *http.Client, sock string) (*http.Transport, error) {
	var tr *http.Transport
	switch t := h.Transport.(type) {
	case nil:
		tr = http.DefaultTransport.(*http.Transport).Clone()
	case *http.Transport:
		tr = t.Clone()
	default:
		return nil, fmt.Errorf("unix socket base URL needs an *http.Transport, have %T: %w", h.Transport, errdefs.ErrInvalidArgument)
	}
	var d net.Dialer
	tr.Proxy = nil
	tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		return d.DialContext(ctx, "unix", sock)
	}
	return tr, nil
}

// APIError is a non-2xx answer of the server. It unwraps to the sentinel
// error of its Code, so errors.Is(err, sdk.ErrNotFound) works.
type APIError struct {
	Status  int    // HTTP status
	Code    string // stable code, one of api.Code… (e.g. api.CodeNotFound)
	Message string
}

func (e *APIError) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("%s (HTTP %d)", e.Code, e.Status)
	}
	return fmt.Sprintf("%s (%s)", e.Message, e.Code)
}

// Unwrap returns the sentinel error for e.Code (ErrNotFound, …), or nil
// for codes without one.
func (e *APIError) Unwrap() error { return errdefs.FromCode(e.Code) }

// decodeError turns a non-2xx response into an *APIError.
func decodeError(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorResponse))
	var e api.Error
	if err := json.Unmarshal(body, &e); err == nil && e.Error.Code != "" {
		return &APIError{Status: resp.StatusCode, Code: e.Error.Code, Message: e.Error.Message}
	}
	msg := strings.TrimSpace(string(body))
	if len(msg) > 512 {
		msg = msg[:512] + "…"
	}
	if msg == "" {
		msg = http.StatusText(resp.StatusCode)
	}
	return &APIError{Status: resp.StatusCode, Code: api.CodeForStatus(resp.StatusCode), Message: msg}
}

// request is one API call.
type request struct {
	method      string
	path        string // already escaped, starting with "/"
	query       url.Values
	body        io.Reader
	contentType string
	json        any // marshalled as the body when non-nil
	auth        string
}

func (c *Client) url(path string, q url.Values) string {
	u := c.BaseURL + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	return u
}

// send performs r and returns the response when its status is 2xx; any other
// status is decoded into an *APIError and the body closed.
func (c *Client) send(ctx context.Context, r request) (*http.Response, error) {
	body, ctype := r.body, r.contentType
	if r.json != nil {
		b, err := json.Marshal(r.json)
		if err != nil {
			return nil, fmt.Errorf("encoding %s %s request: %w", r.method, r.path, err)
		}
		body, ctype = bytes.NewReader(b), "application/json"
	}
	req, err := http.NewRequestWithContext(ctx, r.method, c.url(r.path, r.query), body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", r.method, r.path, err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	auth := r.auth
	if auth == "" {
		auth = c.APIKey
	}
	if auth != "" {
		req.Header.Set("Authorization", "Bearer "+auth)
	}
	if c.UserAgent != "" {
		req.Header.Set("User-Agent", c.UserAgent)
	}
	if k, ok := ctx.Value(idempotencyKey{}).(string); ok && r.method == http.MethodPost && r.path == "/v1/sandboxes" {
		req.Header.Set(api.IdempotencyKeyHeader, k)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", r.method, r.path, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	return resp, nil
}

// do performs r and decodes a JSON response into out (nil: discard).
func (c *Client) do(ctx context.Context, r request, out any) error {
	resp, err := c.send(ctx, r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorResponse))
		return nil
	}
	dec := json.NewDecoder(io.LimitReader(resp.Body, maxJSONResponse))
	if err := dec.Decode(out); err != nil {
		return fmt.Errorf("decoding %s %s response: %w", r.method, r.path, err)
	}
	return nil
}

// seg escapes one path segment (ids, template refs such as "base:latest").
func seg(s string) string { return url.PathEscape(s) }

// Health calls GET /healthz (no auth).
func (c *Client) Health(ctx context.Context) error {
	var out struct {
		OK bool `json:"ok"`
	}
	if err := c.do(ctx, request{method: http.MethodGet, path: "/healthz"}, &out); err != nil {
		return err
	}
	if !out.OK {
		return fmt.Errorf("server reports not healthy: %w", errdefs.ErrUnavailable)
	}
	return nil
}

// OpenAPI fetches the server's OpenAPI document (GET /openapi.yaml).
func (c *Client) OpenAPI(ctx context.Context) ([]byte, error) {
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/openapi.yaml"})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(io.LimitReader(resp.Body, maxJSONResponse))
}

// Info is GET /v1/info.
func (c *Client) Info(ctx context.Context) (*api.Info, error) {
	var out api.Info
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/info"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// retryable reports whether a failed poll is worth repeating.
func retryable(err error) bool {
	return errors.Is(err, errdefs.ErrUnavailable) || errors.Is(err, errdefs.ErrTimeout)
}

// sleepCtx waits d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
