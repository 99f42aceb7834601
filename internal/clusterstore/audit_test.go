package clusterstore

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
)

// TestAuditHeads: a node's head only moves forward, under one key, with a
// checkpoint whose signature holds; a reported problem freezes it until
// an admin forgets it.
func TestAuditHeads(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	_, key, _ := ed25519.GenerateKey(rand.Reader)
	db, err := audit.OpenDB(filepath.Join(t.TempDir(), "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	l, err := audit.Open(ctx, audit.Options{DB: db, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	head := func() audit.Head {
		t.Helper()
		l.Record(ctx, audit.Event{Kind: audit.KindAPI, Action: "GET /v1/info"})
		if _, err := l.Checkpoint(ctx); err != nil {
			t.Fatal(err)
		}
		h, ok, err := l.VerifySince(ctx, audit.Anchor{})
		if err != nil || !ok {
			t.Fatal(ok, err)
		}
		return h
	}
	pub := l.PublicKey()
	if _, err := s.AuditHeads().AuditHead(ctx, "n1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("head before any: %v", err)
	}
	h1, h2 := head(), head()
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", h2.Line, pub); err != nil {
		t.Fatal(err)
	}
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", h1.Line, pub); !errors.Is(err, ErrAuditHeadStale) {
		t.Fatalf("an older head replaced a newer one: %v", err)
	}
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", h2.Line, pub); !errors.Is(err, ErrAuditHeadStale) {
		t.Fatalf("the same head twice: %v", err)
	}
	other := make(ed25519.PublicKey, ed25519.PublicKeySize)
	h3 := head()
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", h3.Line, other); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a head whose signature does not hold: %v", err)
	}
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", strings.Replace(h3.Line, `"sign"`, `"sigN"`, 1), pub); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("an altered head: %v", err)
	}
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", h3.Line, pub); err != nil {
		t.Fatal(err)
	}
	got, err := s.AuditHeads().AuditHead(ctx, "n1")
	if err != nil || got.Seq != h3.Seq || got.Hash != h3.Hash || got.Checkpoint != h3.Line || got.KeyID != l.KeyID() || got.Problem != "" {
		t.Fatalf("head: %+v %v", got, err)
	}

	if err := s.AuditHeads().ReportAuditProblem(ctx, "n1", "rolled back"); err != nil {
		t.Fatal(err)
	}
	if err := s.AuditHeads().ReportAuditProblem(ctx, "n1", "second report"); err != nil {
		t.Fatal(err)
	}
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", head().Line, pub); !errors.Is(err, ErrAuditHeadStale) {
		t.Fatalf("a head published over a problem: %v", err)
	}
	heads, err := s.AuditHeads().AuditHeads(ctx)
	if err != nil || len(heads) != 1 || heads[0].Problem != "rolled back" || heads[0].ProblemAt == nil || heads[0].Seq != h3.Seq {
		t.Fatalf("heads after a problem: %+v %v", heads, err)
	}
	if err := s.AuditHeads().ForgetAuditHead(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	if err := s.AuditHeads().ForgetAuditHead(ctx, "n1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("forgetting twice: %v", err)
	}
	if err := s.AuditHeads().AnchorAudit(ctx, "n1", head().Line, pub); err != nil {
		t.Fatalf("anchoring afresh after forgetting: %v", err)
	}
}

// TestSecretsVersionUp: a secret's version goes up with each put, the
// sealer sees the version it seals for, and a delete is a delete.
func TestSecretsVersionUp(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	var sealedFor []int
	seal := func(v int) ([]byte, error) { sealedFor = append(sealedFor, v); return []byte{byte(v)}, nil }
	sec, created, err := s.Secrets().PutSecret(ctx, "acme", "TOKEN", nil, "", seal)
	if err != nil || !created || sec.Version != 1 || sec.Hosts == nil {
		t.Fatalf("first put: %+v %v %v", sec, created, err)
	}
	sec, created, err = s.Secrets().PutSecret(ctx, "acme", "TOKEN", []string{"a.test"}, "X-Key: {}", seal)
	if err != nil || created || sec.Version != 2 || sec.Header != "X-Key: {}" || string(sec.Sealed) != "\x02" {
		t.Fatalf("second put: %+v %v %v", sec, created, err)
	}
	if len(sealedFor) != 2 || sealedFor[1] != 2 {
		t.Fatalf("sealed for versions %v", sealedFor)
	}
	if list, err := s.Secrets().Secrets(ctx, "other"); err != nil || len(list) != 0 {
		t.Fatalf("another tenant's list: %+v %v", list, err)
	}
	if err := s.Secrets().DeleteSecret(ctx, "acme", "TOKEN"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Secrets().GetSecret(ctx, "acme", "TOKEN"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
	if err := s.Secrets().DeleteSecret(ctx, "acme", "TOKEN"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
}
