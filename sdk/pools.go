package sdk

import (
	"context"
	"net/http"

	"github.com/spacehq/space/api"
)

// ListPools is GET /v1/pools (admin).
func (c *Client) ListPools(ctx context.Context) ([]api.Pool, error) {
	var out api.PoolList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/pools"}, &out); err != nil {
		return nil, err
	}
	return out.Pools, nil
}

// SetPool is PUT /v1/pools (admin): creates or updates the pool keyed by
// the spec's template, runtime and limits.
func (c *Client) SetPool(ctx context.Context, spec api.PoolSpec) (*api.Pool, error) {
	var out api.Pool
	if err := c.do(ctx, request{method: http.MethodPut, path: "/v1/pools", json: spec}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Pool is GET /v1/pools/{id} (admin).
func (c *Client) Pool(ctx context.Context, id string) (*api.Pool, error) {
	var out api.Pool
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/pools/" + seg(id)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// DeletePool is DELETE /v1/pools/{id} (admin): its members are destroyed.
func (c *Client) DeletePool(ctx context.Context, id string) error {
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/pools/" + seg(id)}, nil)
}
