package api

import "time"

// APIKey is one API key as the API shows it: never the key itself (only
// its first characters, to tell keys apart), which is shown once, when
// created (CreatedKey).
type APIKey struct {
	ID         string     `json:"id"`
	Name       string     `json:"name"`
	Tenant     string     `json:"tenant"`
	Scopes     []string   `json:"scopes"`
	Prefix     string     `json:"prefix"` // the key's first characters
	CreatedAt  time.Time  `json:"created_at"`
	LastUsedAt *time.Time `json:"last_used_at,omitempty"`
	RevokedAt  *time.Time `json:"revoked_at,omitempty"`
}

// CreateKeyRequest is POST /v1/keys.
type CreateKeyRequest struct {
	Name   string   `json:"name"`
	Tenant string   `json:"tenant,omitempty"` // default "default"
	Scopes []string `json:"scopes"`
}

// CreatedKey is the answer to POST /v1/keys: the only time Key is shown.
type CreatedKey struct {
	APIKey
	Key string `json:"key"`
}

// KeyList is GET /v1/keys.
type KeyList struct {
	Keys []APIKey `json:"keys"`
}

// Quotas bound what one tenant's sandboxes may hold together; zero means
// unlimited. A sandbox counts from its create until its delete, whatever
// its state, so waking or starting one of them never fails on a quota.
type Quotas struct {
	Sandboxes int     `json:"sandboxes,omitempty"`
	CPUs      float64 `json:"cpus,omitempty"`
	MemoryMiB int64   `json:"memory_mib,omitempty"`
	DiskMiB   int64   `json:"disk_mib,omitempty"`
}

// Usage is what a tenant's sandboxes hold now, in the units of Quotas.
type Usage struct {
	Sandboxes int     `json:"sandboxes"`
	CPUs      float64 `json:"cpus"`
	MemoryMiB int64   `json:"memory_mib"`
	DiskMiB   int64   `json:"disk_mib"`
}

// Tenant is GET/PUT /v1/tenants/{name}.
type Tenant struct {
	Name   string `json:"name"`
	Quotas Quotas `json:"quotas"`
	// Boundary is the widest network policy any of the tenant's sandboxes
	// may ever have; absent: no boundary beyond the server's own rules.
	Boundary  *NetworkPolicy `json:"boundary,omitempty"`
	Usage     *Usage         `json:"usage,omitempty"` // in answers only
	UpdatedAt *time.Time     `json:"updated_at,omitempty"`
}

// TenantList is GET /v1/tenants.
type TenantList struct {
	Tenants []Tenant `json:"tenants"`
}
