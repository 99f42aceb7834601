package errdefs

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"testing"
)

func TestClassifyNearestSentinelWins(t *testing.T) {
	cause := fmt.Errorf("agent said: %w", ErrNotFound)
	for _, tc := range []struct {
		name   string
		err    error
		status int
		code   string
	}{
		{"plain", fmt.Errorf("x: %w", ErrConflict), http.StatusConflict, "conflict"},
		{"none", errors.New("boom"), http.StatusInternalServerError, "internal"},
		{"nil-safe chain", fmt.Errorf("a: %w", fmt.Errorf("b: %w", ErrTimeout)), http.StatusGatewayTimeout, "timeout"},
		// The outer class decides although the cause carries another one.
		{"cause kept", fmt.Errorf("reading: %w: %w", cause, ErrUnavailable), http.StatusServiceUnavailable, "unavailable"},
		{"os cause", fmt.Errorf("open: %w: %w", fs.ErrNotExist, ErrInvalidArgument), http.StatusBadRequest, "invalid_argument"},
		// Wrapped again, the nearer class still wins.
		{"rewrapped", fmt.Errorf("outer: %w", fmt.Errorf("%w: %w", cause, ErrUnprocessable)), http.StatusUnprocessableEntity, "unprocessable"},
	} {
		if got := HTTPStatus(tc.err); got != tc.status {
			t.Errorf("%s: HTTPStatus = %d, want %d", tc.name, got, tc.status)
		}
		if got := Code(tc.err); got != tc.code {
			t.Errorf("%s: Code = %q, want %q", tc.name, got, tc.code)
		}
	}
	err := fmt.Errorf("open: %w: %w", fs.ErrNotExist, ErrInvalidArgument)
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("the cause is no longer inspectable")
	}
}
