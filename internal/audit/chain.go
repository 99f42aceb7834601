package audit

import (
	"crypto/ed25519"
	"io"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit/chain"
)

// The hash chain itself is package chain (pure functions, no storage, so
// the CLI links it alone); these are its names as this package has always
// spelled them.

// Record is one record of the chain (the wire type: what the log stores,
// lists and exports).
type Record = api.AuditRecord

// Kinds the log writes itself.
const (
	KindCheckpoint = chain.KindCheckpoint
	KindAudit      = chain.KindAudit
)

// Kinds of Problem.
const (
	ProblemMalformed  = chain.ProblemMalformed
	ProblemChanged    = chain.ProblemChanged
	ProblemRemoved    = chain.ProblemRemoved
	ProblemInserted   = chain.ProblemInserted
	ProblemReordered  = chain.ProblemReordered
	ProblemSignature  = chain.ProblemSignature
	ProblemUnanchored = chain.ProblemUnanchored
	ProblemUnsigned   = chain.ProblemUnsigned
	ProblemAnchor     = chain.ProblemAnchor
)

type (
	// CheckpointDetail is chain.CheckpointDetail.
	CheckpointDetail = chain.CheckpointDetail
	// Problem is chain.Problem.
	Problem = chain.Problem
	// VerifyOptions is chain.VerifyOptions.
	VerifyOptions = chain.VerifyOptions
	// Report is chain.Report.
	Report = chain.Report
	// Anchor is chain.Anchor.
	Anchor = chain.Anchor
)

// ErrNoKey is Verify's refusal to check signatures it has no key for.
var ErrNoKey = chain.ErrNoKey

// Canonical returns the bytes r's hash is computed over.
func Canonical(r Record) ([]byte, error) { return chain.Canonical(r) }

// Hash returns the hash r should carry (hex SHA-256 of Canonical(r)).
func Hash(r Record) (string, error) { return chain.Hash(r) }

// CheckpointMessage is what a checkpoint's signature covers.
func CheckpointMessage(seq uint64, t time.Time, from, to uint64, head string) []byte {
	return chain.CheckpointMessage(seq, t, from, to, head)
}

// KeyID names a public key: the first 16 hex digits of its SHA-256.
func KeyID(pub ed25519.PublicKey) string { return chain.KeyID(pub) }

// PublicKey describes pub for GET /v1/audit/key.
func PublicKey(pub ed25519.PublicKey) api.AuditKey { return chain.PublicKey(pub) }

// ParsePublicKey reads a key as GET /v1/audit/key gives it.
func ParsePublicKey(s string) (ed25519.PublicKey, error) { return chain.ParsePublicKey(s) }

// Verify checks an export (JSON Lines of records); see chain.Verify.
func Verify(r io.Reader, o VerifyOptions) (Report, error) { return chain.Verify(r, o) }
