package server

import (
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// networkEventsWriteTimeout bounds the write of one event line: a client
// that stops reading a followed stream fails it instead of holding it.
const networkEventsWriteTimeout = 30 * time.Second

func (part networkAPI) getNetwork(w http.ResponseWriter, r *http.Request) {
	s := part.s
	info, err := s.mgr.Networking().NetworkInfo(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

// putNetwork replaces a sandbox's whole policy and answers with the
// network as it is then.
func (part networkAPI) putNetwork(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var p api.NetworkPolicy
	if err := decodeJSON(w, r, &p); err != nil {
		writeError(w, r, err)
		return
	}
	if _, err := s.mgr.Networking().SetNetwork(r.Context(), r.PathValue("id"), p); err != nil {
		writeError(w, r, err)
		return
	}
	info, err := s.mgr.Networking().NetworkInfo(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

// networkEvents streams a sandbox's network events as NDJSON: those after
// ?after=N, then (with ?follow=true) new ones until the client goes away.
func (part networkAPI) networkEvents(w http.ResponseWriter, r *http.Request) {
	s := part.s
	q := r.URL.Query()
	var after uint64
	if a := q.Get("after"); a != "" {
		n, err := strconv.ParseUint(a, 10, 64)
		if err != nil {
			writeError(w, r, fmt.Errorf("after must be a sequence number (an unsigned integer), got %q: %w", truncateQuery(a), errdefs.ErrInvalidArgument))
			return
		}
		after = n
	}
	follow, err := parseBool(q.Get("follow"), "follow")
	if err != nil {
		writeError(w, r, err)
		return
	}
	id := r.PathValue("id")
	// Errors known before the stream (an unknown sandbox) are plain JSON
	// errors. A followed stream sends its head at once (the client learns
	// it is connected); otherwise with the first event, so a failure
	// before any can still be an error response.
	if _, err := s.mgr.Get(r.Context(), id); err != nil {
		writeError(w, r, err)
		return
	}
	var nd *ndjsonWriter
	start := func() {
		if nd == nil {
			nd = newNDJSON(w, networkEventsWriteTimeout)
		}
	}
	if follow {
		start()
	}
	err = s.mgr.Networking().NetworkEvents(r.Context(), id, after, follow, func(ev api.NetworkEvent) error {
		start()
		return nd.Send(ev)
	})
	if nd == nil {
		if err != nil {
			writeError(w, r, err)
			return
		}
		start()
	}
	nd.Close()
	if err != nil && r.Context().Err() == nil {
		slog.Debug("network event stream ended", "sandbox", id, "err", err)
	}
}

func truncateQuery(s string) string {
	if len(s) > 32 {
		return s[:32] + "…"
	}
	return s
}
