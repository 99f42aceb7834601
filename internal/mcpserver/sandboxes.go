package mcpserver

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// NetworkIn is the egress policy of a new sandbox.
type NetworkIn struct {
	AllowOut []string `json:"allow_out,omitempty" jsonschema:"destinations the sandbox may connect to: exact domains (pypi.org), wildcards (*.github.com: subdomains only), IPs or CIDRs, each optionally with :port"`
	DenyOut  []string `json:"deny_out,omitempty" jsonschema:"IPs or CIDRs (optionally with :port) that stay unreachable even if allowed otherwise"`
	Internet bool     `json:"internet,omitempty" jsonschema:"allow every public destination (deny_out still applies)"`
	// AllowPrivate is api.NetworkPolicy.AllowPrivate.
	AllowPrivate []string `json:"allow_private,omitempty" jsonschema:"loopback/private IPs or CIDRs the allowed domains may resolve into (e.g. 10.0.0.0/8 for an internal service's name); only within what the server opens"`
}

// SandboxCreateIn is sandbox_create's input.
type SandboxCreateIn struct {
	Template   string            `json:"template,omitempty" jsonschema:"template to start from, as name:tag or sha256:digest; default base:latest (Debian with python3, curl and git)"`
	Runtime    string            `json:"runtime,omitempty" jsonschema:"isolation runtime: auto (default: the strongest this host runs), gvisor, microvm or native. Suspend and fork need gvisor or microvm"`
	CPUs       float64           `json:"cpus,omitempty" jsonschema:"CPU quota in cores, e.g. 0.5 or 2; default the server's"`
	MemoryMiB  int64             `json:"memory_mib,omitempty" jsonschema:"memory limit in MiB; default the server's"`
	Env        map[string]string `json:"env,omitempty" jsonschema:"environment variables of every command in the sandbox"`
	Workdir    string            `json:"workdir,omitempty" jsonschema:"default working directory of commands (absolute path)"`
	Network    *NetworkIn        `json:"network,omitempty" jsonschema:"egress policy; omitted: the template's, else the server's default (normally no network at all)"`
	TTLSeconds int64             `json:"ttl_seconds,omitempty" jsonschema:"delete the sandbox automatically after this many seconds; 0 or omitted: never"`
	Labels     map[string]string `json:"labels,omitempty" jsonschema:"labels to find the sandbox by later (sandbox_list label filter)"`
}

