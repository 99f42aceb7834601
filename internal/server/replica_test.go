package server

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

func TestReplicaPassesOnlyTokenRoutesWithoutAKey(t *testing.T) {
	for _, c := range []struct {
		method, rest string
		token        bool
	}{
		{"GET", "commands/cmd-1/attach", true},
		{"POST", "commands/cmd-1/attach", false},
		{"GET", "commands/cmd-1", false},
		{"POST", "commands/cmd-1/token", false},
		{"GET", "ports/8080/tcp", true},
		{"PUT", "ports/8080/x/y", true},
		{"PUT", "ports/8080", false},
		{"POST", "exec", false},
		{"GET", "files", false},
	} {
		if got := tokenRoute(c.method, c.rest); got != c.token {
			t.Errorf("%s %s: token route %v, want %v", c.method, c.rest, got, c.token)
		}
	}
}

func TestIdempotencyKeyFormat(t *testing.T) {
	for _, ok := range []string{"", "a", "create-1", strings.Repeat("x", 128), "A~!#"} {
		if err := checkIdempotencyKey(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{strings.Repeat("x", 129), "a b", "a\tb", "ключ", "a\x00"} {
		if err := checkIdempotencyKey(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: %v, want invalid argument", bad, err)
		}
	}
}

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
