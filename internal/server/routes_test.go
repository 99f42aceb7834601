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
)

// TestOpenAPIMatchesRoutes compares the routes the server registers (its
// route table) with the operations api/openapi.yaml documents, both ways:
// the file served at /openapi.yaml must describe this server, not a plan.
// Each documented operation must be answered by its own registration — a
// request for it resolved by the mux to exactly that pattern, not to a
// catch-all — with the access the file documents (public routes answer
// without a key, the others 401); undocumented paths are JSON 404s.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	var doc struct {
		Paths map[string]map[string]yaml.Node `yaml:"paths"`
	}
	if err := yaml.Unmarshal(api.OpenAPI, &doc); err != nil {
		t.Fatal(err)
	}
	s := withKeys(t, &Server{metrics: newMetrics(nil), apiKey: "sk_test_key_1234567890"})
	table := map[string]route{}
	for _, rt := range s.routeTable() {
		if _, dup := table[rt.pattern]; dup {
			t.Errorf("%s registered twice", rt.pattern)
		}
		table[rt.pattern] = rt
	}
	documented := map[string]bool{}
	for path, ops := range doc.Paths {
		for method, node := range ops {
			if method == "parameters" {
				continue
			}
			pattern := strings.ToUpper(method) + " " + path
			documented[pattern] = true
			rt, ok := table[pattern]
			if !ok {
				t.Errorf("%s is documented but the server registers no such route", pattern)
				continue
			}
			var op struct {
				Security *[]map[string][]string `yaml:"security"`
			}
			if err := node.Decode(&op); err != nil {
				t.Fatalf("%s: %v", pattern, err)
			}
			var want access
			switch {
			case op.Security == nil:
				want = apiKey // the document's default
			case len(*op.Security) == 0:
				want = public
			default:
				want = attachToken
				for _, req := range *op.Security {
					if _, ok := req["apiKey"]; ok {
						want = apiKey
					}
				}
				for _, req := range *op.Security {
					if _, ok := req["portToken"]; ok {
						want = portToken // the token, the API key or a public port
					}
				}
			}
			if rt.access != want {
				t.Errorf("%s: server access %d, documented %d", pattern, rt.access, want)
			}
		}
	}
	for pattern, rt := range table {
		if !rt.fallback && !documented[pattern] {
			t.Errorf("%s is a route but not documented in api/openapi.yaml", pattern)
		}
		if rt.fallback && documented[pattern] {
			t.Errorf("%s is a fallback but documented", pattern)
		}
	}
	if len(documented) < 40 {
		t.Fatalf("only %d documented operations; is the OpenAPI file complete?", len(documented))
	}

	mux, _ := s.mux()
	h := s.routes()
	fill := strings.NewReplacer("{id}", "sb-aaaaaaaaaaaaaaaa", "{cid}", "cmd-aaaaaaaaaaaaaaaa", "{ref}", "base:latest",
		"{port}", "8000", "{path...}", "some/path")
	for pattern := range documented {
		method, path, _ := strings.Cut(pattern, " ")
		req := httptest.NewRequest(method, fill.Replace(path), nil)
		if _, got := mux.Handler(req); got != pattern {
			t.Errorf("%s %s is served by %q, not its own route %q", method, fill.Replace(path), got, pattern)
		}
		rt := table[pattern]
		if rt.access == attachToken || rt.access == portToken || path == "/metrics" {
			continue // these need a live manager or registry; e2e covers them
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		switch {
		case rt.access == public && rec.Code != 200:
			t.Errorf("%s: public route answered %d", pattern, rec.Code)
		case rt.access == apiKey && rec.Code != http.StatusUnauthorized:
			t.Errorf("%s: want 401 without the API key, got %d: %s", pattern, rec.Code, rec.Body)
		}
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
	if m := doc.Components.Schemas["ForkRequest"].Properties["count"].Maximum; m == nil || *m != api.MaxForkCount {
		t.Errorf("ForkRequest.count maximum %v, want %d", m, api.MaxForkCount)
	}
}
