package api

import "time"

// SetSecretRequest is PUT /v1/secrets/{name}: it creates the secret or
// rotates it (a new value, hosts and header; the version goes up). Exactly
// one of Value and ValueBase64 is set; the value is at most 64 KiB and is
// never returned by any route.
type SetSecretRequest struct {
	Value       *string `json:"value,omitempty"`
	ValueBase64 *string `json:"value_base64,omitempty"`
	// Hosts are the exact names and "*.suffix" patterns the value may be
	// sent to; requests to them are intercepted by the gateway.
	Hosts []string `json:"hosts,omitempty"`
	// Header, if set, is "Name: template" with {} standing for the value
	// (e.g. "Authorization: Bearer {}"): set on every request to Hosts.
	// Empty: the placeholder is replaced wherever it appears in a request's
	// headers.
	Header string `json:"header,omitempty"`
}

// Secret describes a secret: never its value, nor a hash of it.
type Secret struct {
	Name      string    `json:"name"`
	Tenant    string    `json:"tenant"`
	Hosts     []string  `json:"hosts"`
	Header    string    `json:"header,omitempty"`
	Version   int       `json:"version"` // 1 at creation, +1 at every rotation
	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

// SecretList is GET /v1/secrets.
type SecretList struct {
	Secrets []Secret `json:"secrets"`
}

// SecretGrant is one secret granted to a sandbox. The placeholder is not
// secret: it is the value of the sandbox's env var of the secret's name.
type SecretGrant struct {
	Name        string    `json:"name"`
	Placeholder string    `json:"placeholder"`
	CreatedAt   time.Time `json:"created_at"`
}

// SecretGrantList is GET /v1/sandboxes/{id}/secrets.
type SecretGrantList struct {
	Grants []SecretGrant `json:"grants"`
}
