// Package errdefs holds the sentinel errors shared by every layer of space.
//
// Code anywhere wraps one of these (fmt.Errorf("...: %w", errdefs.ErrNotFound));
// the API layer maps them to error codes in exactly one place (Code below)
// and codes to HTTP statuses in package api (api.HTTPStatus), so no handler
// invents its own mapping and the Go SDK reads the same table. The SDK
// re-exports these values (sdk.ErrNotFound, …) for callers outside this
// module.
package errdefs

import (
	"errors"

	"github.com/spacehq/space/api"
)

var (
	ErrInvalidArgument  = errors.New("invalid argument")  // 400
	ErrUnauthorized     = errors.New("unauthorized")      // 401
	ErrPermissionDenied = errors.New("permission denied") // 403: missing scope, policy denied
	ErrNotFound         = errors.New("not found")         // 404
	ErrConflict         = errors.New("conflict")          // 409: wrong state, already exists
	ErrPolicyDenied     = errors.New("denied by policy")  // 403: a policy rule or an approver refused the action
	ErrTooLarge         = errors.New("too large")         // 413
	ErrQuotaExceeded    = errors.New("quota exceeded")    // 429
	ErrUnprocessable    = errors.New("unprocessable")     // 422: well-formed but semantically impossible
	ErrNotSupported     = errors.New("not supported")     // 422: runtime lacks a capability
	ErrUnavailable      = errors.New("unavailable")       // 503: transient (agent not reachable)
	ErrTimeout          = errors.New("timeout")           // 504
)

type mapping struct {
	err  error
	code string
}

// table maps each sentinel to its api error code. When an error wraps
// several sentinels, the one nearest the top of its tree wins (classify).
var table = []mapping{
	{ErrInvalidArgument, api.CodeInvalidArgument},
	{ErrUnauthorized, api.CodeUnauthorized},
	{ErrPermissionDenied, api.CodePermissionDenied},
	{ErrQuotaExceeded, api.CodeQuotaExceeded},
	{ErrNotFound, api.CodeNotFound},
	{ErrConflict, api.CodeConflict},
	{ErrPolicyDenied, api.CodePolicyDenied},
	{ErrTooLarge, api.CodeTooLarge},
	{ErrNotSupported, api.CodeNotSupported},
	{ErrUnprocessable, api.CodeUnprocessable},
	{ErrUnavailable, api.CodeUnavailable},
	{ErrTimeout, api.CodeTimeout},
}

// HTTPStatus returns the HTTP status for err (500 when err wraps no sentinel).
func HTTPStatus(err error) int { return api.HTTPStatus(Code(err)) }

// Code returns the stable API error code for err ("internal" when unknown).
func Code(err error) string {
	if m, ok := classify(err); ok {
		return m.code
	}
	return api.CodeInternal
}

// classify finds the sentinel nearest the top of err's tree, breadth
// first, and among siblings the last: fmt.Errorf("%w: %w", cause,
// ErrInvalidArgument) keeps the cause inspectable (errors.Is/As) while its
// own class decides the status, even when the cause carries another
// sentinel deeper down.
func classify(err error) (mapping, bool) {
	level := []error{err}
	for depth := 0; len(level) > 0 && depth < 64; depth++ {
		for i := len(level) - 1; i >= 0; i-- {
			for _, m := range table {
				if level[i] == m.err {
					return m, true
				}
			}
		}
		var next []error
		for _, e := range level {
			switch u := e.(type) {
			case interface{ Unwrap() error }:
				if w := u.Unwrap(); w != nil {
					next = append(next, w)
				}
			case interface{ Unwrap() []error }:
				next = append(next, u.Unwrap()...)
			}
		}
		level = next
	}
	return mapping{}, false
}

// FromCode is the inverse of Code, used by clients to rebuild a sentinel from
// an API error so callers can errors.Is across the wire.
func FromCode(code string) error {
	for _, m := range table {
		if m.code == code {
			return m.err
		}
	}
	return nil
}
