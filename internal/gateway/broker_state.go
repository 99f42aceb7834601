package gateway

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
)

// Leaf certificates the gateway issues toward the sandbox: short-lived
// (a stolen one is worth a day at most, and only inside that sandbox, whose
// CA is its own), renewed well before they end.
const (
	leafValidity = 24 * time.Hour
	leafBackdate = time.Hour // client clocks a little behind still accept it
	leafRenew    = time.Hour // reissue when less than this is left
	// maxLeaves bounds a link's cache: a "*.suffix" host lets a sandbox
	// name any number of subdomains.
	maxLeaves = 256
	// maxSecrets bounds one brokerconf.Config.
	maxSecrets = 256
)

// forbiddenSecretHeaders may not be a secret's Header: they frame or route
// the request (as netpolicy forbids for header rules).
var forbiddenSecretHeaders = map[string]bool{
	"host": true, "content-length": true, "transfer-encoding": true,
	"connection": true, "upgrade": true, "te": true, "trailer": true,
	"keep-alive": true, "proxy-connection": true,
}

// broker is a link's compiled brokerconf.Config. Immutable but for the leaf
// cache; SetBroker replaces it whole, so a request sees one config.
type broker struct {
	ca      *x509.Certificate
	caKey   crypto.Signer
	secrets []*brokerSecret
	byName  map[string]*brokerSecret

	mu     sync.Mutex
	leaves map[string]*tls.Config // name → server config with its leaf
	// upSessions resumes TLS sessions with the real hosts (a resumed
	// session keeps the chain verified in its full handshake, and
	// crypto/tls checks it again for the name and the time).
	upSessions tls.ClientSessionCache
}

type brokerSecret struct {
	name        string
	hosts       []string // canonical exact names and "*.suffix" patterns
	header      string   // canonical header name; "" when none
	template    string   // with "{}" for the value
	placeholder string
	value       string
}

// forHost reports whether s may be sent to host (canonical).
func (s *brokerSecret) forHost(host string) bool {
	for _, h := range s.hosts {
		if hostMatch(h, host) {
			return true
		}
	}
	return false
}

// hostMatch matches a canonical name against an exact name or "*.suffix"
// (subdomains at any depth, not the apex), as netpolicy matches allow_out.
func hostMatch(pattern, host string) bool {
	if suffix, ok := strings.CutPrefix(pattern, "*."); ok {
		return strings.HasSuffix(host, "."+suffix)
	}
	return pattern == host
}

func invalidBroker(format string, a ...any) error {
	return fmt.Errorf("%w: broker: %s", errdefs.ErrInvalidArgument, fmt.Sprintf(format, a...))
}

// compileBroker validates b and parses its CA. A config with no secrets and
// no CA is nil: nothing is intercepted. Errors never quote a value.
func compileBroker(b brokerconf.Config) (*broker, error) {
	if len(b.CACertPEM) == 0 && len(b.CAKeyPEM) == 0 && len(b.Secrets) == 0 {
		return nil, nil
	}
	if len(b.Secrets) > maxSecrets {
		return nil, invalidBroker("%d secrets, at most %d", len(b.Secrets), maxSecrets)
	}
	ca, key, err := parseCA(b.CACertPEM, b.CAKeyPEM)
	if err != nil {
		return nil, err
	}
	br := &broker{ca: ca, caKey: key, byName: map[string]*brokerSecret{}, leaves: map[string]*tls.Config{},
		upSessions: tls.NewLRUClientSessionCache(maxLeaves)}
	for i, s := range b.Secrets {
		field := fmt.Sprintf("secrets[%d]", i)
		if s.Name == "" || len(s.Name) > 128 {
			return nil, invalidBroker("%s: a name of 1 to 128 bytes is required", field)
		}
		if br.byName[s.Name] != nil {
			return nil, invalidBroker("%s: secret %q appears twice", field, s.Name)
		}
		// A short placeholder could occur by chance in a request; the
		// secrets store makes long random ones.
		if len(s.Placeholder) < 8 || len(s.Placeholder) > 256 || hasCTL(s.Placeholder) {
			return nil, invalidBroker("%s (%s): placeholder must be 8 to 256 bytes without control characters", field, s.Name)
		}
		// The value goes into header values and queries as is: a CR or LF
		// would let it split the request.
		if len(s.Value) == 0 || len(s.Value) > netpolicy.MaxHeaderValue || hasCTL(string(s.Value)) {
			return nil, invalidBroker("%s (%s): value must be 1 to %d bytes without control characters", field, s.Name, netpolicy.MaxHeaderValue)
		}
		if len(s.Hosts) == 0 {
			return nil, invalidBroker("%s (%s): no hosts", field, s.Name)
		}
		bs := &brokerSecret{name: s.Name, placeholder: s.Placeholder, value: string(s.Value)}
		for j, h := range s.Hosts {
			p, ok := canonicalPattern(h)
			if !ok {
				return nil, invalidBroker("%s (%s).hosts[%d]: %q is not a name or \"*.suffix\"", field, s.Name, j, clip(h, 255))
			}
			bs.hosts = append(bs.hosts, p)
		}
		if s.Header != "" {
			name, tmpl, ok := strings.Cut(s.Header, ":")
			name, tmpl = strings.TrimSpace(name), strings.TrimSpace(tmpl)
			if !ok || !isToken(name) || hasCTL(tmpl) || !strings.Contains(tmpl, "{}") {
				return nil, invalidBroker("%s (%s): header must be \"Name: template\" with {} standing for the value", field, s.Name)
			}
			if forbiddenSecretHeaders[strings.ToLower(name)] {
				return nil, invalidBroker("%s (%s): header %q frames or routes the request and cannot be set", field, s.Name, name)
			}
			bs.header, bs.template = canonicalHeader(name), tmpl
		}
		br.secrets = append(br.secrets, bs)
		br.byName[s.Name] = bs
	}
	return br, nil
}

