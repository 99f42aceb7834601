package api

import "net/http"

// Error codes: the stable values of ErrorBody.Code. The server derives the
// HTTP status of an error from its code (HTTPStatus); clients that meet an
// error body they cannot parse derive a code from the status (CodeForStatus).
// The Go SDK turns each code into a sentinel error (sdk.ErrNotFound, …).
const (
	CodeInvalidArgument  = "invalid_argument"   // 400: the request is malformed
	CodeUnauthorized     = "unauthorized"       // 401: missing or wrong API key or attach token
	CodePermissionDenied = "permission_denied"  // 403: the key lacks the scope, or a policy denied the action
	CodeNotFound         = "not_found"          // 404
	CodeMethodNotAllowed = "method_not_allowed" // 405: the path exists, not with this method
	CodeConflict         = "conflict"           // 409: wrong state, already exists
	CodePolicyDenied     = "policy_denied"      // 403: a policy rule (or an approver) refused the action
	CodeTooLarge         = "too_large"          // 413
	CodeQuotaExceeded    = "quota_exceeded"     // 429: the tenant's quota is used up
	CodeUnprocessable    = "unprocessable"      // 422: well-formed but semantically impossible
	CodeNotSupported     = "not_supported"      // 422: the runtime lacks a capability
	CodeUnavailable      = "unavailable"        // 503: transient (agent not reachable)
	CodeTimeout          = "timeout"            // 504
	CodeInternal         = "internal"           // 500: a bug
)

// errorStatus is the one code ↔ status table. Order matters for
// CodeForStatus: the first code of a status is the one a bare status maps to.
var errorStatus = []struct {
	code   string
	status int
}{
	{CodeInvalidArgument, http.StatusBadRequest},
	{CodeUnauthorized, http.StatusUnauthorized},
	{CodePermissionDenied, http.StatusForbidden},
	{CodeNotFound, http.StatusNotFound},
	{CodeMethodNotAllowed, http.StatusMethodNotAllowed},
	{CodeConflict, http.StatusConflict},
	{CodePolicyDenied, http.StatusForbidden},
	{CodeTooLarge, http.StatusRequestEntityTooLarge},
	{CodeQuotaExceeded, http.StatusTooManyRequests},
	{CodeUnprocessable, http.StatusUnprocessableEntity},
	{CodeNotSupported, http.StatusUnprocessableEntity},
	{CodeUnavailable, http.StatusServiceUnavailable},
	{CodeTimeout, http.StatusGatewayTimeout},
	{CodeInternal, http.StatusInternalServerError},
}

// ErrorCodes lists every error code, in the order of the table above.
func ErrorCodes() []string {
	out := make([]string, len(errorStatus))
	for i, e := range errorStatus {
		out[i] = e.code
	}
	return out
}

// HTTPStatus is the HTTP status the server answers with for an error code
// (500 for a code it does not know).
func HTTPStatus(code string) int {
	for _, e := range errorStatus {
		if e.code == code {
			return e.status
		}
	}
	return http.StatusInternalServerError
}

// CodeForStatus is the error code of a non-2xx status whose body carried no
// code (a proxy in between, a crashed handler): the first code with that
// status, with 502 read as unavailable.
func CodeForStatus(status int) string {
	switch status {
	case http.StatusBadGateway:
		status = http.StatusServiceUnavailable
	}
	for _, e := range errorStatus {
		if e.status == status {
			return e.code
		}
	}
	return CodeInternal
}
