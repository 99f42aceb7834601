package e2b

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/spacehq/space/internal/errdefs"
)

// A cluster replica serves this API by sending each call to the node that
// holds its sandbox (and a create to the node placement picks); these are
// the pieces of the layer it needs without a manager of its own.

// WriteError answers r with err in the shape its route speaks: Connect's
// for an envd procedure, E2B's REST error for everything else.
func WriteError(w http.ResponseWriter, r *http.Request, err error) {
	if strings.HasPrefix(r.URL.Path, EnvdPrefix+"/") && strings.Contains(r.URL.Path, ".") {
		writeUnaryError(w, r.Context(), err)
		return
	}
	status := errdefs.HTTPStatus(err)
	writeJSON(w, status, apiError{Code: status, Message: strings.TrimSuffix(err.Error(), ": invalid argument")})
}

// MergeList merges several servers' answers to one listing (GET
// /sandboxes or /v2/sandboxes, each asked without nextToken and with the
// largest limit) into the page q asks for, as one server would cut it.
// next is the X-Next-Token of the page, "" on the last.
func MergeList(bodies []io.Reader, q url.Values) (page []byte, next string, err error) {
	var all []e2bListed
	for _, b := range bodies {
		var part []e2bListed
		if err := json.NewDecoder(io.LimitReader(b, 64<<20)).Decode(&part); err != nil {
			return nil, "", fmt.Errorf("a node's sandbox list does not parse: %v: %w", err, errdefs.ErrUnavailable)
		}
		all = append(all, part...)
	}
	out, next, err := pageListed(all, q)
	if err != nil {
		return nil, "", err
	}
	page, err = json.Marshal(out)
	return page, next, err
}

// MaxListLimit is the largest page a listing gives (a replica asks each
// node for that much).
const MaxListLimit = maxListLimit
