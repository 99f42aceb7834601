package agentclient

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/time/rate"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// Watch bounds: the agent cannot make the host read faster than this (it
// is slowed down, not cut off: its kernel queue overflows and it says so).
const (
	watchEventsPerSecond = 10000
	watchEventBurst      = 1000
)

// Watch streams the changes under directory req.Path (agentproto.
// PathFilesWatch) to fn. The first call of fn is the api.FileEventWatching
// event, once the watch is armed. Watch returns nil when ctx ends, fn's
// error when it fails, an error wrapping errdefs.ErrNotFound after fn got
// the "remove" or "rename" event of the watched directory itself ("."),
// and one wrapping errdefs.ErrUnavailable when the agent's stream breaks
// or it sends anything invalid (a line over agentproto.MaxWatchLine, a
// type it may not send, a name that is not a clean relative path).
// Event times are the host's clock: the agent's is not trusted.
func (c *Client) Watch(ctx context.Context, req api.WatchRequest, fn func(api.FileEvent) error, opts ...FileOption) error {
	q := fileQuery(req.Path, append([]FileOption{AsUser(req.User)}, opts...))
	if req.Recursive {
		q.Set("recursive", "1")
	}
	cl := call{method: http.MethodGet, path: agentproto.PathFilesWatch, query: q}
	resp, cc, err := c.roundTrip(ctx, cl, false)
	if err != nil {
		return err
	}
	defer cc.done()
	defer resp.Body.Close()
	lim := rate.NewLimiter(watchEventsPerSecond, watchEventBurst)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 4<<10), agentproto.MaxWatchLine)
	first, gone := true, false
	for sc.Scan() {
		if gone {
			return fmt.Errorf("agent %s %s: event after the watched directory went away: %w", cl.method, cl.path, errdefs.ErrUnavailable)
		}
		var ev api.FileEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return fmt.Errorf("agent %s %s: malformed event: %s: %w", cl.method, cl.path, sanitize(err.Error()), errdefs.ErrUnavailable)
		}
		if err := checkEvent(ev, first); err != nil {
			return fmt.Errorf("agent %s %s: %w: %w", cl.method, cl.path, err, errdefs.ErrUnavailable)
		}
		first = false
		gone = ev.Name == "." && (ev.Type == api.FileEventRemove || ev.Type == api.FileEventRename)
		if err := lim.Wait(cc.ctx); err != nil {
			break // ctx ended
		}
		ev.Time = time.Now().UTC()
		if err := fn(ev); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return nil
	}
	if gone {
		return fmt.Errorf("watch %s: the directory was removed or moved: %w", req.Path, errdefs.ErrNotFound)
	}
	err = sc.Err()
	if errors.Is(err, bufio.ErrTooLong) {
		return fmt.Errorf("agent %s %s: event line over %d bytes: %w", cl.method, cl.path, agentproto.MaxWatchLine, errdefs.ErrUnavailable)
	}
	if err != nil {
		return transportError(cc.ctx, cl, err)
	}
	return fmt.Errorf("agent %s %s: the watch stream ended: %w", cl.method, cl.path, errdefs.ErrUnavailable)
}

// checkEvent validates an event from the agent: the first is the
// "watching" line, every later one a change with a clean relative name
// (none for an overflow).
func checkEvent(ev api.FileEvent, first bool) error {
	if first {
		if ev.Type != api.FileEventWatching || ev.Name != "" {
			return fmt.Errorf("first event is %q, not %q", sanitize(truncateString(ev.Type, 32)), api.FileEventWatching)
		}
		return nil
	}
	if !slices.Contains(api.FileEventTypes, ev.Type) {
		return fmt.Errorf("unknown event type %q", sanitize(truncateString(ev.Type, 32)))
	}
	if ev.Type == api.FileEventOverflow {
		if ev.Name != "" {
			return errors.New("overflow event with a name")
		}
		return nil
	}
	return checkEventName(ev.Name)
}

// checkEventName accepts "." and clean relative paths below it.
func checkEventName(n string) error {
	switch {
	case n == "":
		return errors.New("event without a name")
	case len(n) > agentproto.MaxPathLen:
		return fmt.Errorf("event name longer than %d bytes", agentproto.MaxPathLen)
	case strings.IndexByte(n, 0) >= 0:
		return errors.New("event name contains a NUL byte")
	case strings.HasPrefix(n, "/"), path.Clean(n) != n, n == "..", strings.HasPrefix(n, "../"):
		return fmt.Errorf("event name %q is not a clean relative path", sanitize(truncateString(n, 128)))
	}
	return nil
}

func truncateString(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
