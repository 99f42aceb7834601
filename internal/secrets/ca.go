package secrets

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"database/sql"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"slices"
	"strings"
	"time"
)

// CA is a sandbox's own certificate authority: the gateway signs leaf
// certificates for intercepted hosts with it; the sandbox trusts its
// certificate and never sees its key.
type CA struct {
	CertPEM []byte
	KeyPEM  []byte
	// Hosts are the names it may sign for (its name constraints).
	Hosts []string
}

// caValidity is how long a sandbox CA is valid; a sandbox that outlives it
// gets a new one the next time its host set changes or it boots.
const caValidity = 5 * 365 * 24 * time.Hour

func caAAD(sandbox string) []byte { return []byte("ca\x00" + sandbox) }

// EnsureCA returns sandbox's CA for exactly hosts (canonical, see
// CanonicalHosts), making and storing a new one when it has none, when its
// hosts differ, or when it is near expiry. hosts must not be empty: a
// sandbox without brokered hosts needs no CA.
func (s *Store) EnsureCA(ctx context.Context, sandbox string, hosts []string) (CA, error) {
	if len(hosts) == 0 {
		return CA{}, errors.New("a CA needs at least one host")
	}
	hosts = slices.Clone(hosts)
	slices.Sort(hosts)
	hosts = slices.Compact(hosts)
	cur, err := s.CA(ctx, sandbox)
	if err == nil && slices.Equal(cur.Hosts, hosts) {
		if c, perr := parseCert(cur.CertPEM); perr == nil && time.Until(c.NotAfter) > 30*24*time.Hour {
			return cur, nil
		}
	} else if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return CA{}, err
	}
	ca, err := NewCA(sandbox, hosts, s.now())
	if err != nil {
		return CA{}, err
	}
	sealed, err := s.seal(ca.KeyPEM, caAAD(sandbox))
	if err != nil {
		return CA{}, err
	}
	hj, _ := json.Marshal(hosts)
	if _, err := s.db.ExecContext(ctx, `INSERT INTO secrets_cas (sandbox, hosts, cert_pem, sealed_key, created_at) VALUES (?, ?, ?, ?, ?)
		ON CONFLICT (sandbox) DO UPDATE SET hosts = excluded.hosts, cert_pem = excluded.cert_pem, sealed_key = excluded.sealed_key, created_at = excluded.created_at`,
		sandbox, string(hj), ca.CertPEM, sealed, s.now().UnixNano()); err != nil {
		return CA{}, err
	}
	return ca, nil
}

// CA returns sandbox's stored CA; sql.ErrNoRows if it has none.
func (s *Store) CA(ctx context.Context, sandbox string) (CA, error) {
	var (
		ca     CA
		hj     string
		sealed []byte
	)
	if err := s.db.QueryRowContext(ctx, `SELECT hosts, cert_pem, sealed_key FROM secrets_cas WHERE sandbox = ?`, sandbox).Scan(&hj, &ca.CertPEM, &sealed); err != nil {
		return CA{}, err
	}
	if err := json.Unmarshal([]byte(hj), &ca.Hosts); err != nil {
		return CA{}, err
	}
	key, err := s.open(sealed, caAAD(sandbox))
	if err != nil {
		return CA{}, fmt.Errorf("the CA of sandbox %s: %w", sandbox, err)
	}
	ca.KeyPEM = key
	return ca, nil
}

// NewCA makes a self-signed ECDSA P-256 CA for sandbox whose name
// constraints permit only hosts ("*.suffix" permits the suffix's
// subdomains only) and no IP address, so even its holder cannot use it to
// impersonate any other name to the sandbox.
func NewCA(sandbox string, hosts []string, now time.Time) (CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return CA{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return CA{}, err
	}
	var permitted []string
	for _, h := range hosts {
		if suf, ok := strings.CutPrefix(h, "*."); ok {
			permitted = append(permitted, "."+suf) // subdomains only
		} else {
			permitted = append(permitted, h)
		}
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return CA{}, err
	}
	ski := sha256.Sum256(pub)
	tmpl := &x509.Certificate{
		SerialNumber:                serial,
		Subject:                     pkix.Name{CommonName: "space sandbox CA " + sandbox, Organization: []string{"space"}},
		NotBefore:                   now.Add(-time.Hour),
		NotAfter:                    now.Add(caValidity),
		KeyUsage:                    x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid:       true,
		IsCA:                        true,
		MaxPathLenZero:              true,
		SubjectKeyId:                ski[:20],
		PermittedDNSDomainsCritical: true,
		PermittedDNSDomains:         permitted,
		ExcludedIPRanges: []*net.IPNet{
			{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
			{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
		},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return CA{}, err
	}
	kd, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return CA{}, err
	}
	return CA{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd}),
		Hosts:   slices.Clone(hosts),
	}, nil
}

func parseCert(p []byte) (*x509.Certificate, error) {
	b, _ := pem.Decode(p)
	if b == nil {
		return nil, errors.New("no PEM block")
	}
	return x509.ParseCertificate(b.Bytes)
}
