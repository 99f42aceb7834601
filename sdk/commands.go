package sdk

import (
	"context"
	"fmt"
	"net/http"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Exec is POST /v1/sandboxes/{id}/exec: run a command to completion and
// return its buffered output.
func (c *Client) Exec(ctx context.Context, sandboxID string, req api.ExecRequest) (*api.ExecResult, error) {
	if err := checkID("sandbox", sandboxID); err != nil {
		return nil, err
	}
	if len(req.Cmd) == 0 {
		return nil, fmt.Errorf("exec: empty command: %w", errdefs.ErrInvalidArgument)
	}
	var out api.ExecResult
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + seg(sandboxID) + "/exec", json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// CreateCommand is POST /v1/sandboxes/{id}/commands. The returned command
// carries AttachURL and a short-lived AttachToken for Attach.
func (c *Client) CreateCommand(ctx context.Context, sandboxID string, req api.CreateCommandRequest) (*api.Command, error) {
	if err := checkID("sandbox", sandboxID); err != nil {
		return nil, err
	}
	if len(req.Cmd) == 0 {
		return nil, fmt.Errorf("command: empty command: %w", errdefs.ErrInvalidArgument)
	}
	var out api.Command
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + seg(sandboxID) + "/commands", json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListCommands is GET /v1/sandboxes/{id}/commands.
func (c *Client) ListCommands(ctx context.Context, sandboxID string) ([]api.Command, error) {
	if err := checkID("sandbox", sandboxID); err != nil {
		return nil, err
	}
	var out api.CommandList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(sandboxID) + "/commands"}, &out); err != nil {
		return nil, err
	}
	return out.Commands, nil
}

func commandPath(sandboxID, cmdID string) (string, error) {
	if err := checkID("sandbox", sandboxID); err != nil {
		return "", err
	}
	if err := checkID("command", cmdID); err != nil {
		return "", err
	}
	return "/v1/sandboxes/" + seg(sandboxID) + "/commands/" + seg(cmdID), nil
}

// GetCommand is GET /v1/sandboxes/{id}/commands/{cid}.
func (c *Client) GetCommand(ctx context.Context, sandboxID, cmdID string) (*api.Command, error) {
	p, err := commandPath(sandboxID, cmdID)
	if err != nil {
		return nil, err
	}
	var out api.Command
	if err := c.do(ctx, request{method: http.MethodGet, path: p}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SignalCommand is POST /v1/sandboxes/{id}/commands/{cid}/signal. signal is
// a name ("TERM", "KILL", …) or a number.
func (c *Client) SignalCommand(ctx context.Context, sandboxID, cmdID, signal string) error {
	p, err := commandPath(sandboxID, cmdID)
	if err != nil {
		return err
	}
	if signal == "" {
		return fmt.Errorf("signal: empty signal: %w", errdefs.ErrInvalidArgument)
	}
	return c.do(ctx, request{method: http.MethodPost, path: p + "/signal", json: api.SignalRequest{Signal: signal}}, nil)
}

// RefreshAttachToken is POST /v1/sandboxes/{id}/commands/{cid}/token: the
// command with a fresh AttachToken.
func (c *Client) RefreshAttachToken(ctx context.Context, sandboxID, cmdID string) (*api.Command, error) {
	p, err := commandPath(sandboxID, cmdID)
	if err != nil {
		return nil, err
	}
	var out api.Command
	if err := c.do(ctx, request{method: http.MethodPost, path: p + "/token"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
