package api

import (
	"reflect"
	"strings"
	"testing"
)

// TestOpenAPISecretSchemas is TestOpenAPISchemasMatchTypes for the
// secrets types.
func TestOpenAPISecretSchemas(t *testing.T) {
	d := loadDoc(t)
	for name, v := range map[string]any{
		"SetSecretRequest": SetSecretRequest{}, "Secret": Secret{}, "SecretList": SecretList{},
		"SecretGrant": SecretGrant{}, "SecretGrantList": SecretGrantList{},
	} {
		s, ok := d.Components.Schemas[name]
		if !ok {
			t.Errorf("schema %s missing", name)
			continue
		}
		if got, want := schemaFields(d, s), jsonFields(reflect.TypeOf(v)); strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("schema %s fields\n got %v\nwant %v", name, got, want)
		}
	}
}
