package server

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/mcpserver"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/sdk"
)

// maxMCPBody bounds one MCP request (a JSON-RPC message): room for
// file_write's largest content, base64-encoded, and its envelope.
const maxMCPBody = mcpserver.MaxWriteBytes*4/3 + 1<<20

// mcpHandler serves the MCP server (package mcpserver) over streamable HTTP
// at /mcp. The route is behind the API key like /v1; each request gets its
// own MCP server whose SDK client carries that request's key and calls this
// server's own handler in process (selfConn), so a tool call is the same
// API request, authorised, limited, counted and logged the same way, as if
// the caller had made it directly.
//
// Stateless: no MCP session outlives its HTTP request, so nothing ties a
// later request to an earlier caller's key, and a server restart loses no
// session state a client would have to recover.
func (s *Server) mcpHandler() http.Handler {
	return newMCPHandler(s.selfTransport, s.cfg.Logger)
}

// newMCPHandler is the stateless MCP handler whose tools call, as the
// request's key, the handler behind self (a server's own, or a replica's).
func newMCPHandler(self func() http.RoundTripper, logger *slog.Logger) http.Handler {
	cache := mcp.NewSchemaCache()
	opts := &mcp.StreamableHTTPOptions{Stateless: true, MaxRequestBodyBytes: maxMCPBody,
		// The library refuses a request that reached a loopback address
		// under another Host (DNS rebinding against keyless local
		// servers). Here every request needs the API key, which a
		// rebinding page does not have, and that check would refuse a
		// reverse proxy on the same host that keeps the public Host.
		DisableLocalhostProtection: true}
	if logger != nil {
		// The MCP library logs every session's start and end at Info; one
		// per request here, so only its warnings and errors are kept.
		opts.Logger = slog.New(minLevel{slog.LevelWarn, logger.Handler()}).With("component", "mcp")
	}
	return mcp.NewStreamableHTTPHandler(func(r *http.Request) *mcp.Server {
		key, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		// The Host the caller used, so port_expose's URLs are the ones it
		// can reach (the in-process transport ignores the address).
		host := r.Host
		if host == "" || strings.ContainsAny(host, "/?#@ ") {
			host = "localhost"
		}
		c, err := sdk.New("http://"+host, key, sdk.WithHTTPClient(&http.Client{Transport: self()}), sdk.WithUserAgent("space-mcp"))
		if err != nil {
			return nil // the handler answers 400
		}
		return mcpserver.New(c, mcpserver.Options{Version: sandbox.Version, SchemaCache: cache, Logger: opts.Logger})
	}, opts)
}

// minLevel drops records below its level.
type minLevel struct {
	min slog.Level
	slog.Handler
}

func (h minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

func (h minLevel) WithAttrs(a []slog.Attr) slog.Handler {
	return minLevel{h.min, h.Handler.WithAttrs(a)}
}
func (h minLevel) WithGroup(n string) slog.Handler { return minLevel{h.min, h.Handler.WithGroup(n)} }

// selfConn is a handler's in-process connection to itself: an http.Server
// (made by serve) on an in-memory listener, started on first use. A real
// listener would have to be found (TCP or unix socket, wherever the server
// was told to listen) and would cost a socket per call; this needs neither
// and still carries everything a socket does (streamed responses, the
// attach WebSocket's upgrade).
type selfConn struct {
	serve  func() *http.Server
	mu     sync.Mutex
	l      *memListener
	hs     *http.Server
	tr     *http.Transport
	closed bool
}

func (s *Server) selfTransport() http.RoundTripper { return s.self.transport() }

func (c *selfConn) transport() http.RoundTripper {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errTransport{}
	}
	if c.tr == nil {
		c.l = newMemListener()
		c.hs = c.serve()
		go c.hs.Serve(c.l)
		l := c.l
		c.tr = &http.Transport{
			DialContext:         func(ctx context.Context, _, _ string) (net.Conn, error) { return l.dial(ctx) },
			MaxIdleConnsPerHost: 16,
		}
	}
	return c.tr
}

// closeSelf stops the in-process server, if it was started, and any later
// use of it fails.
func (s *Server) closeSelf() { s.self.close() }

func (c *selfConn) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.hs != nil {
		c.tr.CloseIdleConnections()
		c.hs.Close()
	}
}

// errTransport is the in-process transport after Close.
type errTransport struct{}

func (errTransport) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("server is shutting down: %w", errdefs.ErrUnavailable)
}

// memListener is a net.Listener whose connections are in-memory pipes.
type memListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newMemListener() *memListener {
	return &memListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *memListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *memListener) Addr() net.Addr { return memAddr{} }

// dial returns the client end of a new pipe whose server end Accept hands
// out.
func (l *memListener) dial(ctx context.Context) (net.Conn, error) {
	client, server := net.Pipe()
	select {
	case l.conns <- server:
		return client, nil
	case <-l.done:
	case <-ctx.Done():
	}
	client.Close()
	server.Close()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	return nil, net.ErrClosed
}

type memAddr struct{}

func (memAddr) Network() string { return "memory" }
func (memAddr) String() string  { return "space-self" }
