package mcpserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// Resource URIs. A sandbox is space://sandboxes/{id}; a command's recent
// output is space://sandboxes/{id}/commands/{command_id}/output.
const (
	uriPrefix          = "space://sandboxes/"
	sandboxTemplate    = uriPrefix + "{id}"
	outputTemplate     = uriPrefix + "{id}/commands/{command_id}/output"
	resourceOutputTail = DefaultOutputBytes // bytes of each stream an output resource shows
)

func (t *tools) addResources(s *mcp.Server) {
	s.AddResourceTemplate(&mcp.ResourceTemplate{
		Name:        "sandbox",
		Title:       "Sandbox state",
		Description: "One sandbox as JSON: state, runtime, isolation, limits, network policy, labels, error.",
		MIMEType:    "application/json",
		URITemplate: sandboxTemplate,
	}, t.readResource)
	s.AddResourceTemplate(&mcp.ResourceTemplate{
		Name:  "command-output",
		Title: "Command output",
		Description: fmt.Sprintf("The recent output of one command (the last %d KiB of stdout and of stderr still "+
			"buffered) and its state or exit code, as text.", resourceOutputTail>>10),
		MIMEType:    "text/plain",
		URITemplate: outputTemplate,
	}, t.readResource)
	// resources/list is the running sandboxes, asked of the server at each
	// call: a fixed list registered up front would be stale at once.
	s.AddReceivingMiddleware(func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			if method != "resources/list" {
				return next(ctx, method, req)
			}
			return t.listResources(ctx)
		}
	})
}

func (t *tools) listResources(ctx context.Context) (*mcp.ListResourcesResult, error) {
	sbs, err := t.c.ListSandboxes(ctx, sdk.ListOptions{State: api.StateRunning})
	if err != nil {
		return nil, fmt.Errorf("listing sandboxes: %w", err)
	}
	out := &mcp.ListResourcesResult{Resources: []*mcp.Resource{}}
	for _, sb := range sbs {
		if len(out.Resources) == MaxListSandboxes {
			break
		}
		out.Resources = append(out.Resources, &mcp.Resource{
			URI: uriPrefix + sb.ID, Name: sb.ID, MIMEType: "application/json",
			Title:       fmt.Sprintf("sandbox %s (%s, %s)", sb.ID, sb.Runtime, sb.State),
			Description: "State of sandbox " + sb.ID + " (template " + sb.Template + ")",
		})
	}
	return out, nil
}

// parseURI splits a resource URI into a sandbox id and, for an output
// resource, a command id.
func parseURI(uri string) (id, cmdID string, ok bool) {
	rest, found := strings.CutPrefix(uri, uriPrefix)
	if !found || rest == "" {
		return "", "", false
	}
	parts := strings.Split(rest, "/")
	switch {
	case len(parts) == 1:
		return parts[0], "", true
	case len(parts) == 4 && parts[1] == "commands" && parts[3] == "output" && parts[0] != "" && parts[2] != "":
		return parts[0], parts[2], true
	}
	return "", "", false
}

func (t *tools) readResource(ctx context.Context, req *mcp.ReadResourceRequest) (*mcp.ReadResourceResult, error) {
	uri := req.Params.URI
	id, cmdID, ok := parseURI(uri)
	if !ok {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	if cmdID == "" {
		sb, err := t.c.GetSandbox(ctx, id)
		if errors.Is(err, sdk.ErrNotFound) || errors.Is(err, sdk.ErrInvalidArgument) {
			return nil, mcp.ResourceNotFoundError(uri)
		}
		if err != nil {
			return nil, err
		}
		b, err := json.MarshalIndent(sandboxInfo(sb), "", "  ")
		if err != nil {
			return nil, err
		}
		return &mcp.ReadResourceResult{Contents: []*mcp.ResourceContents{{URI: uri, MIMEType: "application/json", Text: string(b)}}}, nil
	}
	out, err := t.readOutput(ctx, id, cmdID, 0, 0, MaxOutputBytes, 0)
	if errors.Is(err, sdk.ErrNotFound) || errors.Is(err, sdk.ErrInvalidArgument) {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	if err != nil {
		return nil, err
	}
	// The newest bytes are what a reader of "recent output" wants.
	var cutOut, cutErr int
	out.Stdout, cutOut = tail(out.Stdout)
	out.Stderr, cutErr = tail(out.Stderr)
	txt := outputText(id, out)
	if cutOut+cutErr > 0 {
		txt = fmt.Sprintf("(the last %d KiB of each stream; %d stdout and %d stderr bytes before them are left out — the command_output tool pages through all of it)\n",
			resourceOutputTail>>10, cutOut, cutErr) + txt
	}
	return &mcp.ReadResourceResult{Contents: []*mcp.ResourceContents{{URI: uri, MIMEType: "text/plain", Text: txt}}}, nil
}

// tail keeps the last resourceOutputTail bytes of s (from a rune boundary)
// and says how many it cut.
func tail(s string) (string, int) {
	if len(s) <= resourceOutputTail {
		return s, 0
	}
	cut := len(s) - resourceOutputTail
	for cut < len(s) && !isRuneStart(s[cut]) {
		cut++
	}
	return s[cut:], cut
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }
