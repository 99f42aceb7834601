package api

// PoolSpec is what a warm pool is made of (PUT /v1/pools): sandboxes of
// Template on Runtime with Limits, Min to Max of them kept ready. A pool is
// keyed by (template, runtime, limits): a PUT with the same key updates
// its min and max.
type PoolSpec struct {
	Template string `json:"template"`
	Runtime  string `json:"runtime,omitempty"` // "" or "auto": the strongest available
	Limits   Limits `json:"limits"`
	Min      int    `json:"min"`
	Max      int    `json:"max"`
	// IdleMode overrides how members wait ("running" or "paused"; paused
	// needs a runtime that can pause); empty: the runtime's default.
	IdleMode string `json:"idle_mode,omitempty"`
}

// Pool is a warm pool and what it holds now.
type Pool struct {
	ID   string   `json:"id"`
	Spec PoolSpec `json:"spec"`
	// TemplateDigest is what new members are made from now (the spec's
	// template resolved); empty while it does not resolve.
	TemplateDigest string `json:"template_digest,omitempty"`
	Runtime        string `json:"runtime"`   // the runtime members run on
	IdleMode       string `json:"idle_mode"` // "running" or "paused": how members wait
	Ready          int    `json:"ready"`
	Filling        int    `json:"filling"`
	// Target is how many members the pool keeps ready now: min, raised by
	// misses up to max, lowered again after a minute without one.
	Target int `json:"target"`
	// Hits and Misses count claims since the pool was made, across server
	// restarts (saved at most a second behind).
	Hits         int64   `json:"hits"`
	Misses       int64   `json:"misses"`
	LastRefillMS float64 `json:"last_refill_ms"`
	LastError    string  `json:"last_error,omitempty"`
	// Nodes is, from a cluster replica, each node's share of the pool (the
	// counts above are their sums); a single server leaves it out.
	Nodes []PoolOnNode `json:"nodes,omitempty"`
}

// PoolOnNode is one cluster node's part of a warm pool.
type PoolOnNode struct {
	Node      string `json:"node"`
	Ready     int    `json:"ready"`
	Filling   int    `json:"filling"`
	Target    int    `json:"target"`
	Hits      int64  `json:"hits"`
	Misses    int64  `json:"misses"`
	LastError string `json:"last_error,omitempty"`
}

// Idle modes of pool members.
const (
	PoolIdleRunning = "running"
	PoolIdlePaused  = "paused"
)

// PoolList is GET /v1/pools.
type PoolList struct {
	Pools []Pool `json:"pools"`
}
