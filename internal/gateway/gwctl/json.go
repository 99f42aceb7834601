package gwctl

import (
	"bytes"
	"encoding/json"
)

func jsonStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	return d.Decode(v)
}
