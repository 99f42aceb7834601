package sdk

import "github.com/spacehq/space/internal/errdefs"

// Errors the SDK returns match these with errors.Is: every error answer of
// the server (an *APIError) unwraps to the one for its code (api.Code…),
// and the SDK's own checks of arguments wrap them too. They are the very
// values the server wraps, so
//
//	if errors.Is(err, sdk.ErrNotFound) { … }
//
// means the same on both sides of the wire.
var (
	ErrInvalidArgument  = errdefs.ErrInvalidArgument  // 400 invalid_argument: the request is malformed
	ErrUnauthorized     = errdefs.ErrUnauthorized     // 401 unauthorized: missing or wrong API key or attach token
	ErrPermissionDenied = errdefs.ErrPermissionDenied // 403 permission_denied: the key lacks the scope, or a policy denied it
	ErrNotFound         = errdefs.ErrNotFound         // 404 not_found
	ErrQuotaExceeded    = errdefs.ErrQuotaExceeded    // 429 quota_exceeded: the tenant's quota is used up
	ErrConflict         = errdefs.ErrConflict         // 409 conflict: wrong state, already exists
	ErrPolicyDenied     = errdefs.ErrPolicyDenied     // 403 policy_denied: a policy rule or an approver refused the action
	ErrTooLarge         = errdefs.ErrTooLarge         // 413 too_large
	ErrUnprocessable    = errdefs.ErrUnprocessable    // 422 unprocessable: well-formed but impossible
	ErrNotSupported     = errdefs.ErrNotSupported     // 422 not_supported: the runtime lacks a capability
	ErrUnavailable      = errdefs.ErrUnavailable      // 503 unavailable: transient, worth retrying
	ErrTimeout          = errdefs.ErrTimeout          // 504 timeout
)