func parseCA(certPEM, keyPEM []byte) (*x509.Certificate, crypto.Signer, error) {
	cb, _ := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" {
		return nil, nil, invalidBroker("ca_cert_pem: no PEM certificate")
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, invalidBroker("ca_cert_pem: %v", err)
	}
	if !ca.IsCA || ca.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, nil, invalidBroker("ca_cert_pem: not a CA certificate (basic constraints CA and key usage cert sign)")
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, nil, invalidBroker("ca_key_pem: no PEM key")
	}
	var k any
	switch kb.Type {
	case "EC PRIVATE KEY":
		k, err = x509.ParseECPrivateKey(kb.Bytes)
	case "RSA PRIVATE KEY":
		k, err = x509.ParsePKCS1PrivateKey(kb.Bytes)
	default:
		k, err = x509.ParsePKCS8PrivateKey(kb.Bytes)
	}
	if err != nil {
		// Never quote the key or the parser's view of it.
		return nil, nil, invalidBroker("ca_key_pem: not a private key")
	}
	signer, ok := k.(crypto.Signer)
	if !ok {
		return nil, nil, invalidBroker("ca_key_pem: unsupported key type")
	}
	type pub interface{ Equal(crypto.PublicKey) bool }
	if p, ok := signer.Public().(pub); !ok || !p.Equal(ca.PublicKey) {
		return nil, nil, invalidBroker("ca_key_pem does not match ca_cert_pem")
	}
	return ca, signer, nil
}

// canonicalPattern lowercases an exact name or "*.suffix" and checks it.
func canonicalPattern(h string) (string, bool) {
	if suffix, ok := strings.CutPrefix(h, "*."); ok {
		n, valid := netpolicy.CanonicalName(suffix)
		return "*." + n, valid && strings.Contains(n, ".")
	}
	return netpolicy.CanonicalName(h)
}

func hasCTL(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 && c != '\t' || c == 0x7f {
			return true
		}
	}
	return false
}

func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// serverConfig returns the TLS config toward the sandbox for name: a leaf
// issued by the sandbox's CA, ALPN http/1.1. Cached (with its session
// ticket keys, so the sandbox's clients can resume) while the leaf has
// leafRenew left.
func (b *broker) serverConfig(name string) (*tls.Config, error) {
	now := time.Now()
	b.mu.Lock()
	conf := b.leaves[name]
	b.mu.Unlock()
	if conf != nil && now.Add(leafRenew).Before(conf.Certificates[0].Leaf.NotAfter) {
		return conf, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		DNSNames:     []string{name},
		NotBefore:    now.Add(-leafBackdate),
		NotAfter:     now.Add(leafValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, b.ca, &key.PublicKey, b.caKey)
	if err != nil {
		return nil, fmt.Errorf("issue leaf for %s: %w", name, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	conf = &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}},
		NextProtos:   httpALPN,
		MinVersion:   tls.VersionTLS12,
	}
	b.mu.Lock()
	if len(b.leaves) >= maxLeaves {
		clear(b.leaves)
	}
	b.leaves[name] = conf
	b.mu.Unlock()
	return conf, nil
}

// SetBroker replaces the credential-brokering config of an attached sandbox
// (its CA and granted secrets); it takes effect on the next request, also on
// connections already intercepted. An empty config stops interception of
// new connections. An id with no link is ErrNotFound: a config lives exactly
// as long as the link (the server pushes it after every attach, and a
// gateway that restarts has none), so no secret stays in memory for a
// sandbox this gateway does not serve.
func (g *Gateway) SetBroker(id string, b brokerconf.Config) error {
	br, err := compileBroker(b)
	if err != nil {
		return err
	}
	l, err := g.link(id)
	if err != nil {
		return err
	}
	l.broker.Store(br)
	names := make([]string, 0, len(b.Secrets))
	for _, s := range b.Secrets {
		names = append(names, s.Name)
	}
	l.events.add(brokerEvent(names))
	return nil
}
