package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
)

// On a node, the principal header counts only on a connection the
// cluster listener verified as a replica's.
func TestReplicaPrincipalOnlyFromTheClusterListener(t *testing.T) {
	r := httptest.NewRequest(http.MethodGet, "/v1/sandboxes", nil)
	r.Header.Set(PrincipalHeader, `{"Tenant":"default","Scopes":["admin"]}`)
	if _, ok, _ := replicaPrincipal(r); ok {
		t.Fatal("a principal header was honoured outside the cluster listener")
	}
	vouched := r.WithContext(context.WithValue(r.Context(), replicaKey{}, "r1"))
	p, ok, err := replicaPrincipal(vouched)
	if !ok || err != nil || p.Tenant != "default" || !p.Admin() {
		t.Fatalf("vouched principal %+v %v %v", p, ok, err)
	}
	for _, bad := range []string{"", "{", `{"Tenant":"Bad Tenant","Scopes":["admin"]}`, `{"Tenant":"t","Scopes":["root"]}`, `{"Tenant":"t","Scopes":[]}`} {
		vouched.Header.Set(PrincipalHeader, bad)
		if bad == "" {
			vouched.Header.Del(PrincipalHeader)
		}
		if _, ok, err := replicaPrincipal(vouched); !ok || err == nil {
			t.Errorf("principal %q accepted: %v", bad, err)
		}
	}
	// fromReplica refuses a plain-HTTP request outright.
	w := httptest.NewRecorder()
	(&Server{}).fromReplica(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		t.Fatal("a request without TLS reached the handler")
	})).ServeHTTP(w, r)
	if w.Code != http.StatusUnauthorized {
		t.Fatalf("plain request to the cluster handler: %d", w.Code)
	}
}
