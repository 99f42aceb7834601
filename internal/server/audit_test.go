package server

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/principal"
)

// TestAuditRequest: one API record per request, with the route's pattern,
// the path's ids, the status, and the key and tenant the route's
// authentication found — never the query, body or headers.
func TestAuditRequest(t *testing.T) {
	sink := &audit.Memory{}
	s := &Server{audit: sink}
	mux := http.NewServeMux()
	route := noteRequest(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	// What the authentication in front of a route does: a principal in
	// the context of the request the route's handler gets.
	mux.Handle("DELETE /v1/sandboxes/{id}/files", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		route.ServeHTTP(w, r.WithContext(principal.With(r.Context(), principal.Principal{KeyID: "key-7", Tenant: "team-a"})))
	}))
	serve := func(method, target, kind string) audit.Event {
		req := httptest.NewRequest(method, target, strings.NewReader("body-secret"))
		req.Header.Set("Authorization", "Bearer header-secret")
		r, ra := withRequestAudit(req)
		sw := &statusWriter{ResponseWriter: httptest.NewRecorder()}
		if kind == "" {
			mux.ServeHTTP(sw, r)
		} else {
			sw.WriteHeader(http.StatusTeapot)
		}
		(auditAPI{s}).auditRequest(r, ra, sw.code, kind)
		evs := sink.Events()
		return evs[len(evs)-1]
	}
	ev := serve("DELETE", "/v1/sandboxes/sb-x/files?path=/etc&token=query-secret", "")
	if ev.Kind != audit.KindAPI || ev.Action != "DELETE /v1/sandboxes/{id}/files" || ev.Target != "sb-x" || ev.Sandbox != "sb-x" ||
		ev.Result != "204" || ev.KeyID != "key-7" || ev.Tenant != "team-a" || ev.Detail["remote"] != "192.0.2.1:1234" {
		t.Fatalf("record: %+v", ev)
	}
	b, _ := json.Marshal(ev)
	for _, secret := range []string{"query-secret", "body-secret", "header-secret", "/etc"} {
		if strings.Contains(string(b), secret) {
			t.Errorf("the record carries %q: %s", secret, b)
		}
	}
	// No route, no principal: the default tenant, no key.
	ev = serve("GET", "/v1/nothing", "")
	if ev.Action != "GET (no route)" || ev.KeyID != "" || ev.Tenant != principal.DefaultTenant || ev.Result != "404" {
		t.Fatalf("unrouted: %+v", ev)
	}
	ev = serve("POST", "/e2b/sandboxes", "e2b")
	if ev.Action != "POST e2b" || ev.Target != "/e2b/sandboxes" || ev.Result != "418" {
		t.Fatalf("e2b: %+v", ev)
	}
}

func TestParseSince(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	if got, err := parseSince("2h", now); err != nil || !got.Equal(now.Add(-2*time.Hour)) {
		t.Fatalf("duration: %v %v", got, err)
	}
	if got, err := parseSince("2026-01-01T00:00:00Z", now); err != nil || got.Day() != 1 {
		t.Fatalf("rfc3339: %v %v", got, err)
	}
	if _, err := parseSince("yesterday", now); err == nil || !strings.Contains(err.Error(), "since must be") {
		t.Fatalf("bad since: %v", err)
	}
}
