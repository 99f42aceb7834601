package api

import (
	"encoding/json"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// doc is the part of an OpenAPI document the tests look at.
type doc struct {
	OpenAPI    string                          `yaml:"openapi"`
	Paths      map[string]map[string]yaml.Node `yaml:"paths"`
	Components struct {
		Schemas         map[string]schema         `yaml:"schemas"`
		SecuritySchemes map[string]map[string]any `yaml:"securitySchemes"`
		Responses       map[string]any            `yaml:"responses"`
		Parameters      map[string]any            `yaml:"parameters"`
	} `yaml:"components"`
}

type schema struct {
	Ref        string            `yaml:"$ref"`
	Type       any               `yaml:"type"`
	Properties map[string]schema `yaml:"properties"`
	Required   []string          `yaml:"required"`
	AllOf      []schema          `yaml:"allOf"`
}

func loadDoc(t *testing.T) doc {
	t.Helper()
	var d doc
	if err := yaml.Unmarshal(OpenAPI, &d); err != nil {
		t.Fatalf("openapi.yaml does not parse: %v", err)
	}
	if d.OpenAPI != "3.1.0" {
		t.Fatalf("openapi version %q, want 3.1.0", d.OpenAPI)
	}
	return d
}

// TestOpenAPIRoutes checks each documented operation: it has responses,
// documents the 401 it can answer unless it is public (security: []), and
// only /healthz, /openapi.yaml and /metrics are public. Whether the server
// registers exactly these operations is checked against its own route
// table in internal/server (TestOpenAPIMatchesRoutes).
func TestOpenAPIRoutes(t *testing.T) {
	d := loadDoc(t)
	n := 0
	for path, ops := range d.Paths {
		for method, op := range ops {
			if method == "parameters" {
				continue
			}
			n++
			r := strings.ToUpper(method) + " " + path
			var o struct {
				Responses map[string]any         `yaml:"responses"`
				Security  *[]map[string][]string `yaml:"security"`
			}
			if err := op.Decode(&o); err != nil {
				t.Errorf("%s: %v", r, err)
				continue
			}
			if len(o.Responses) == 0 {
				t.Errorf("%s has no responses", r)
			}
			public := o.Security != nil && len(*o.Security) == 0
			// Every request with a body can be refused for its size.
			if _, ok := o.Responses["413"]; (method == "post" || method == "put") && !ok {
				t.Errorf("%s does not document 413", r)
			}
			if _, ok := o.Responses["401"]; !public && !ok {
				t.Errorf("%s does not document 401", r)
			}
			if wantPublic := path == "/healthz" || path == "/openapi.yaml" || path == "/metrics"; public != wantPublic {
				t.Errorf("%s: public %v, want %v", r, public, wantPublic)
			}
		}
	}
	if n < 40 {
		t.Errorf("only %d operations documented", n)
	}
	for _, s := range []string{"apiKey", "attachToken", "attachTokenQuery"} {
		if _, ok := d.Components.SecuritySchemes[s]; !ok {
			t.Errorf("security scheme %s missing", s)
		}
	}
}

// TestOpenAPISchemasMatchTypes checks that each schema names exactly the
// JSON fields of its Go type, so the document cannot drift from types.go.
func TestOpenAPISchemasMatchTypes(t *testing.T) {
	d := loadDoc(t)
	types := map[string]any{
		"Error": Error{}, "ErrorBody": ErrorBody{}, "Limits": Limits{}, "IdlePolicy": IdlePolicy{},
		"CreateSandboxRequest": CreateSandboxRequest{}, "Sandbox": Sandbox{}, "SandboxList": SandboxList{},
		"CreateSandboxResponse": CreateSandboxResponse{}, "Phase": Phase{}, "Operation": Operation{},
		"ForkRequest": ForkRequest{}, "ExecRequest": ExecRequest{}, "CreateCommandRequest": CreateCommandRequest{},
		"ExecResult": ExecResult{}, "ExitStatus": ExitStatus{}, "Command": Command{}, "CommandList": CommandList{},
		"SignalRequest": SignalRequest{}, "Resize": Resize{}, "Dropped": Dropped{}, "Started": Started{},
		"FileInfo": FileInfo{}, "FileList": FileList{}, "MkdirRequest": MkdirRequest{}, "RenameRequest": RenameRequest{},
		"Template": Template{}, "TemplateList": TemplateList{}, "RuntimeInfo": RuntimeInfo{}, "Info": Info{},
		"TemplateConfig": TemplateConfig{}, "StartCommand": StartCommand{}, "TemplateLayer": TemplateLayer{},
		"TagRequest": TagRequest{}, "PullRequest": PullRequest{}, "GCResult": GCResult{}, "BuildEvent": BuildEvent{},
		"NetworkPolicy": NetworkPolicy{}, "HeaderRule": HeaderRule{}, "NetworkInfo": NetworkInfo{},
		"NetworkStats": NetworkStats{}, "NetworkEvent": NetworkEvent{}, "SandboxStats": SandboxStats{},
		"APIKey": APIKey{}, "CreateKeyRequest": CreateKeyRequest{}, "CreatedKey": CreatedKey{}, "KeyList": KeyList{},
		"Quotas": Quotas{}, "Usage": Usage{}, "Tenant": Tenant{}, "TenantList": TenantList{},
		"PoolSpec": PoolSpec{}, "Pool": Pool{}, "PoolList": PoolList{},
		"AuditRecord": AuditRecord{}, "AuditRecordList": AuditRecordList{}, "AuditKey": AuditKey{}, "AuditKeyList": AuditKeyList{},
	}
	for name, v := range types {
		s, ok := d.Components.Schemas[name]
		if !ok {
			t.Errorf("schema %s missing", name)
			continue
		}
		got := schemaFields(d, s)
		want := jsonFields(reflect.TypeOf(v))
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("schema %s fields\n got %v\nwant %v", name, got, want)
		}
		// A required field must be one the Go type always emits.
		req := map[string]bool{}
		for _, f := range jsonRequired(reflect.TypeOf(v)) {
			req[f] = true
		}
		for _, r := range s.Required {
			if !req[r] {
				t.Errorf("schema %s requires %q, which Go omits when empty", name, r)
			}
		}
	}
}

