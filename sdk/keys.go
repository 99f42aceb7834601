package sdk

import (
	"context"
	"net/http"
	"net/url"

	"github.com/spacehq/space/api"
)

// CreateKey is POST /v1/keys (admin): the answer holds the key itself,
// which the server never shows again.
func (c *Client) CreateKey(ctx context.Context, req api.CreateKeyRequest) (*api.CreatedKey, error) {
	var out api.CreatedKey
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/keys", json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListKeys is GET /v1/keys (admin); tenant "" lists every tenant's.
func (c *Client) ListKeys(ctx context.Context, tenant string) ([]api.APIKey, error) {
	q := url.Values{}
	if tenant != "" {
		q.Set("tenant", tenant)
	}
	var out api.KeyList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/keys", query: q}, &out); err != nil {
		return nil, err
	}
	return out.Keys, nil
}

// RevokeKey is DELETE /v1/keys/{id} (admin).
func (c *Client) RevokeKey(ctx context.Context, id string) (*api.APIKey, error) {
	var out api.APIKey
	if err := c.do(ctx, request{method: http.MethodDelete, path: "/v1/keys/" + seg(id)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Tenant is GET /v1/tenants/{name}: quotas, boundary and usage.
func (c *Client) Tenant(ctx context.Context, name string) (*api.Tenant, error) {
	var out api.Tenant
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/tenants/" + seg(name)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SetTenant is PUT /v1/tenants/{name} (admin).
func (c *Client) SetTenant(ctx context.Context, t api.Tenant) (*api.Tenant, error) {
	var out api.Tenant
	if err := c.do(ctx, request{method: http.MethodPut, path: "/v1/tenants/" + seg(t.Name), json: t}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListTenants is GET /v1/tenants (admin).
func (c *Client) ListTenants(ctx context.Context) ([]api.Tenant, error) {
	var out api.TenantList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/tenants"}, &out); err != nil {
		return nil, err
	}
	return out.Tenants, nil
}
