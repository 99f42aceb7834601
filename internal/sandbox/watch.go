package sandbox

import (
	"context"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
)

// WatchDir reports the changes under directory req.Path of sandbox id to
// fn, waking the sandbox first and holding it active (its idle policy waits)
// while the watch is open. fn is called first with the api.FileEventWatching
// event, once the watch is armed, then with every change (api.FileEvent
// names are relative to req.Path). It blocks until:
//   - ctx ends: nil;
//   - fn returns an error: that error;
//   - the watched directory is removed or moved away (fn got its "remove"
//     or "rename" event of "."): an error wrapping errdefs.ErrNotFound;
//   - the sandbox stops, suspends or its agent goes away: an error
//     wrapping errdefs.ErrUnavailable.
//
// A path that is not a directory is errdefs.ErrInvalidArgument, a missing
// one errdefs.ErrNotFound, before fn is ever called. req.User watches as
// that sandbox user (it must be able to read the directories).
func (part *Files) WatchDir(ctx context.Context, id string, req api.WatchRequest, fn func(api.FileEvent) error) error {
	m := part.m
	if err := validatePath("path", req.Path, false); err != nil {
		return err
	}
	if !strings.HasPrefix(req.Path, "/") {
		return invalid("path must be absolute, got %q", req.Path)
	}
	s, err := m.files.OpenFiles(ctx, id, req.User)
	if err != nil {
		return err
	}
	defer s.Close()
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileRead, path: req.Path, follow: true})
	if err != nil {
		return err
	}
	req.Path = ps[0]
	return c.Watch(ctx, req, fn, opts...)
}
