// Package mcpserver is space's Model Context Protocol server: the tools and
// resources through which an MCP client (the host of a model) creates
// sandboxes, runs commands, reads and writes files, exposes ports and drives
// the lifecycle (suspend, wake, fork, delete).
//
// It is built only over the Go SDK (package sdk), so one implementation
// serves both transports: `space mcp` runs it over stdio with the CLI's
// client, and the server's /mcp route runs it over streamable HTTP with a
// client that carries the caller's API key. Whatever a tool can do, the
// caller could have done through the REST API with the same key.
//
// Everything a model receives is bounded (command output, file reads,
// listings), and every failure is a tool error (a result with IsError and a
// message that says what to do next), never a protocol error: a model sees
// tool errors and can correct itself; protocol errors it usually never sees.
package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/sdk"
)

// Bounds on what a tool returns to the model. A model's context is small
// and expensive: a command that prints a gigabyte must cost it a note, not
// the session.
const (
	// DefaultOutputBytes is how much of each output stream (stdout,
	// stderr) command_run and command_output return unless asked.
	DefaultOutputBytes = 64 << 10
	// MaxOutputBytes is the most a caller may ask for per stream.
	MaxOutputBytes = 1 << 20
	// DefaultReadBytes and MaxReadBytes bound one file_read.
	DefaultReadBytes = 64 << 10
	MaxReadBytes     = 1 << 20
	// MaxWriteBytes bounds one file_write (after base64 decoding).
	MaxWriteBytes = 4 << 20
	// MaxListSandboxes, MaxListCommands and MaxListFiles bound listings.
	MaxListSandboxes = 200
	MaxListCommands  = 200
	MaxListFiles     = 1000
	// MaxListDepth bounds file_list's recursion.
	MaxListDepth = 5
	// MaxWaitSeconds bounds command_output's wait for new output.
	MaxWaitSeconds = 60
	// DefaultRunTimeout and MaxRunTimeout bound command_run: anything
	// longer belongs in command_start.
	DefaultRunTimeout = 60 * time.Second
	MaxRunTimeout     = time.Hour
	// lifecycleTimeout bounds a tool that waits for a lifecycle
	// operation (create, suspend, wake, fork, delete).
	lifecycleTimeout = 10 * time.Minute
)

// Options configures a server built by New.
type Options struct {
	// Version is reported to clients as the server's version ("dev" if
	// empty).
	Version string
	// SchemaCache, when set, shares the tools' JSON schemas between
	// servers: the HTTP handler builds one server per request.
	SchemaCache *mcp.SchemaCache
	// Logger receives the MCP library's own logs; nil: none.
	Logger *slog.Logger
}

// instructions is what a client may show the model about this server as a
// whole.
const instructions = `space runs code in isolated Linux sandboxes. Typical flow: sandbox_create (note the id) →
command_run for short commands, command_start + command_output for long-running ones (servers, builds) →
file_write / file_read / file_list to move files → port_expose to reach a service → sandbox_delete when done.
Sandboxes have no network unless created with a network policy. Outputs are capped; every result says how to
read what was left out.`

// New returns an MCP server whose tools and resources act through c.
func New(c *sdk.Client, opts Options) *mcp.Server {
	if opts.Version == "" {
		opts.Version = "dev"
	}
	s := mcp.NewServer(&mcp.Implementation{Name: "space", Title: "space sandboxes", Version: opts.Version}, &mcp.ServerOptions{
		Instructions: instructions,
		Logger:       opts.Logger,
		SchemaCache:  opts.SchemaCache,
		// No logging capability: nothing here sends log notifications.
		Capabilities: &mcp.ServerCapabilities{},
	})
	t := &tools{c: c}
	t.addSandboxTools(s)
	t.addCommandTools(s)
	t.addFileTools(s)
	t.addResources(s)
	return s
}

// tools holds what every tool handler shares.
type tools struct {
	c *sdk.Client
}

