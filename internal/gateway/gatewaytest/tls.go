package gatewaytest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"time"
)

// CA is a certificate authority of a test: a sandbox's broker CA, or the
// one a local HTTPS server standing in for a real host is issued by.
type CA struct {
	Cert    *x509.Certificate
	Key     *ecdsa.PrivateKey
	CertPEM []byte
	KeyPEM  []byte
}

// NewCA makes a self-signed ECDSA CA named name.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key,
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})}, nil
}

// Pool is a pool holding only this CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Issue makes a server certificate for names.
func (ca *CA) Issue(names ...string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: names[0]},
		DNSNames:     names,
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return tls.Certificate{}, err
	}
	leaf, _ := x509.ParseCertificate(der)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// ServeEcho starts an HTTPS server on addr ("127.0.0.2:0") with cert that
// answers every request with what it received: "method M", "host H",
// "uri U", then each header as "Name: value", sorted, one per line, then
// the body, if any, after "body ". It stands in for a real host behind a
// brokered name. It returns the port and a stop function.
func ServeEcho(addr string, cert tls.Certificate) (port uint16, stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return 0, nil, err
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(echo))
	srv.Listener.Close()
	srv.Listener = ln
	// h2 too, as real hosts do: a client relayed as is can take it.
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
	srv.StartTLS()
	return uint16(ln.Addr().(*net.TCPAddr).Port), srv.Close, nil
}

func echo(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Upgrade") == "echo" {
		// A protocol switch: after the 101, every byte comes back.
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		_ = brw.Flush()
		buf := make([]byte, 4096)
		for {
			n, err := brw.Read(buf)
			if n > 0 {
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	if r.URL.Path == "/chunked" {
		// A streamed (chunked) response in two parts.
		_, _ = w.Write([]byte("part one\n"))
		http.NewResponseController(w).Flush()
		_, _ = w.Write([]byte("part two\n"))
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "method %s\nhost %s\nuri %s\n", r.Method, r.Host, r.RequestURI)
	keys := make([]string, 0, len(r.Header))
	for k := range r.Header {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		for _, v := range r.Header[k] {
			fmt.Fprintf(&b, "%s: %s\n", k, v)
		}
	}
	if r.ContentLength != 0 {
		body := make([]byte, 1<<20)
		n, _ := readFull(r, body)
		fmt.Fprintf(&b, "body %s\n", body[:n])
	}
	w.Header().Set("Content-Type", "text/plain")
	_, _ = w.Write([]byte(b.String()))
}

func readFull(r *http.Request, p []byte) (int, error) {
	n := 0
	for n < len(p) {
		k, err := r.Body.Read(p[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
