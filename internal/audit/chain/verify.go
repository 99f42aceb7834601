package chain

import (
	"bufio"
	"bytes"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
)

// Kinds of Problem.
const (
	ProblemMalformed  = "malformed"  // a line that is not a record
	ProblemChanged    = "changed"    // a record whose content no longer matches its hash, or the chain after it
	ProblemRemoved    = "removed"    // sequence numbers missing
	ProblemInserted   = "inserted"   // a second record with a seq already seen
	ProblemReordered  = "reordered"  // a record out of sequence order
	ProblemSignature  = "signature"  // a checkpoint whose signature, key or head does not hold
	ProblemUnanchored = "unanchored" // the file starts neither at seq 1 nor at a signed checkpoint
	ProblemUnsigned   = "unsigned"   // records after the last signed checkpoint
	ProblemAnchor     = "anchor"     // the chain does not hold a head anchored outside it
)

// Anchor is a record the chain is known, from outside it, to hold: a
// checkpoint's seq and hash as a cluster's PostgreSQL keeps it for each
// node. A log rolled back or rewritten past it no longer matches.
type Anchor struct {
	Seq  uint64 `json:"seq"`
	Hash string `json:"hash"`
}

// Problem is one thing Verify found, naming the record (seq) and the line.
type Problem struct {
	Kind    string `json:"kind"`
	Line    int    `json:"line"`
	Seq     uint64 `json:"seq"`
	Message string `json:"message"`
}

func (p Problem) String() string {
	return fmt.Sprintf("line %d (seq %d): %s: %s", p.Line, p.Seq, p.Kind, p.Message)
}

// VerifyOptions say what Verify trusts.
type VerifyOptions struct {
	// Keys are the public keys checkpoints must be signed by (GET
	// /v1/audit/key). Without any, Verify refuses unless ChainOnly.
	Keys []ed25519.PublicKey
	// ChainOnly checks hashes and links but no signature: it detects
	// damage, not forgery (anyone can recompute a hash chain).
	ChainOnly bool
	// AllowUnsignedTail accepts records after the last checkpoint (a
	// followed listing); by default they are a problem, since removing
	// them would go unnoticed. Exports always end at a checkpoint.
	AllowUnsignedTail bool
	// Anchors are records the file must hold unchanged when it covers
	// their seq (one before the file's first record cannot be checked
	// and is reported in Report.Unchecked).
	Anchors []Anchor
}

// Report is what Verify found.
type Report struct {
	Records     int       `json:"records"`
	First       uint64    `json:"first_seq"`
	Last        uint64    `json:"last_seq"`
	Checkpoints int       `json:"checkpoints"`         // with a valid signature (or, ChainOnly, well formed)
	SignedTo    uint64    `json:"signed_to"`           // the last seq a valid checkpoint covers
	Anchored    int       `json:"anchored"`            // anchors found unchanged
	Unchecked   []Anchor  `json:"unchecked,omitempty"` // anchors before the file's first record
	Problems    []Problem `json:"problems"`
}

// OK reports whether the file verified.
func (r Report) OK() bool { return len(r.Problems) == 0 }

// ErrNoKey is Verify's refusal to check signatures it has no key for.
var ErrNoKey = errors.New("no public key to check checkpoint signatures with (give the log's key, or ask for a chain-only check)")

// maxLine bounds one record line.
const maxLine = 1 << 20

type vrec struct {
	Record
	line int
	ok   bool // its own hash holds
}