// SandboxInfo is what the sandbox tools return about one sandbox.
type SandboxInfo struct {
	ID        string            `json:"id" jsonschema:"the sandbox id; pass it as id to every other tool"`
	State     string            `json:"state" jsonschema:"creating, running, paused, stopped, suspended, deleting, deleted or error"`
	Runtime   string            `json:"runtime"`
	Isolation string            `json:"isolation" jsonschema:"what isolation the runtime really provides"`
	Template  string            `json:"template,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Workdir   string            `json:"workdir,omitempty"`
	CPUs      float64           `json:"cpus,omitempty"`
	MemoryMiB int64             `json:"memory_mib,omitempty"`
	Network   *NetworkIn        `json:"network,omitempty" jsonschema:"the egress policy in force"`
	Ports     []int             `json:"public_ports,omitempty"`
	Error     string            `json:"error,omitempty" jsonschema:"why the sandbox is in state error"`
	CreatedAt string            `json:"created_at,omitempty"`
	ExpiresAt string            `json:"expires_at,omitempty"`
}

func sandboxInfo(sb *api.Sandbox) SandboxInfo {
	out := SandboxInfo{
		ID: sb.ID, State: sb.State, Runtime: sb.Runtime, Isolation: sb.Isolation, Template: sb.Template,
		Labels: sb.Labels, Workdir: sb.Workdir, CPUs: sb.Limits.CPUs, MemoryMiB: sb.Limits.MemoryMiB,
		Ports: sb.PublicPorts, Error: sb.Error,
	}
	if sb.Network != nil {
		out.Network = &NetworkIn{AllowOut: sb.Network.AllowOut, DenyOut: sb.Network.DenyOut, Internet: sb.Network.Internet, AllowPrivate: sb.Network.AllowPrivate}
	}
	if !sb.CreatedAt.IsZero() {
		out.CreatedAt = sb.CreatedAt.UTC().Format(time.RFC3339)
	}
	if sb.ExpiresAt != nil {
		out.ExpiresAt = sb.ExpiresAt.UTC().Format(time.RFC3339)
	}
	return out
}

// SandboxIDIn is the input of the tools that take only a sandbox id.
type SandboxIDIn struct {
	ID string `json:"id" jsonschema:"the sandbox id (from sandbox_create or sandbox_list)"`
}

// SandboxListIn is sandbox_list's input.
type SandboxListIn struct {
	Label string `json:"label,omitempty" jsonschema:"only sandboxes with this label, written key=value"`
	State string `json:"state,omitempty" jsonschema:"only sandboxes in this state (running, paused, stopped, suspended, error, …)"`
}

// SandboxListOut is sandbox_list's output.
type SandboxListOut struct {
	Sandboxes []SandboxInfo `json:"sandboxes"`
	Total     int           `json:"total" jsonschema:"how many sandboxes matched; more than returned when truncated"`
	Truncated bool          `json:"truncated,omitempty"`
}

// SandboxDeleteOut is sandbox_delete's output.
type SandboxDeleteOut struct {
	ID      string `json:"id"`
	Deleted bool   `json:"deleted"`
}

// SandboxForkIn is sandbox_fork's input.
type SandboxForkIn struct {
	ID    string `json:"id" jsonschema:"the running sandbox to fork"`
	Count int    `json:"count,omitempty" jsonschema:"how many copies, 1 to 16; default 1"`
}

// SandboxForkOut is sandbox_fork's output.
type SandboxForkOut struct {
	Parent   string        `json:"parent"`
	Children []SandboxInfo `json:"children" jsonschema:"the new sandboxes, each running with a copy of the parent's memory and disk"`
}

func (t *tools) addSandboxTools(s *mcp.Server) {
	mcp.AddTool(s, &mcp.Tool{
		Name:  "sandbox_create",
		Title: "Create a sandbox",
		Description: "Create a new isolated Linux sandbox and wait until it is running. Use it before any other tool; " +
			"keep the returned id. By default it has no network access (pass network to allow some) and runs on the " +
			"strongest isolation the host offers. Returns the sandbox's id, state, runtime and isolation.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(false), OpenWorldHint: boolPtr(false)},
	}, t.sandboxCreate)
	mcp.AddTool(s, &mcp.Tool{
		Name:        "sandbox_list",
		Title:       "List sandboxes",
		Description: fmt.Sprintf("List sandboxes (at most %d), optionally only those with a label or in a state. Use it to find ids you lost or to see what is still running.", MaxListSandboxes),
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, t.sandboxList)
	mcp.AddTool(s, &mcp.Tool{
		Name:        "sandbox_get",
		Title:       "Describe a sandbox",
		Description: "Get one sandbox's state, runtime, isolation, limits, network policy and error, if any.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, t.sandboxGet)
	mcp.AddTool(s, &mcp.Tool{
		Name:        "sandbox_delete",
		Title:       "Delete a sandbox",
		Description: "Delete a sandbox and everything in it (processes, files), whatever its state. This cannot be undone.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(true), IdempotentHint: true, OpenWorldHint: boolPtr(false)},
	}, t.sandboxDelete)
	mcp.AddTool(s, &mcp.Tool{
		Name:  "sandbox_suspend",
		Title: "Suspend a sandbox",
		Description: "Save a running sandbox's memory, processes and files to disk and release its resources; it then costs " +
			"nothing until woken. Any later command or file call (or sandbox_wake) brings it back exactly where it was. " +
			"Only some runtimes can do this (gvisor, microvm); others answer with an error saying so.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(false), IdempotentHint: true, OpenWorldHint: boolPtr(false)},
	}, t.lifecycle(api.OpSuspend))
	mcp.AddTool(s, &mcp.Tool{
		Name:        "sandbox_wake",
		Title:       "Wake a sandbox",
		Description: "Bring a suspended, paused or stopped sandbox back to running (whichever way its state allows) and wait for it. A running sandbox stays as it is.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(false), IdempotentHint: true, OpenWorldHint: boolPtr(false)},
	}, t.lifecycle(api.OpWake))
	mcp.AddTool(s, &mcp.Tool{
		Name:  "sandbox_fork",
		Title: "Fork a sandbox",
		Description: "Make copies of a running sandbox: each child continues from the parent's memory and disk at this moment, " +
			"with its own id, hostname and randomness. Use it to try several things from one prepared state. " +
			"Only some runtimes can do this (gvisor, microvm). Returns the children.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(false), OpenWorldHint: boolPtr(false)},
	}, t.sandboxFork)
	mcp.AddTool(s, &mcp.Tool{
		Name:  "port_expose",
		Title: "Expose a port",
		Description: "Get the URL at which a service listening on a TCP port inside the sandbox is reachable through the " +
			"space server (start the service first, e.g. with command_start). Unless public is true, requests need the " +
			"returned token (header X-Space-Port-Token, or ?space_token= in the URL). Pass public to change whether the token is needed.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(false), IdempotentHint: true, OpenWorldHint: boolPtr(false)},
	}, t.portExpose)
}

func (t *tools) sandboxCreate(ctx context.Context, _ *mcp.CallToolRequest, in SandboxCreateIn) (*mcp.CallToolResult, SandboxInfo, error) {
	if in.CPUs < 0 || in.MemoryMiB < 0 || in.TTLSeconds < 0 {
		return nil, SandboxInfo{}, invalid("cpus, memory_mib and ttl_seconds must not be negative")
	}
	req := api.CreateSandboxRequest{
		Template: in.Template, Runtime: in.Runtime, Env: in.Env, Workdir: in.Workdir, Labels: in.Labels, TTLSeconds: in.TTLSeconds,
		Limits: api.Limits{CPUs: in.CPUs, MemoryMiB: in.MemoryMiB},
	}
	if in.Network != nil {
		req.Network = &api.NetworkPolicy{AllowOut: in.Network.AllowOut, DenyOut: in.Network.DenyOut, Internet: in.Network.Internet, AllowPrivate: in.Network.AllowPrivate}
	}
	ctx, cancel := context.WithTimeout(ctx, lifecycleTimeout)
	defer cancel()
	sb, err := t.c.CreateSandboxAndWait(ctx, req)
	if err != nil {
		if sb != nil && sb.ID != "" {
			return nil, SandboxInfo{}, toolError("creating sandbox "+sb.ID+" failed (delete it with sandbox_delete)", err)
		}
		return nil, SandboxInfo{}, toolError("creating a sandbox", err)
	}
	out := sandboxInfo(sb)
	return text(fmt.Sprintf("Sandbox %s is %s (runtime %s, isolation %s). Pass id %q to the other tools.", sb.ID, sb.State, sb.Runtime, sb.Isolation, sb.ID)), out, nil
}

func (t *tools) sandboxList(ctx context.Context, _ *mcp.CallToolRequest, in SandboxListIn) (*mcp.CallToolResult, SandboxListOut, error) {
	opts := sdk.ListOptions{State: in.State}
	if in.Label != "" {
		k, v, ok := strings.Cut(in.Label, "=")
		if !ok || k == "" {
			return nil, SandboxListOut{}, invalid("label %q: write it as key=value", in.Label)
		}
		opts.Labels = map[string]string{k: v}
	}
	sbs, err := t.c.ListSandboxes(ctx, opts)
	if err != nil {
		return nil, SandboxListOut{}, toolError("listing sandboxes", err)
	}
	// Newest first: what a model just made is what it looks for.
	sort.SliceStable(sbs, func(i, j int) bool { return sbs[i].CreatedAt.After(sbs[j].CreatedAt) })
	out := SandboxListOut{Sandboxes: []SandboxInfo{}, Total: len(sbs)}
	for i := range sbs {
		if len(out.Sandboxes) == MaxListSandboxes {
			out.Truncated = true
			break
		}
		out.Sandboxes = append(out.Sandboxes, sandboxInfo(&sbs[i]))
	}
	return nil, out, nil
}

func (t *tools) sandboxGet(ctx context.Context, _ *mcp.CallToolRequest, in SandboxIDIn) (*mcp.CallToolResult, SandboxInfo, error) {
	sb, err := t.c.GetSandbox(ctx, in.ID)
	if err != nil {
		return nil, SandboxInfo{}, toolError("getting sandbox "+in.ID, err)
	}
	return nil, sandboxInfo(sb), nil
}

func (t *tools) sandboxDelete(ctx context.Context, _ *mcp.CallToolRequest, in SandboxIDIn) (*mcp.CallToolResult, SandboxDeleteOut, error) {
	ctx, cancel := context.WithTimeout(ctx, lifecycleTimeout)
	defer cancel()
	op, err := t.c.DeleteSandbox(ctx, in.ID, true)
	if err == nil {
		_, err = t.c.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		return nil, SandboxDeleteOut{}, toolError("deleting sandbox "+in.ID, err)
	}
	return text("Sandbox " + in.ID + " is deleted."), SandboxDeleteOut{ID: in.ID, Deleted: true}, nil
}

// lifecycle is the handler of a verb that takes only an id and ends in
// the sandbox's new state.
func (t *tools) lifecycle(verb string) mcp.ToolHandlerFor[SandboxIDIn, SandboxInfo] {
	return func(ctx context.Context, _ *mcp.CallToolRequest, in SandboxIDIn) (*mcp.CallToolResult, SandboxInfo, error) {
		ctx, cancel := context.WithTimeout(ctx, lifecycleTimeout)
		defer cancel()
		op, err := t.c.Lifecycle(ctx, in.ID, verb)
		if err == nil {
			_, err = t.c.WaitOperation(ctx, op.ID)
		}
		if err != nil {
			return nil, SandboxInfo{}, toolError(verb+" of sandbox "+in.ID, err)
		}
		sb, err := t.c.GetSandbox(ctx, in.ID)
		if err != nil {
			return nil, SandboxInfo{}, toolError("getting sandbox "+in.ID, err)
		}
		return text(fmt.Sprintf("Sandbox %s is %s.", sb.ID, sb.State)), sandboxInfo(sb), nil
	}
}

func (t *tools) sandboxFork(ctx context.Context, _ *mcp.CallToolRequest, in SandboxForkIn) (*mcp.CallToolResult, SandboxForkOut, error) {
	if in.Count < 0 || in.Count > api.MaxForkCount {
		return nil, SandboxForkOut{}, invalid("count must be 1 to %d, got %d", api.MaxForkCount, in.Count)
	}
	ctx, cancel := context.WithTimeout(ctx, lifecycleTimeout)
	defer cancel()
	op, err := t.c.Fork(ctx, in.ID, api.ForkRequest{Count: in.Count})
	if err == nil {
		op, err = t.c.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		return nil, SandboxForkOut{}, toolError("forking sandbox "+in.ID, err)
	}
	out := SandboxForkOut{Parent: in.ID, Children: []SandboxInfo{}}
	ids := make([]string, 0, len(op.Children))
	for _, id := range op.Children {
		sb, err := t.c.GetSandbox(ctx, id)
		if err != nil {
			return nil, SandboxForkOut{}, toolError("getting fork child "+id, err)
		}
		out.Children = append(out.Children, sandboxInfo(sb))
		ids = append(ids, id)
	}
	return text(fmt.Sprintf("Forked %s into %s.", in.ID, strings.Join(ids, ", "))), out, nil
}

// PortExposeIn is port_expose's input.
type PortExposeIn struct {
	ID     string `json:"id" jsonschema:"the sandbox id"`
	Port   int    `json:"port" jsonschema:"the TCP port the service listens on inside the sandbox (1-65535)"`
	Public *bool  `json:"public,omitempty" jsonschema:"true: reachable without the token; false: token required again; omitted: unchanged"`
}

// PortExposeOut is port_expose's output.
type PortExposeOut struct {
	Port    int    `json:"port"`
	URL     string `json:"url" jsonschema:"host-routed URL of the service (http://PORT-ID.DOMAIN/)"`
	PathURL string `json:"path_url" jsonschema:"the same service under the server's own address (…/v1/sandboxes/ID/ports/PORT/)"`
	Token   string `json:"token,omitempty" jsonschema:"access token: header X-Space-Port-Token or query space_token; not needed when public"`
	Public  bool   `json:"public"`
}

func (t *tools) portExpose(ctx context.Context, _ *mcp.CallToolRequest, in PortExposeIn) (*mcp.CallToolResult, PortExposeOut, error) {
	if in.Port < 1 || in.Port > 65535 {
		return nil, PortExposeOut{}, invalid("port must be 1 to 65535, got %d", in.Port)
	}
	var pi *api.PortInfo
	var err error
	if in.Public != nil {
		pi, err = t.c.SetPortPublic(ctx, in.ID, in.Port, *in.Public)
	} else {
		pi, err = t.c.Port(ctx, in.ID, in.Port)
	}
	if err != nil {
		return nil, PortExposeOut{}, toolError(fmt.Sprintf("exposing port %d of sandbox %s", in.Port, in.ID), err)
	}
	out := PortExposeOut{Port: pi.Port, URL: pi.URL, PathURL: pi.PathURL, Token: pi.Token, Public: pi.Public}
	msg := fmt.Sprintf("Port %d of %s: %s (also %s).", pi.Port, in.ID, pi.URL, pi.PathURL)
	if pi.Public {
		msg += " It is public: no token needed."
	} else {
		msg += fmt.Sprintf(" Send header %s: %s (or add ?%s=%s to the URL).", api.PortTokenHeader, pi.Token, api.PortTokenQuery, pi.Token)
	}
	return text(msg), out, nil
}
