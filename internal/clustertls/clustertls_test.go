package clustertls

import (
	"crypto/tls"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// member issues role/name from the CA in caDir and loads it.
func member(t *testing.T, caDir, role, name string, hosts ...string) *Identity {
	t.Helper()
	out := filepath.Join(t.TempDir(), name)
	if err := Issue(caDir, role, name, hosts, out, time.Hour); err != nil {
		t.Fatal(err)
	}
	id, err := Load(filepath.Join(caDir, CACertFile), out+".crt", out+".key")
	if err != nil {
		t.Fatal(err)
	}
	if id.Role != role || id.Name != name {
		t.Fatalf("loaded %s/%s, issued %s/%s", id.Role, id.Name, role, name)
	}
	return id
}

func TestOnlyReplicasReachNodesAndOnlyTheNamedNodeAnswers(t *testing.T) {
	ca := t.TempDir()
	if err := NewCA(ca, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := NewCA(ca, time.Hour); err == nil {
		t.Fatal("NewCA overwrote an existing CA")
	}
	if st, err := os.Stat(filepath.Join(ca, CAKeyFile)); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("CA key mode: %v %v", st, err)
	}
	n1 := member(t, ca, RoleNode, "n1", "127.0.0.1")
	r1 := member(t, ca, RoleReplica, "r1")

	srvCfg, err := n1.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		role, name, err := Peer(*r.TLS)
		if err != nil {
			t.Error(err)
		}
		io.WriteString(w, role+"/"+name)
	}))
	srv.TLS = srvCfg
	srv.StartTLS()
	defer srv.Close()

	get := func(cfg *tls.Config) (string, error) {
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 5 * time.Second}
		resp, err := c.Get(srv.URL)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	cfg, err := r1.ClientConfig("n1")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := get(cfg); err != nil || got != "replica/r1" {
		t.Fatalf("replica to its node: %q %v", got, err)
	}
	// The replica expects n2 at this address: n1 answering is refused.
	cfg, _ = r1.ClientConfig("n2")
	if _, err := get(cfg); err == nil || !strings.Contains(err.Error(), "not node n2") {
		t.Fatalf("a node answering for another: %v", err)
	}
	// A node's certificate cannot call a node, even by hand.
	if _, err := n1.ClientConfig("n1"); err == nil {
		t.Fatal("a node identity made a client config")
	}
	n2 := member(t, ca, RoleNode, "n2", "127.0.0.1")
	if _, err := get(&tls.Config{Certificates: []tls.Certificate{n2.cert}, RootCAs: n2.pool}); err == nil {
		t.Fatal("a node's certificate reached another node's cluster listener")
	}
	// No certificate, or one from another CA: refused.
	if _, err := get(&tls.Config{RootCAs: r1.pool}); err == nil {
		t.Fatal("no client certificate got through")
	}
	other := t.TempDir()
	if err := NewCA(other, time.Hour); err != nil {
		t.Fatal(err)
	}
	stranger := member(t, other, RoleReplica, "r1")
	if _, err := get(&tls.Config{Certificates: []tls.Certificate{stranger.cert}, RootCAs: r1.pool}); err == nil {
		t.Fatal("a replica certificate of another CA got through")
	}
	// Loading a certificate against the wrong CA is refused up front.
	out := filepath.Join(t.TempDir(), "x")
	if err := Issue(other, RoleReplica, "x", nil, out, time.Hour); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(filepath.Join(ca, CACertFile), out+".crt", out+".key"); err == nil || !strings.Contains(err.Error(), "not signed by the cluster CA") {
		t.Fatalf("a certificate of another CA loaded: %v", err)
	}
	if _, err := n1.ServerConfig(); err != nil {
		t.Fatal(err)
	}
	if _, err := r1.ServerConfig(); err == nil {
		t.Fatal("a replica identity made a node's server config")
	}
	for _, bad := range []struct{ role, name string }{{"admin", "x"}, {RoleNode, "../x"}, {RoleNode, ""}} {
		if err := Issue(ca, bad.role, bad.name, []string{"127.0.0.1"}, out, time.Hour); err == nil {
			t.Fatalf("issued %s/%q", bad.role, bad.name)
		}
	}
	if err := Issue(ca, RoleNode, "n3", nil, out, time.Hour); err == nil {
		t.Fatal("issued a node certificate without hosts")
	}
}
