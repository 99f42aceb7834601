// Package chain is the audit log's hash chain as pure functions: the canonical
// form and hash of a record, the checkpoint message and keys, and Verify over
// an export. It imports no storage, so the space CLI verifies an export
// offline without linking the log (and its SQLite driver); package audit
// re-exports every name.
package chain

import (
	"bytes"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/spacehq/space/api"
)

// Record is one record of the chain (the wire type: what the log stores,
// lists and exports).
type Record = api.AuditRecord

// Kinds the log writes itself.
const (
	KindCheckpoint = "checkpoint" // a signed checkpoint of the chain's head
	KindAudit      = "audit"      // the log's own notes: retention cuts, dropped events
)

// hashed is the canonical form a record's hash is computed over: the
// record without its hash, fields in this order, time in UTC RFC 3339 with
// nanoseconds, detail compacted. encoding/json writes struct fields in
// declaration order and escapes the same way every time, so the encoding
// is a function of the values alone.
type hashed struct {
	Seq     uint64          `json:"seq"`
	Time    string          `json:"time"`
	Kind    string          `json:"kind"`
	Action  string          `json:"action"`
	Sandbox string          `json:"sandbox"`
	Target  string          `json:"target"`
	Result  string          `json:"result"`
	KeyID   string          `json:"key_id"`
	Tenant  string          `json:"tenant"`
	Detail  json.RawMessage `json:"detail"`
	Prev    string          `json:"prev"`
}

// Canonical returns the bytes r's hash is computed over.
func Canonical(r Record) ([]byte, error) {
	d := json.RawMessage("null")
	if len(bytes.TrimSpace(r.Detail)) > 0 {
		var b bytes.Buffer
		if err := json.Compact(&b, r.Detail); err != nil {
			return nil, fmt.Errorf("detail is not JSON: %w", err)
		}
		d = b.Bytes()
	}
	return json.Marshal(hashed{
		Seq: r.Seq, Time: r.Time.UTC().Format(time.RFC3339Nano), Kind: r.Kind, Action: r.Action,
		Sandbox: r.Sandbox, Target: r.Target, Result: r.Result, KeyID: r.KeyID, Tenant: r.Tenant,
		Detail: d, Prev: r.Prev,
	})
}

// Hash returns the hash r should carry (hex SHA-256 of Canonical(r)).
func Hash(r Record) (string, error) {
	c, err := Canonical(r)
	if err != nil {
		return "", err
	}
	h := sha256.Sum256(c)
	return hex.EncodeToString(h[:]), nil
}

// CheckpointDetail is the detail of a checkpoint record: it covers records
// From..To (the records since the previous checkpoint), whose last hash is
// Head (and the checkpoint's own Prev), signed by key KeyID.
type CheckpointDetail struct {
	From  uint64 `json:"from"`
	To    uint64 `json:"to"`
	Head  string `json:"head"`
	Sig   string `json:"sig"` // base64 ed25519 signature of CheckpointMessage
	KeyID string `json:"key_id"`
}

// CheckpointMessage is what a checkpoint's signature covers: its own seq
// and time, the range it covers and the head hash (which, through the
// chain, covers every record before it).
func CheckpointMessage(seq uint64, t time.Time, from, to uint64, head string) []byte {
	return []byte("space-audit-checkpoint/v1\n" +
		"seq=" + strconv.FormatUint(seq, 10) + "\n" +
		"time=" + t.UTC().Format(time.RFC3339Nano) + "\n" +
		"from=" + strconv.FormatUint(from, 10) + "\n" +
		"to=" + strconv.FormatUint(to, 10) + "\n" +
		"head=" + head + "\n")
}

// KeyID names a public key: the first 16 hex digits of its SHA-256.
func KeyID(pub ed25519.PublicKey) string {
	h := sha256.Sum256(pub)
	return hex.EncodeToString(h[:8])
}

// PublicKey describes pub for GET /v1/audit/key.
func PublicKey(pub ed25519.PublicKey) api.AuditKey {
	return api.AuditKey{ID: KeyID(pub), Algorithm: "ed25519", PublicKey: base64.StdEncoding.EncodeToString(pub)}
}

// ParsePublicKey reads a key as GET /v1/audit/key gives it (standard or
// URL base64 of 32 bytes).
func ParsePublicKey(s string) (ed25519.PublicKey, error) {
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(s); err == nil {
			if len(b) != ed25519.PublicKeySize {
				return nil, fmt.Errorf("public key is %d bytes, want %d (ed25519)", len(b), ed25519.PublicKeySize)
			}
			return ed25519.PublicKey(b), nil
		}
	}
	return nil, fmt.Errorf("public key is not base64")
}
