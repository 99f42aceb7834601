package sdk

import (
	"context"
	"net/http"

	"github.com/spacehq/space/api"
)

// SetSecret is PUT /v1/secrets/{name}: it creates the secret or rotates it
// (value, hosts and header replaced; the version goes up). The answer never
// carries the value.
func (c *Client) SetSecret(ctx context.Context, name string, req api.SetSecretRequest) (*api.Secret, error) {
	if err := checkID("secret", name); err != nil {
		return nil, err
	}
	var out api.Secret
	if err := c.do(ctx, request{method: http.MethodPut, path: "/v1/secrets/" + seg(name), json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListSecrets is GET /v1/secrets.
func (c *Client) ListSecrets(ctx context.Context) ([]api.Secret, error) {
	var out api.SecretList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/secrets"}, &out); err != nil {
		return nil, err
	}
	return out.Secrets, nil
}

// GetSecret is GET /v1/secrets/{name}.
func (c *Client) GetSecret(ctx context.Context, name string) (*api.Secret, error) {
	if err := checkID("secret", name); err != nil {
		return nil, err
	}
	var out api.Secret
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/secrets/" + seg(name)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// DeleteSecret is DELETE /v1/secrets/{name}: the secret and every grant of it go.
func (c *Client) DeleteSecret(ctx context.Context, name string) error {
	if err := checkID("secret", name); err != nil {
		return err
	}
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/secrets/" + seg(name)}, nil)
}

// SandboxSecrets is GET /v1/sandboxes/{id}/secrets: the grants with their placeholders.
func (c *Client) SandboxSecrets(ctx context.Context, id string) ([]api.SecretGrant, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	var out api.SecretGrantList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(id) + "/secrets"}, &out); err != nil {
		return nil, err
	}
	return out.Grants, nil
}

// GrantSecret is PUT /v1/sandboxes/{id}/secrets/{name}.
func (c *Client) GrantSecret(ctx context.Context, id, name string) (*api.SecretGrant, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	if err := checkID("secret", name); err != nil {
		return nil, err
	}
	var out api.SecretGrant
	if err := c.do(ctx, request{method: http.MethodPut, path: "/v1/sandboxes/" + seg(id) + "/secrets/" + seg(name)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RevokeSecret is DELETE /v1/sandboxes/{id}/secrets/{name}.
func (c *Client) RevokeSecret(ctx context.Context, id, name string) error {
	if err := checkID("sandbox", id); err != nil {
		return err
	}
	if err := checkID("secret", name); err != nil {
		return err
	}
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/sandboxes/" + seg(id) + "/secrets/" + seg(name)}, nil)
}
