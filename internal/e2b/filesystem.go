package e2b

import (
	"fmt"
	"net/http"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// filesystemRoutes registers the envd filesystem service and /files.
func (h *Handler) filesystemRoutes() {}

func (h *Handler) checkSignature(r *http.Request, sb api.Sandbox) error {
	return fmt.Errorf("signed URLs are not served yet: %w", errdefs.ErrUnauthorized)
}