func schemaFields(d doc, s schema) []string {
	var out []string
	seen := map[string]bool{}
	var walk func(schema)
	walk = func(s schema) {
		if s.Ref != "" {
			walk(d.Components.Schemas[strings.TrimPrefix(s.Ref, "#/components/schemas/")])
		}
		for _, a := range s.AllOf {
			walk(a)
		}
		for k := range s.Properties {
			if !seen[k] {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	walk(s)
	sort.Strings(out)
	return out
}

// jsonFields lists the JSON names of t's fields, following embedded structs.
func jsonFields(t reflect.Type) []string {
	var out []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Anonymous {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// jsonRequired lists the fields Go always emits (no omitempty).
func jsonRequired(t reflect.Type) []string {
	var out []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Anonymous {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" && !strings.Contains(opts, "omitempty") {
			out = append(out, name)
		}
	}
	return out
}

// TestOpenAPIExampleShapes round-trips zero values through JSON and checks
// that every emitted key is a property of the schema (nil slices become null,
// which the schemas allow with type [array, "null"]).
func TestOpenAPIExampleShapes(t *testing.T) {
	d := loadDoc(t)
	b, _ := json.Marshal(Operation{ID: "op", CreatedAt: time.Unix(0, 0)})
	var m map[string]any
	json.Unmarshal(b, &m)
	if m["phases"] != nil {
		t.Fatalf("expected a nil phases slice to encode as null, got %v", m["phases"])
	}
	ph := d.Components.Schemas["Operation"].Properties["phases"]
	if !reflect.DeepEqual(ph.Type, []any{"array", "null"}) {
		t.Fatalf("Operation.phases type %v must allow null", ph.Type)
	}
}

// TestOpenAPIErrorCodes keeps the documented error codes equal to the
// code ↔ status table the server and the SDK share.
func TestOpenAPIErrorCodes(t *testing.T) {
	var d struct {
		Components struct {
			Schemas struct {
				ErrorBody struct {
					Properties struct {
						Code struct {
							Enum []string `yaml:"enum"`
						} `yaml:"code"`
					} `yaml:"properties"`
				} `yaml:"ErrorBody"`
			} `yaml:"schemas"`
		} `yaml:"components"`
	}
	if err := yaml.Unmarshal(OpenAPI, &d); err != nil {
		t.Fatal(err)
	}
	got := d.Components.Schemas.ErrorBody.Properties.Code.Enum
	if strings.Join(got, ",") != strings.Join(ErrorCodes(), ",") {
		t.Errorf("ErrorBody.code enum %v, want %v", got, ErrorCodes())
	}
	for _, c := range ErrorCodes() {
		if s := HTTPStatus(c); s < 400 || CodeForStatus(s) == "" {
			t.Errorf("code %s: status %d", c, s)
		}
	}
}
