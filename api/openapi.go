package api

import _ "embed"

// OpenAPI is the OpenAPI 3.1 description of the REST API (openapi.yaml),
// served by the server at GET /openapi.yaml.
//
//go:embed openapi.yaml
var OpenAPI []byte
