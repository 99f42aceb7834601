package sdk

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
)

// TestErrorsMatchCodes checks the public sentinels against the one code ↔
// status table of package api: an error answer with a JSON code, and one
// with only a status (a proxy's HTML page), both match the sentinel of
// their code, and no two codes share a sentinel.
func TestErrorsMatchCodes(t *testing.T) {
	want := map[string]error{
		api.CodeInvalidArgument: ErrInvalidArgument, api.CodeUnauthorized: ErrUnauthorized,
		api.CodePermissionDenied: ErrPermissionDenied, api.CodeQuotaExceeded: ErrQuotaExceeded,
		api.CodeNotFound: ErrNotFound, api.CodeConflict: ErrConflict, api.CodePolicyDenied: ErrPolicyDenied, api.CodeTooLarge: ErrTooLarge,
		api.CodeUnprocessable: ErrUnprocessable, api.CodeNotSupported: ErrNotSupported,
		api.CodeUnavailable: ErrUnavailable, api.CodeTimeout: ErrTimeout,
		api.CodeMethodNotAllowed: nil, api.CodeInternal: nil,
	}
	if len(want) != len(api.ErrorCodes()) {
		t.Fatalf("api has codes %v; this test knows %d", api.ErrorCodes(), len(want))
	}
	for _, code := range api.ErrorCodes() {
		sentinel, ok := want[code]
		if !ok {
			t.Errorf("code %q has no expectation here", code)
			continue
		}
		status := api.HTTPStatus(code)
		body := `{"error":{"code":"` + code + `","message":"m"}}`
		err := decodeError(&http.Response{StatusCode: status, Body: io.NopCloser(strings.NewReader(body))})
		var ae *APIError
		if !errors.As(err, &ae) || ae.Code != code || ae.Status != status {
			t.Errorf("code %s: decoded %#v", code, err)
		}
		if got := errors.Unwrap(err); got != sentinel {
			t.Errorf("code %s unwraps to %v, want %v", code, got, sentinel)
		}
		for other, s := range want {
			if other != code && s != nil && errors.Is(err, s) {
				t.Errorf("code %s also matches the sentinel of %s", code, other)
			}
		}
		// Without a JSON body, the status alone still gives a code (a bare
		// 403 reads as unauthorized, as an auth proxy's refusal would: a
		// policy denial always carries its code).
		if code == api.CodePolicyDenied {
			continue
		}
		err = decodeError(&http.Response{StatusCode: status, Body: io.NopCloser(strings.NewReader("<html>bad gateway</html>"))})
		if !errors.As(err, &ae) || api.HTTPStatus(ae.Code) != status {
			t.Errorf("status %d without a body: %#v", status, err)
		}
	}
	for status, sentinel := range map[int]error{403: ErrPermissionDenied, 429: ErrQuotaExceeded, 502: ErrUnavailable, 422: ErrUnprocessable, 418: nil} {
		err := decodeError(&http.Response{StatusCode: status, Body: io.NopCloser(strings.NewReader(""))})
		if sentinel != nil && !errors.Is(err, sentinel) || sentinel == nil && errors.Unwrap(err) != nil {
			t.Errorf("bare status %d: %v, want %v", status, err, sentinel)
		}
	}
}
