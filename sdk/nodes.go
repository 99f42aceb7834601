package sdk

import (
	"context"
	"net/http"
	"net/url"

	"github.com/spacehq/space/api"
)

// Nodes lists a cluster's nodes (cluster replicas only; admin).
func (c *Client) Nodes(ctx context.Context) ([]api.ClusterNode, error) {
	var out []api.ClusterNode
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/nodes"}, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// DrainNode stops placing new sandboxes on node id; its sandboxes keep
// running (cluster replicas only; admin).
func (c *Client) DrainNode(ctx context.Context, id, reason string) (*api.ClusterNode, error) {
	var out api.ClusterNode
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/nodes/" + url.PathEscape(id) + "/drain", json: api.DrainRequest{Reason: reason}}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// UndrainNode lets placement use node id again.
func (c *Client) UndrainNode(ctx context.Context, id string) (*api.ClusterNode, error) {
	var out api.ClusterNode
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/nodes/" + url.PathEscape(id) + "/undrain"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