// Verify reads JSON Lines of audit records (an export) and checks that
// every record matches its hash, that each record's prev is the hash of
// the one before it, that sequence numbers run without gaps, duplicates
// or reordering, that the file starts at the chain's beginning or at a
// signed checkpoint (a retention cut or an export since a time), and that
// each checkpoint's signature holds over its head. Each problem names the
// record (seq) and its line. An error means the input could not be read
// at all.
func Verify(r io.Reader, o VerifyOptions) (Report, error) {
	if len(o.Keys) == 0 && !o.ChainOnly {
		return Report{}, ErrNoKey
	}
	keys := map[string]ed25519.PublicKey{}
	for _, k := range o.Keys {
		keys[KeyID(k)] = k
	}
	var rep Report
	problem := func(kind string, line int, seq uint64, format string, args ...any) {
		rep.Problems = append(rep.Problems, Problem{Kind: kind, Line: line, Seq: seq, Message: fmt.Sprintf(format, args...)})
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	var recs, dups []*vrec
	bySeq := map[uint64]*vrec{}
	n := 0
	for sc.Scan() {
		n++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(b, &rec); err != nil || rec.Seq == 0 || rec.Hash == "" {
			msg := "not an audit record"
			if err != nil {
				msg += ": " + err.Error()
			}
			problem(ProblemMalformed, n, rec.Seq, "%s", msg)
			continue
		}
		v := &vrec{Record: rec, line: n}
		h, err := Hash(rec)
		v.ok = err == nil && h == rec.Hash
		if !v.ok {
			problem(ProblemChanged, n, rec.Seq, "the record's content does not match its hash")
		}
		if _, dup := bySeq[rec.Seq]; dup {
			dups = append(dups, v)
			continue
		}
		if len(recs) > 0 && rec.Seq < recs[len(recs)-1].Seq {
			problem(ProblemReordered, n, rec.Seq, "seq %d comes after seq %d (line %d)", rec.Seq, recs[len(recs)-1].Seq, recs[len(recs)-1].line)
		}
		bySeq[rec.Seq] = v
		recs = append(recs, v)
	}
	if err := sc.Err(); err != nil {
		return rep, fmt.Errorf("reading line %d: %w", n+1, err)
	}
	// Of two records with one seq, the inserted one is the one the next
	// record does not link to.
	for _, d := range dups {
		e := bySeq[d.Seq]
		if next := bySeq[d.Seq+1]; next != nil && next.Prev == d.Hash && next.Prev != e.Hash {
			bySeq[d.Seq] = d
			for i := range recs {
				if recs[i] == e {
					recs[i] = d
				}
			}
			d, e = e, d
		}
		problem(ProblemInserted, d.line, d.Seq, "a second record with seq %d (the one the chain links to is on line %d)", d.Seq, e.line)
	}
	rep.Records = len(recs) + len(dups)
	if len(recs) == 0 {
		for _, a := range o.Anchors {
			problem(ProblemAnchor, 0, a.Seq, "no records, but the chain is anchored at seq %d: the log was emptied or rolled back", a.Seq)
		}
		return rep, nil
	}
	sorted := append([]*vrec(nil), recs...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Seq < sorted[j].Seq })
	rep.First, rep.Last = sorted[0].Seq, sorted[len(sorted)-1].Seq

	// Gaps and links, in sequence order (reordering is reported above;
	// a swapped pair still links).
	for i, v := range sorted {
		if i == 0 {
			continue
		}
		p := sorted[i-1]
		if v.Seq != p.Seq+1 {
			if v.Seq-p.Seq == 2 {
				problem(ProblemRemoved, v.line, v.Seq, "the record with seq %d is missing (between line %d and this one)", p.Seq+1, p.line)
			} else {
				problem(ProblemRemoved, v.line, v.Seq, "the records with seq %d–%d are missing (between line %d and this one)", p.Seq+1, v.Seq-1, p.line)
			}
			continue
		}
		if v.Prev != p.Hash {
			if p.ok {
				problem(ProblemChanged, p.line, p.Seq, "the next record (seq %d, line %d) does not link to this one: this record was replaced, or the next one altered", v.Seq, v.line)
			} else if v.ok {
				// Already reported as changed.
				continue
			}
		}
	}

	// Checkpoints: each must sign the hash of the record before it.
	signedTo := uint64(0)
	checkpoint := func(v *vrec) bool {
		if v.Kind != KindCheckpoint {
			return false
		}
		var d CheckpointDetail
		if err := json.Unmarshal(v.Detail, &d); err != nil {
			problem(ProblemSignature, v.line, v.Seq, "checkpoint detail does not parse: %v", err)
			return false
		}
		if d.To+1 != v.Seq || d.Head != v.Prev || d.From > d.To+1 {
			problem(ProblemSignature, v.line, v.Seq, "checkpoint covers %d–%d with head %.12s…, which is not the chain it sits in", d.From, d.To, d.Head)
			return false
		}
		if !o.ChainOnly {
			k, ok := keys[d.KeyID]
			if !ok {
				problem(ProblemSignature, v.line, v.Seq, "checkpoint signed by key %s, which is not a trusted key", d.KeyID)
				return false
			}
			sig, err := base64.StdEncoding.DecodeString(d.Sig)
			if err != nil || !ed25519.Verify(k, CheckpointMessage(v.Seq, v.Time, d.From, d.To, d.Head), sig) {
				problem(ProblemSignature, v.line, v.Seq, "checkpoint signature does not verify with key %s", d.KeyID)
				return false
			}
		}
		return v.ok
	}
	for _, v := range sorted {
		if checkpoint(v) {
			rep.Checkpoints++
			signedTo = v.Seq
		}
	}
	rep.SignedTo = signedTo

	// Anchor: the first record starts the chain, or is a checkpoint whose
	// signature vouches for its prev.
	first := sorted[0]
	switch {
	case first.Seq == 1:
		if first.Prev != "" {
			problem(ProblemChanged, first.line, first.Seq, "the first record of the chain has a prev")
		}
	case first.Kind == KindCheckpoint && signedTo >= first.Seq:
		// Checked above; the chain verifies from its head.
	default:
		problem(ProblemUnanchored, first.line, first.Seq, "the file starts at seq %d, which is not a signed checkpoint: what comes before it (and whether records were removed there) cannot be checked", first.Seq)
	}
	for _, a := range o.Anchors {
		v := bySeq[a.Seq]
		switch {
		case a.Seq < rep.First:
			rep.Unchecked = append(rep.Unchecked, a)
		case a.Seq > rep.Last:
			problem(ProblemAnchor, sorted[len(sorted)-1].line, rep.Last,
				"the chain ends at seq %d, before its anchored record (seq %d): records were removed or the log was rolled back", rep.Last, a.Seq)
		case v == nil:
			problem(ProblemAnchor, 0, a.Seq, "the anchored record (seq %d) is missing", a.Seq)
		case v.Hash != a.Hash || !v.ok:
			problem(ProblemAnchor, v.line, v.Seq, "the record is not the one anchored: its hash is %.12s…, the anchor's %.12s…", v.Hash, a.Hash)
		default:
			rep.Anchored++
		}
	}
	if signedTo < rep.Last && !o.AllowUnsignedTail {
		tail := bySeq[signedTo+1]
		line := 0
		if tail != nil {
			line = tail.line
		}
		problem(ProblemUnsigned, line, signedTo+1, "the records from seq %d to %d come after the last signed checkpoint: removing them would go unnoticed", signedTo+1, rep.Last)
	}
	sort.SliceStable(rep.Problems, func(i, j int) bool { return rep.Problems[i].Line < rep.Problems[j].Line })
	return rep, nil
}
