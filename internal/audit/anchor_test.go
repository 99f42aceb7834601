package audit

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestVerifySince: a log continues the head it published; rolled back,
// rewritten after the head, or signing with another key, it does not.
func TestVerifySince(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	key := testKey(t)
	l := openLog(t, dir, key, Options{CheckpointEvery: 4})
	if _, ok, err := l.VerifySince(ctx, Anchor{}); ok || err != nil {
		t.Fatalf("an empty log has a head: %v %v", ok, err)
	}
	record(l, 6)
	if _, err := l.Checkpoint(ctx); err != nil {
		t.Fatal(err)
	}
	h1, ok, err := l.VerifySince(ctx, Anchor{})
	if err != nil || !ok || h1.Seq != 8 || !strings.Contains(h1.Line, `"checkpoint"`) {
		t.Fatalf("first head: %+v %v %v", h1, ok, err)
	}
	record(l, 5)
	if err := l.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// Unsigned records after the newest checkpoint are fine; the head is
	// the newest checkpoint.
	h2, ok, err := l.VerifySince(ctx, h1.Anchor())
	if err != nil || !ok || h2.Seq != 13 {
		t.Fatalf("head after more records: %+v %v %v", h2, ok, err)
	}
	if _, _, err := l.VerifySince(ctx, Anchor{Seq: h1.Seq, Hash: strings.Repeat("0", 64)}); !errors.Is(err, ErrAnchorMismatch) || !strings.Contains(err.Error(), "not the one anchored") {
		t.Fatalf("another hash at the anchored seq: %v", err)
	}

	// A record after the anchor rewritten (its hash recomputed: whoever
	// can write the file can do that, but not sign).
	var line string
	if err := l.db.QueryRow(`SELECT line FROM audit_records WHERE seq = 10`).Scan(&line); err != nil {
		t.Fatal(err)
	}
	var r Record
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatal(err)
	}
	r.Target = "forged"
	r.Hash = mustHash(r)
	forged, _ := json.Marshal(r)
	if _, err := l.db.Exec(`UPDATE audit_records SET line = ? WHERE seq = 10`, string(forged)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.VerifySince(ctx, h1.Anchor()); !errors.Is(err, ErrAnchorMismatch) || !strings.Contains(err.Error(), "seq 10") {
		t.Fatalf("a rewritten record after the anchor: %v", err)
	}
	if _, err := l.db.Exec(`UPDATE audit_records SET line = ? WHERE seq = 10`, line); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.VerifySince(ctx, h2.Anchor()); err != nil {
		t.Fatalf("restored: %v", err)
	}

	// Rolled back to before the newest head.
	if _, err := l.db.Exec(`DELETE FROM audit_records WHERE seq >= 11`); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.VerifySince(ctx, h2.Anchor()); !errors.Is(err, ErrAnchorMismatch) || !strings.Contains(err.Error(), "ends at seq 10, before its anchored checkpoint (seq 13)") {
		t.Fatalf("rolled back: %v", err)
	}
	l.Close()

	// The same file, now signed by another key: the anchored checkpoint's
	// signature no longer verifies with the log's key.
	l2 := openLog(t, dir, testKey(t), Options{})
	if _, _, err := l2.VerifySince(ctx, h1.Anchor()); !errors.Is(err, ErrAnchorMismatch) || !strings.Contains(err.Error(), "signature") {
		t.Fatalf("another key: %v", err)
	}
}

// TestVerifyAnchors: an export is checked against anchored heads — found,
// changed, cut off, or before the file.
func TestVerifyAnchors(t *testing.T) {
	key := testKey(t)
	l := openLog(t, t.TempDir(), key, Options{CheckpointEvery: 4})
	record(l, 9)
	lines := export(t, l, time.Time{}) // checkpoints at 5, 10 and 12
	var cp Record
	json.Unmarshal([]byte(lines[9]), &cp)
	if cp.Kind != KindCheckpoint || cp.Seq != 10 {
		t.Fatalf("line 10: %+v", cp)
	}
	o := VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}, Anchors: []Anchor{{Seq: 10, Hash: cp.Hash}}}
	if rep := verifyLines(t, lines, o); !rep.OK() || rep.Anchored != 1 {
		t.Fatalf("anchored export: %+v", rep)
	}
	// Cut after seq 8: the anchor is past the end.
	if rep := verifyLines(t, lines[:8], o); !hasProblem(rep, ProblemAnchor, 8, 8) {
		t.Fatalf("export cut before its anchor: %+v", rep)
	}
	o.Anchors = []Anchor{{Seq: 10, Hash: strings.Repeat("a", 64)}}
	if rep := verifyLines(t, lines, o); !hasProblem(rep, ProblemAnchor, 10, 10) {
		t.Fatalf("another hash anchored: %+v", rep)
	}
	// An export starting at the checkpoint of seq 10 cannot check an
	// anchor at 5.
	o.Anchors = []Anchor{{Seq: 5, Hash: "x"}}
	if rep := verifyLines(t, lines[9:], o); !rep.OK() || len(rep.Unchecked) != 1 || rep.Anchored != 0 {
		t.Fatalf("anchor before the file: %+v", rep)
	}
}
