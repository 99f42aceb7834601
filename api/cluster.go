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

// DrainRequest is the optional body of POST /v1/nodes/{id}/drain.
type DrainRequest struct {
	Reason string `json:"reason,omitempty"` // shown as the node's state_reason
}

// AuditHead is a node's audit chain head as the cluster anchors it (GET
// /v1/audit/heads, cluster replicas only): the newest signed checkpoint the
// node published. An export of the node's log verifies against it with
// `space audit verify --anchor SEQ:HASH`. Problem is set when the node found
// that its log no longer continues the head (rolled back, cut, rewritten,
// another key); the head then stays as it was until an admin forgets it.
type AuditHead struct {
	Node       string      `json:"node"`
	Seq        uint64      `json:"seq"`
	Hash       string      `json:"hash"`
	KeyID      string      `json:"key_id"`
	PublicKey  string      `json:"public_key"`
	SignedAt   time.Time   `json:"signed_at"`
	AnchoredAt time.Time   `json:"anchored_at"`
	Checkpoint AuditRecord `json:"checkpoint"`
	Problem    string      `json:"problem,omitempty"`
	ProblemAt  *time.Time  `json:"problem_at,omitempty"`
}

// AuditHeadList is GET /v1/audit/heads.
type AuditHeadList struct {
	Heads []AuditHead `json:"heads"`
}
