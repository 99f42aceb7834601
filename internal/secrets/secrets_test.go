package secrets

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/store"
)

func openTest(t *testing.T) (*Store, string) {
	t.Helper()
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := Open(context.Background(), db.SQL(), dir)
	if err != nil {
		t.Fatal(err)
	}
	return s, dir
}

func TestKeyFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, KeyFile)
	k1, err := LoadKey(p)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 || len(k1) != 32 {
		t.Fatalf("key file mode %v, %d bytes; want 0600, 32", st.Mode().Perm(), len(k1))
	}
	k2, err := LoadKey(p)
	if err != nil || !bytes.Equal(k1, k2) {
		t.Fatalf("reload: %v, same=%v", err, bytes.Equal(k1, k2))
	}
	for _, mode := range []os.FileMode{0o640, 0o604, 0o644} {
		os.Chmod(p, mode)
		if _, err := LoadKey(p); err == nil || !strings.Contains(err.Error(), "refusing to start") {
			t.Fatalf("mode %o: err = %v, want a refusal", mode, err)
		}
	}
	os.Chmod(p, 0o600)
	os.WriteFile(p, []byte("short"), 0o600)
	if _, err := LoadKey(p); err == nil {
		t.Fatal("a 5-byte key was accepted")
	}
}

func TestSetGetRotateEncrypted(t *testing.T) {
	s, dir := openTest(t)
	ctx := context.Background()
	value := []byte("sk-live-THEVALUE-0123456789abcdef")
	sec, created, err := s.Set(ctx, SetRequest{Tenant: "t1", Name: "API_TOKEN", Value: value, Hosts: []string{"API.example.com.", "*.example.org"}, Header: "Authorization:   Bearer {}"})
	if err != nil || !created {
		t.Fatalf("set: %v created=%v", err, created)
	}
	if sec.Version != 1 || sec.Header != "Authorization: Bearer {}" || strings.Join(sec.Hosts, ",") != "*.example.org,api.example.com" {
		t.Fatalf("secret = %+v", sec)
	}
	_, v, err := s.Value(ctx, "t1", "API_TOKEN")
	if err != nil || !bytes.Equal(v, value) {
		t.Fatalf("value: %v %q", err, v)
	}
	// Another tenant does not see it.
	if _, err := s.Get(ctx, "t2", "API_TOKEN"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("other tenant: %v", err)
	}
	sec2, created, err := s.Set(ctx, SetRequest{Tenant: "t1", Name: "API_TOKEN", Value: []byte("rotated-VALUE-2"), Hosts: []string{"api.example.com"}})
	if err != nil || created || sec2.Version != 2 || !sec2.CreatedAt.Equal(sec.CreatedAt) {
		t.Fatalf("rotate: %v created=%v %+v", err, created, sec2)
	}
	if _, v, _ := s.Value(ctx, "t1", "API_TOKEN"); string(v) != "rotated-VALUE-2" {
		t.Fatalf("after rotation value = %q", v)
	}
	// The raw database (and its WAL) hold neither value in clear.
	for _, f := range []string{"space.db", "space.db-wal"} {
		b, _ := os.ReadFile(filepath.Join(dir, f))
		if bytes.Contains(b, value) || bytes.Contains(b, []byte("rotated-VALUE-2")) {
			t.Fatalf("%s holds a secret value in clear", f)
		}
	}
	// A record moved to another name does not decrypt (AAD).
	if _, err := s.db.Exec(`UPDATE secrets_values SET name = 'OTHER' WHERE name = 'API_TOKEN'`); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Value(ctx, "t1", "OTHER"); err == nil {
		t.Fatal("a record renamed in the database decrypted")
	}
}

func TestValidation(t *testing.T) {
	s, _ := openTest(t)
	ctx := context.Background()
	bad := []SetRequest{
		{Name: "lower", Value: []byte("x")},
		{Name: "1ABC", Value: []byte("x")},
		{Name: strings.Repeat("A", 65), Value: []byte("x")},
		{Name: "A", Value: nil},
		{Name: "A", Value: []byte("x"), Hosts: []string{"*"}},
		{Name: "A", Value: []byte("x"), Hosts: []string{"*.com"}},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com:443"}},
		{Name: "A", Value: []byte("x"), Hosts: []string{"1.2.3.4"}},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.*.com"}},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com"}, Header: "no colon"},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com"}, Header: "Bad Name: {}"},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com"}, Header: "Host: {}"},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com"}, Header: "X: {} {}"},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com"}, Header: "X: a\r\nY: {}"},
		{Name: "A", Value: []byte("x"), Header: "X: {}"},
		{Name: "A", Value: []byte("x"), Hosts: []string{"a.com"}, Header: "X: constant"},
		{Name: "A", Value: []byte("line\nbreak")},
		{Name: "A", Value: []byte("nul\x00")},
		{Name: "A", Value: bytes.Repeat([]byte("v"), MaxHeaderValueBytes+1)},
	}
	for _, r := range bad {
		if _, _, err := s.Set(ctx, r); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%+v: err = %v, want invalid argument", r, err)
		}
	}
	if _, _, err := s.Set(ctx, SetRequest{Name: "BIG", Value: make([]byte, MaxValueBytes+1)}); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Errorf("oversized value: %v", err)
	}
}

