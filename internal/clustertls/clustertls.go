// Package clustertls is the mutual TLS between a cluster's API replicas and
// its nodes: a cluster CA, certificates that name a member's role and name,
// and the TLS configurations each side uses.
//
// A member's identity is one URI SAN, space://<role>/<name> (role "node" or
// "replica"). A node serves its cluster listener only to replicas (a node's
// certificate cannot call another node), and a replica talks to a node only
// when the certificate it is shown names the node the cluster store says is
// at that address — a node cannot answer for another.
package clustertls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// Roles a certificate can name.
const (
	RoleNode    = "node"
	RoleReplica = "replica"
)

const scheme = "space"

// Files of a CA directory.
const (
	CACertFile = "ca.crt"
	CAKeyFile  = "ca.key"
)

var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$`)

// ValidName checks a member's name (a node id or a replica's name).
func ValidName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("cluster member name %q must be 1-63 letters, digits, '.', '_' or '-'", name)
	}
	return nil
}

// NewCA writes a fresh cluster CA (ca.crt, and ca.key mode 0600) into dir.
// An existing CA is never overwritten.
func NewCA(dir string, validity time.Duration) error {
	if _, err := os.Stat(filepath.Join(dir, CAKeyFile)); err == nil {
		return fmt.Errorf("%s already holds a CA key: %w", dir, os.ErrExist)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "space cluster CA"},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	if err := writeKey(filepath.Join(dir, CAKeyFile), key); err != nil {
		return err
	}
	return writePEM(filepath.Join(dir, CACertFile), "CERTIFICATE", der, 0o644)
}

// Issue signs a certificate for a member with the CA in caDir and writes
// <out>.crt and <out>.key (0600). hosts are the IP addresses and DNS names
// a node is reached at (its advertise address's host); a replica needs none.
func Issue(caDir, role, name string, hosts []string, out string, validity time.Duration) error {
	if role != RoleNode && role != RoleReplica {
		return fmt.Errorf("role %q: want %s or %s", role, RoleNode, RoleReplica)
	}
	if err := ValidName(name); err != nil {
		return err
	}
	if role == RoleNode && len(hosts) == 0 {
		return errors.New("a node's certificate needs the hosts replicas reach it at")
	}
	caCert, caKey, err := loadCA(caDir)
	if err != nil {
		return err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: role + "/" + name},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		URIs:         []*url.URL{{Scheme: scheme, Host: role, Path: "/" + name}},
	}
	if role == RoleNode {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	} else {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	if err := writeKey(out+".key", key); err != nil {
		return err
	}
	return writePEM(out+".crt", "CERTIFICATE", der, 0o644)
}

func loadCA(dir string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cb, err := os.ReadFile(filepath.Join(dir, CACertFile))
	if err != nil {
		return nil, nil, err
	}
	kb, err := os.ReadFile(filepath.Join(dir, CAKeyFile))
	if err != nil {
		return nil, nil, err
	}
	pair, err := tls.X509KeyPair(cb, kb)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster CA in %s: %w", dir, err)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, nil, err
	}
	key, ok := pair.PrivateKey.(*ecdsa.PrivateKey)
	if !ok || !cert.IsCA {
		return nil, nil, fmt.Errorf("%s does not hold a cluster CA", dir)
	}
	return cert, key, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "PRIVATE KEY", der, 0o600)
}

// writePEM writes beside path and renames, so a reader never sees half a file.
func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Identity is a member's certificate and the cluster CA it trusts.
type Identity struct {
	Role, Name string
	cert       tls.Certificate
	pool       *x509.CertPool
}

// Load reads a member's certificate and key and the cluster CA's
// certificate, and checks that the certificate names a role and a name and
// was signed by that CA.
func Load(caFile, certFile, keyFile string) (*Identity, error) {
	cab, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("cluster CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(cab) {
		return nil, fmt.Errorf("cluster CA %s holds no PEM certificate", caFile)
	}
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("cluster certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, err
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, fmt.Errorf("cluster certificate %s is not signed by the cluster CA %s: %w", certFile, caFile, err)
	}
	role, name, err := identityOf(leaf)
	if err != nil {
		return nil, fmt.Errorf("cluster certificate %s: %w", certFile, err)
	}
	pair.Leaf = leaf
	return &Identity{Role: role, Name: name, cert: pair, pool: pool}, nil
}

// identityOf is the role and name a certificate's URI SAN names.
func identityOf(c *x509.Certificate) (role, name string, err error) {
	for _, u := range c.URIs {
		if u.Scheme != scheme {
			continue
		}
		role, name = u.Host, u.Path
		if len(name) > 1 && name[0] == '/' {
			name = name[1:]
		}
		if (role == RoleNode || role == RoleReplica) && ValidName(name) == nil {
			return role, name, nil
		}
	}
	return "", "", errors.New("it names no space://node/<name> or space://replica/<name> identity")
}

// ServerConfig is a node's cluster listener: TLS 1.3, and only a replica's
// certificate from the cluster CA gets through.
func (id *Identity) ServerConfig() (*tls.Config, error) {
	if id.Role != RoleNode {
		return nil, fmt.Errorf("a %s certificate cannot serve a node's cluster listener", id.Role)
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{id.cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    id.pool,
		VerifyConnection: func(cs tls.ConnectionState) error {
			role, name, err := Peer(cs)
			if err != nil {
				return err
			}
			if role != RoleReplica {
				return fmt.Errorf("cluster peer %s/%s is not a replica", role, name)
			}
			return nil
		},
	}, nil
}

// ClientConfig is a replica's TLS towards node: the certificate it is shown
// must come from the cluster CA and name that node.
func (id *Identity) ClientConfig(node string) (*tls.Config, error) {
	if id.Role != RoleReplica {
		return nil, fmt.Errorf("a %s certificate cannot call a node", id.Role)
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{id.cert},
		RootCAs:      id.pool,
		VerifyConnection: func(cs tls.ConnectionState) error {
			role, name, err := Peer(cs)
			if err != nil {
				return err
			}
			if role != RoleNode || name != node {
				return fmt.Errorf("the server at this address is %s/%s, not node %s", role, name, node)
			}
			return nil
		},
	}, nil
}

// Peer is the verified role and name of the other side of a connection.
func Peer(cs tls.ConnectionState) (role, name string, err error) {
	if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return "", "", errors.New("cluster peer presented no verified certificate")
	}
	return identityOf(cs.VerifiedChains[0][0])
}
