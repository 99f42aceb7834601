package api

import (
	"encoding/json"
	"time"
)

// AuditRecord is one record of the server's tamper-evident audit log, as
// the log stores it and as GET /v1/audit and the jsonl export send it. Hash
// is the SHA-256 (hex) of the record's canonical encoding (internal/audit),
// which covers Prev, the Hash of the record before it: changing, removing,
// inserting or reordering records breaks the chain. A record of kind
// "checkpoint" signs the chain's head (Detail: from, to, head, sig, key_id).
type AuditRecord struct {
	Seq     uint64          `json:"seq"`
	Time    time.Time       `json:"time"`
	Kind    string          `json:"kind"`
	Action  string          `json:"action"`
	Sandbox string          `json:"sandbox,omitempty"`
	Target  string          `json:"target,omitempty"`
	Result  string          `json:"result,omitempty"`
	KeyID   string          `json:"key_id,omitempty"`
	Tenant  string          `json:"tenant,omitempty"`
	Detail  json.RawMessage `json:"detail,omitempty"`
	Prev    string          `json:"prev"`
	Hash    string          `json:"hash"`
}

// AuditRecordList is GET /v1/audit without follow.
type AuditRecordList struct {
	Records []AuditRecord `json:"records"`
}

// AuditKey is a public key the audit log's checkpoints are signed with.
type AuditKey struct {
	ID        string `json:"id"`         // first 16 hex digits of the SHA-256 of the public key
	Algorithm string `json:"algorithm"`  // "ed25519"
	PublicKey string `json:"public_key"` // standard base64 of the 32-byte key
}

// AuditKeyList is GET /v1/audit/key.
type AuditKeyList struct {
	Keys []AuditKey `json:"keys"`
}