func TestGrants(t *testing.T) {
	s, _ := openTest(t)
	ctx := context.Background()
	if _, _, err := s.Grant(ctx, "sb-1", "", "NOPE"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("grant of a missing secret: %v", err)
	}
	s.Set(ctx, SetRequest{Name: "TOK", Value: []byte("v"), Hosts: []string{"a.example.com"}})
	g1, created, err := s.Grant(ctx, "sb-1", "", "TOK")
	if err != nil || !created || !strings.HasPrefix(g1.Placeholder, PlaceholderPrefix) || len(g1.Placeholder) != len(PlaceholderPrefix)+32 {
		t.Fatalf("grant: %v %+v", err, g1)
	}
	again, created, _ := s.Grant(ctx, "sb-1", "", "TOK")
	if created || again.Placeholder != g1.Placeholder {
		t.Fatal("a second grant changed the placeholder")
	}
	g2, _, _ := s.Grant(ctx, "sb-2", "", "TOK")
	if g2.Placeholder == g1.Placeholder {
		t.Fatal("two sandboxes share a placeholder")
	}
	if ids, _ := s.GrantedTo(ctx, "", "TOK"); strings.Join(ids, ",") != "sb-1,sb-2" {
		t.Fatalf("granted to %v", ids)
	}
	if err := s.Revoke(ctx, "sb-1", "TOK"); err != nil {
		t.Fatal(err)
	}
	if err := s.Revoke(ctx, "sb-1", "TOK"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second revoke: %v", err)
	}
	ids, err := s.Delete(ctx, "", "TOK")
	if err != nil || strings.Join(ids, ",") != "sb-2" {
		t.Fatalf("delete: %v %v", err, ids)
	}
	if gs, _ := s.Grants(ctx, "sb-2"); len(gs) != 0 {
		t.Fatalf("grants survive the secret: %v", gs)
	}
}

func TestCANameConstraints(t *testing.T) {
	s, dir := openTest(t)
	ctx := context.Background()
	ca, err := s.EnsureCA(ctx, "sb-1", []string{"api.example.com", "*.example.org"})
	if err != nil {
		t.Fatal(err)
	}
	same, _ := s.EnsureCA(ctx, "sb-1", []string{"*.example.org", "api.example.com"})
	if !bytes.Equal(same.CertPEM, ca.CertPEM) {
		t.Fatal("the same hosts made a new CA")
	}
	b, _ := os.ReadFile(filepath.Join(dir, "space.db"))
	b2, _ := os.ReadFile(filepath.Join(dir, "space.db-wal"))
	if bytes.Contains(append(b, b2...), ca.KeyPEM) {
		t.Fatal("the CA key is stored in clear")
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.CertPEM)
	caCert, _ := parseCert(ca.CertPEM)
	kb, _ := pem.Decode(ca.KeyPEM)
	caKey, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	for name, ok := range map[string]bool{
		"api.example.com": true, "x.example.org": true, "a.b.example.org": true,
		"example.org": false, "evil.com": false, "other.example.com": false,
	} {
		leafKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
			NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &leafKey.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		leaf, _ := x509.ParseCertificate(der)
		_, verr := leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: name})
		if (verr == nil) != ok {
			t.Errorf("%s: verify err = %v, want ok=%v", name, verr, ok)
		}
	}
	other, _ := s.EnsureCA(ctx, "sb-1", []string{"api.example.com"})
	if bytes.Equal(other.CertPEM, ca.CertPEM) {
		t.Fatal("a changed host set kept the old CA")
	}
	if err := s.ForgetSandbox(ctx, "sb-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CA(ctx, "sb-1"); err == nil {
		t.Fatal("CA survived ForgetSandbox")
	}
}

// TestSealer: a cluster-sealed value opens only as the tenant, name and
// version it was sealed for, and only with its key.
func TestSealer(t *testing.T) {
	key := make([]byte, 32)
	s, err := NewSealer(key)
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := s.Seal("acme", "gh", 2, []byte("v"))
	if err != nil {
		t.Fatal(err)
	}
	if v, err := s.Open("acme", "gh", 2, sealed); err != nil || string(v) != "v" {
		t.Fatalf("open: %q %v", v, err)
	}
	for _, c := range []struct {
		tenant, name string
		version      int
	}{{"other", "gh", 2}, {"acme", "gl", 2}, {"acme", "gh", 3}} {
		if _, err := s.Open(c.tenant, c.name, c.version, sealed); err == nil {
			t.Fatalf("opened as %+v", c)
		}
	}
	other, _ := NewSealer(append([]byte{1}, key[1:]...))
	if _, err := other.Open("acme", "gh", 2, sealed); err == nil {
		t.Fatal("opened with another key")
	}
	if _, _, err := (SetRequest{Name: "gh", Value: []byte("x"), Header: "Authorization: Bearer {}"}).Validate(); err == nil {
		t.Fatal("a header without hosts validated")
	}
}
