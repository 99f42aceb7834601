package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// maxJSONBody bounds every JSON request body.
const maxJSONBody = 1 << 20

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.Encode(v)
}

// writeError is the one place errors become HTTP responses.
func writeError(w http.ResponseWriter, r *http.Request, err error) {
	status := errdefs.HTTPStatus(err)
	code := errdefs.Code(err)
	if status >= 500 && !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrTimeout) {
		slog.Error("internal error", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, api.Error{Error: api.ErrorBody{Code: code, Message: errorMessage(err)}})
}

// errorMessage is err's text for a client. Generic sentinels ("…: invalid
// argument") add nothing after a message that already says what is wrong;
// "not found" and "not supported" do.
func errorMessage(err error) string {
	msg := err.Error()
	for _, s := range []string{": invalid argument", ": unprocessable"} {
		msg = strings.TrimSuffix(msg, s)
	}
	return msg
}

// errBodyTooLarge refuses a JSON body by its announced length.
func errBodyTooLarge(n int64) error {
	return fmt.Errorf("request body of %d bytes is larger than the limit of %d bytes: %w", n, maxJSONBody, errdefs.ErrTooLarge)
}

// decodeJSON reads a bounded JSON body into v, rejecting unknown fields and
// trailing data, with errors that name the problem.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return fmt.Errorf("Content-Type must be application/json, got %q: %w", ct, errdefs.ErrInvalidArgument)
	}
	if r.ContentLength > maxJSONBody {
		return errBodyTooLarge(r.ContentLength)
	}
	body := http.MaxBytesReader(w, r.Body, maxJSONBody)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		var se *json.SyntaxError
		var te *json.UnmarshalTypeError
		var bt *bodyTimeoutError
		switch {
		case errors.As(err, &bt):
			return fmt.Errorf("%s: %w", bt.Error(), errdefs.ErrInvalidArgument)
		case errors.As(err, &mbe):
			return fmt.Errorf("request body is larger than %d bytes: %w", maxJSONBody, errdefs.ErrTooLarge)
		case errors.Is(err, io.EOF):
			return fmt.Errorf("request body is empty; expected a JSON object: %w", errdefs.ErrInvalidArgument)
		case errors.As(err, &se):
			return fmt.Errorf("malformed JSON at byte %d: %w: %w", se.Offset, err, errdefs.ErrInvalidArgument)
		case errors.As(err, &te):
			return fmt.Errorf("field %q must be %s, got JSON %s: %w", te.Field, te.Type, te.Value, errdefs.ErrInvalidArgument)
		case strings.HasPrefix(err.Error(), "json: unknown field"):
			return fmt.Errorf("%s: %w", strings.TrimPrefix(err.Error(), "json: "), errdefs.ErrInvalidArgument)
		default:
			return fmt.Errorf("malformed JSON: %w: %w", err, errdefs.ErrInvalidArgument)
		}
	}
	if dec.More() {
		return fmt.Errorf("request body has data after the JSON object: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}