// toolError turns a failed SDK call into the message a model reads: what
// failed, the server's words, and what to do about it.
func toolError(what string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s: timed out (%v); the operation may still finish — check with sandbox_get or command_list", what, err)
	}
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("%s: cancelled", what)
	}
	hint := ""
	switch {
	case errors.Is(err, sdk.ErrNotFound):
		hint = "Check the id: sandbox_list lists sandboxes, command_list a sandbox's commands."
	case errors.Is(err, sdk.ErrNotSupported):
		hint = "This sandbox's runtime cannot do that (see its runtime and isolation with sandbox_get); a sandbox created with another runtime (e.g. runtime \"gvisor\") may."
	case errors.Is(err, sdk.ErrConflict):
		hint = "The sandbox is not in a state that allows this; check its state with sandbox_get."
	case errors.Is(err, sdk.ErrInvalidArgument), errors.Is(err, sdk.ErrUnprocessable):
		hint = "Fix the arguments and call again."
	case errors.Is(err, sdk.ErrTooLarge):
		hint = "Send less at once (split the content, or write it in parts with a command)."
	case errors.Is(err, sdk.ErrUnauthorized):
		hint = "The MCP server's API key is missing or wrong; this needs a configuration change, not a retry."
	case errors.Is(err, sdk.ErrUnavailable), errors.Is(err, sdk.ErrTimeout):
		hint = "This is transient; try again in a few seconds."
	case isUnreachable(err):
		hint = "The space server could not be reached: it must be running (space server) where the MCP server is configured to find it (SPACE_URL)."
	}
	if hint != "" {
		hint = ". " + hint
	}
	// Wrapped, so callers inside this package can still tell the cause.
	return fmt.Errorf("%s: %w%s", what, err, hint)
}

// isUnreachable reports a failure to reach the server at all (as opposed
// to an answer from it).
func isUnreachable(err error) bool {
	var ae *sdk.APIError
	var oe *net.OpError
	return !errors.As(err, &ae) && errors.As(err, &oe)
}

// invalid is a tool error for bad arguments the server never saw.
func invalid(format string, args ...any) error {
	return fmt.Errorf(format+". Fix the arguments and call again.", args...)
}

// text is a result whose content is s (the structured output is added by
// the SDK from the handler's Out value).
func text(s string) *mcp.CallToolResult {
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: s}}}
}

// utf8Cut returns the largest n' <= n such that b[:n'] does not end inside a
// multi-byte UTF-8 sequence, so a cut output stays valid text and the
// offset to resume at stays exact. Bytes that are not UTF-8 at all are
// left alone (the cut moves back at most 3 bytes).
func utf8Cut(b []byte, n int) int {
	if n >= len(b) {
		return len(b)
	}
	for i := n; i > 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i]) {
			return i // b[i] starts a rune: cutting before it is clean
		}
	}
	return n
}

// capture keeps the first limit bytes written to it and counts the rest.
type capture struct {
	limit int
	buf   []byte
	full  bool  // limit reached: later bytes are only counted
	total int64 // every byte written
}

func (c *capture) Write(p []byte) (int, error) {
	c.total += int64(len(p))
	if c.full {
		return len(p), nil
	}
	room := c.limit - len(c.buf)
	if len(p) <= room {
		c.buf = append(c.buf, p...)
		return len(p), nil
	}
	keep := utf8Cut(p, room) // the kept text ends on a rune boundary
	c.buf = append(c.buf, p[:keep]...)
	c.full = true
	return len(p), nil
}

// omitted is how many written bytes were not kept.
func (c *capture) omitted() int64 { return c.total - int64(len(c.buf)) }

// streamText renders one output stream for a text result.
func streamText(name, s string, omitted int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "--- %s", name)
	if omitted > 0 {
		fmt.Fprintf(&b, " (truncated, %d bytes omitted)", omitted)
	}
	b.WriteString(" ---\n")
	if s == "" {
		b.WriteString("(empty)\n")
		return b.String()
	}
	b.WriteString(s)
	if !strings.HasSuffix(s, "\n") {
		b.WriteString("\n")
	}
	return b.String()
}

// boolPtr is for the optional hints of tool annotations.
func boolPtr(b bool) *bool { return &b }
