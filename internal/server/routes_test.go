package server

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/sandbox"
)

// TestOpenAPIMatchesRoutes checks that every operation the OpenAPI file
// documents is routed by the server (and needs the API key where the file
// says so), and that undocumented paths are JSON 404s: the file served at
// /openapi.yaml must describe this server, not a plan.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	var doc struct {
		Paths map[string]map[string]yaml.Node `yaml:"paths"`
	}
	if err := yaml.Unmarshal(api.OpenAPI, &doc); err != nil {
		t.Fatal(err)
	}
	s := &Server{metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890"}
	h := s.routes()
	fill := strings.NewReplacer("{id}", "sb-aaaaaaaaaaaaaaaa", "{cid}", "cmd-aaaaaaaaaaaaaaaa", "{ref}", "base:latest")
	n := 0
	for path, ops := range doc.Paths {
		for method := range ops {
			method = strings.ToUpper(method)
			if method == "PARAMETERS" || path == "/metrics" || strings.HasSuffix(path, "/attach") {
				continue // these need a live store/manager; e2e covers them
			}
			n++
			req := httptest.NewRequest(method, fill.Replace(path), nil)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			public := path == "/healthz" || path == "/openapi.yaml"
			switch {
			case public && rec.Code != 200:
				t.Errorf("%s %s: public route answered %d", method, path, rec.Code)
			case !public && rec.Code != http.StatusUnauthorized:
				t.Errorf("%s %s: want 401 without the API key (routed, authenticated), got %d: %s", method, path, rec.Code, rec.Body)
			}
		}
	}
	if n < 30 {
		t.Fatalf("only %d documented operations checked; is the OpenAPI file complete?", n)
	}
	for _, c := range []struct {
		method, path string
		status       int
	}{
		{"GET", "/v1/nope", 404},
		{"PATCH", "/v1/sandboxes", 405},
	} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(c.method, c.path, nil))
		var e api.Error
		if rec.Code != c.status || json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Error.Code == "" {
			t.Errorf("%s %s: %d %s", c.method, c.path, rec.Code, rec.Body)
		}
	}
}

// TestOpenAPILifecycleSchemas keeps the documented Operation and fork body
// in step with the Go types the server really sends and accepts.
func TestOpenAPILifecycleSchemas(t *testing.T) {
	var doc struct {
		Components struct {
			Schemas map[string]struct {
				Properties map[string]struct {
					Maximum *int `yaml:"maximum"`
				} `yaml:"properties"`
			} `yaml:"schemas"`
		} `yaml:"components"`
	}
	if err := yaml.Unmarshal(api.OpenAPI, &doc); err != nil {
		t.Fatal(err)
	}
	for name, typ := range map[string]reflect.Type{
		"Operation":   reflect.TypeFor[api.Operation](),
		"ForkRequest": reflect.TypeFor[api.ForkRequest](),
	} {
		props := doc.Components.Schemas[name].Properties
		for i := range typ.NumField() {
			tag, _, _ := strings.Cut(typ.Field(i).Tag.Get("json"), ",")
			if _, ok := props[tag]; !ok {
				t.Errorf("schema %s lacks property %q", name, tag)
			}
		}
		if len(props) != typ.NumField() {
			t.Errorf("schema %s has %d properties, the Go type %d fields", name, len(props), typ.NumField())
		}
	}
	if m := doc.Components.Schemas["ForkRequest"].Properties["count"].Maximum; m == nil || *m != sandbox.MaxForkCount {
		t.Errorf("ForkRequest.count maximum %v, want %d", m, sandbox.MaxForkCount)
	}
}
