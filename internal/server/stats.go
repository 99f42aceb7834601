package server

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// Bounds of a followed stats stream's interval: below the minimum the CPU
// rate is mostly noise (and each sample reads cgroup files, maybe asks a
// guest); above the maximum a client is better off asking once.
const (
	statsIntervalDefault = time.Second
	statsIntervalMin     = 250 * time.Millisecond
	statsIntervalMax     = 60 * time.Second
	// statsWriteTimeout bounds the write of one sample: a client that
	// stops reading a followed stream ends it.
	statsWriteTimeout = 30 * time.Second
)

// parseInterval reads ?interval= as a Go duration ("1s", "500ms") or a
// number of seconds.
func parseInterval(q string) (time.Duration, error) {
	if q == "" {
		return statsIntervalDefault, nil
	}
	d, err := time.ParseDuration(q)
	if err != nil {
		if secs, err2 := strconv.ParseFloat(q, 64); err2 == nil {
			d, err = time.Duration(secs*float64(time.Second)), nil
		}
	}
	if err != nil || d < statsIntervalMin || d > statsIntervalMax {
		return 0, fmt.Errorf("interval must be a duration between %v and %v (e.g. 1s), got %q: %w",
			statsIntervalMin, statsIntervalMax, truncateQuery(q), errdefs.ErrInvalidArgument)
	}
	return d, nil
}

// sandboxStats answers one sample of a sandbox's resource use, or with
// ?follow=true an NDJSON stream of samples, one per ?interval, until the
// client goes away or the sandbox is deleted. Errors known before the
// first sample (bad query, unknown sandbox) are plain JSON errors.
func (part networkAPI) sandboxStats(w http.ResponseWriter, r *http.Request) {
	s := part.s
	q := r.URL.Query()
	follow, err := parseBool(q.Get("follow"), "follow")
	if err != nil {
		writeError(w, r, err)
		return
	}
	interval, err := parseInterval(q.Get("interval"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	if !follow && q.Get("interval") != "" {
		writeError(w, r, fmt.Errorf("interval is only for follow=true: %w", errdefs.ErrInvalidArgument))
		return
	}
	id := r.PathValue("id")
	st, err := s.mgr.Stats(r.Context(), id)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if !follow {
		writeJSON(w, http.StatusOK, st)
		return
	}
	nd := newNDJSON(w, statsWriteTimeout)
	defer nd.Close()
	if nd.Send(st) != nil {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		}
		st, err := s.mgr.Stats(r.Context(), id)
		switch {
		case errors.Is(err, errdefs.ErrNotFound):
			return // deleted: the stream ends
		case err != nil:
			// A sample that failed (the sandbox was changing state
			// under it) is skipped; the next tick tries again.
			if r.Context().Err() == nil {
				slog.Debug("stats sample failed", "sandbox", id, "err", err)
			}
			continue
		}
		if nd.Send(st) != nil {
			return
		}
	}
}
