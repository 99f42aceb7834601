package api

import "time"

// IdempotencyKeyHeader on POST /v1/sandboxes makes a create safe to retry in
// cluster mode: of the creates a tenant sends with one key, through any
// replica, exactly one makes a sandbox; the others answer with that
// sandbox (and HTTP 200). 1–128 printable ASCII characters.
const IdempotencyKeyHeader = "Idempotency-Key"

// ClusterNode is one node of a cluster, as GET /v1/nodes lists them (cluster
// replicas only).
type ClusterNode struct {
	ID          string    `json:"id"`
	Address     string    `json:"address"`
	State       string    `json:"state"` // ready, draining, lost
	StateReason string    `json:"state_reason,omitempty"`
	MemFree     int64     `json:"mem_free_bytes"`
	CPUs        int       `json:"cpus"`
	Sandboxes   int       `json:"sandboxes"`
	Templates   []string  `json:"templates"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
}
