package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

// Directory watches: WatchDir streams a watch's events; CreateWatcher runs
// one on the server into a bounded buffer that GetWatcherEvents drains
// (envd's polling watchers, used by E2B's other SDKs).

// Messages of filesystem.proto's watch calls, in protobuf's JSON mapping.
type (
	watchDirRequest struct {
		Path               string `json:"path"`
		Recursive          bool   `json:"recursive"`
		IncludeEntry       bool   `json:"includeEntry"`
		AllowNetworkMounts bool   `json:"allowNetworkMounts"`
	}
	filesystemEvent struct {
		Name  string     `json:"name"`
		Type  string     `json:"type"`
		Entry *entryInfo `json:"entry,omitempty"`
	}
	watchDirResponse struct {
		Start      *struct{}        `json:"start,omitempty"`
		Filesystem *filesystemEvent `json:"filesystem,omitempty"`
		Keepalive  *struct{}        `json:"keepalive,omitempty"`
	}
	createWatcherResponse struct {
		WatcherID string `json:"watcherId"`
	}
	watcherRequest struct {
		WatcherID string `json:"watcherId"`
	}
	getWatcherEventsResponse struct {
		Events []filesystemEvent `json:"events"`
	}
)

const (
	// maxWatcherEvents bounds a watcher's unread events; past it events
	// are dropped and the next GetWatcherEvents says so.
	maxWatcherEvents = 10000
	// maxWatchersPerSandbox bounds a sandbox's server-side watchers.
	maxWatchersPerSandbox = 64
	// watcherIdle removes a watcher nobody polled for this long.
	watcherIdle = 10 * time.Minute
	// watchArmTimeout bounds how long CreateWatcher waits for the watch
	// to be armed in the sandbox.
	watchArmTimeout = 30 * time.Second
)

// watchEvent is one change under a watched directory: Name relative to
// it, Type one of the watchEvent* kinds.
type watchEvent struct {
	Name string
	Type string
}

// The kinds of watchEvent. watchArmed comes first, once the watch is in
// place; watchOverflow says events were lost.
const (
	watchArmed    = api.FileEventWatching
	watchCreate   = api.FileEventCreate
	watchWrite    = api.FileEventWrite
	watchRemove   = api.FileEventRemove
	watchRename   = api.FileEventRename
	watchChmod    = api.FileEventChmod
	watchOverflow = api.FileEventOverflow
)

// eventTypes maps a watch event kind to filesystem.proto's EventType.
var eventTypes = map[string]string{
	watchCreate: "EVENT_TYPE_CREATE",
	watchWrite:  "EVENT_TYPE_WRITE",
	watchRemove: "EVENT_TYPE_REMOVE",
	watchRename: "EVENT_TYPE_RENAME",
	watchChmod:  "EVENT_TYPE_CHMOD",
}

// dirWatcher watches directory path of sandbox id as user, calling fn with
// every event until ctx ends, fn fails or the watch ends (its error).
type dirWatcher func(ctx context.Context, id, path string, recursive bool, user string, fn func(watchEvent) error) error

// errEventsLost ends a watch whose events could not all be delivered.
var errEventsLost = errors.New("events were lost")

func (h *Handler) watchRoutes(p string) {
	a := func(f http.HandlerFunc) http.HandlerFunc { return h.authEnvd(false, f) }
	ping := func() any { return watchDirResponse{Keepalive: &struct{}{}} }
	h.route("POST "+p+"WatchDir", a(serverStream(ping, h.watchDir)))
	h.route("POST "+p+"CreateWatcher", a(unary(h.watchers.create)))
	h.route("POST "+p+"GetWatcherEvents", a(unary(h.watchers.events)))
	h.route("POST "+p+"RemoveWatcher", a(unary(h.watchers.remove)))
}

// watchTarget resolves a watch request to its sandbox path and user.
func (h *Handler) watchTarget(ctx context.Context, in *watchDirRequest) (id, p, user string, err error) {
	if in.IncludeEntry {
		return "", "", "", rpcErrorf(codeUnimplemented, "includeEntry needs envd 0.6.3; this server reports envd %s: stat the entries you need", EnvdVersion)
	}
	cl := caller(ctx)
	f := &fsCall{sb: cl.sb, user: defaultUser(cl.sb, cl.user)}
	if err := checkUser(f.user); err != nil {
		return "", "", "", err
	}
	p, err = f.resolve(in.Path)
	if err != nil {
		return "", "", "", err
	}
	return cl.sb.ID, p, f.user, nil
}

// watchError gives a watch's end the Connect code envd would answer with.
func watchError(p string, err error) error {
	switch {
	case errors.Is(err, errEventsLost):
		return rpcErrorf(codeDataLoss, "watch of %s: %v (the sandbox's event queue, or this watcher's buffer of %d, overflowed): watch again", p, err, maxWatcherEvents)
	case errors.Is(err, errdefs.ErrNotFound):
		return rpcErrorf(codeNotFound, "%v", err)
	case errors.Is(err, errdefs.ErrConflict):
		return rpcErrorf(codeInvalidArgument, "path %s is not a directory", p)
	}
	return rpcFSError(err)
}

func (h *Handler) watchDir(ctx context.Context, r *http.Request, in *watchDirRequest, s *stream) error {
	id, p, user, err := h.watchTarget(ctx, in)
	if err != nil {
		return err
	}
	err = h.watch(ctx, id, p, in.Recursive, user, func(ev watchEvent) error {
		switch ev.Type {
		case watchArmed:
			return s.send(watchDirResponse{Start: &struct{}{}})
		case watchOverflow:
			return errEventsLost
		}
		t, ok := eventTypes[ev.Type]
		if !ok {
			return nil
		}
		return s.send(watchDirResponse{Filesystem: &filesystemEvent{Name: ev.Name, Type: t}})
	})
	if err != nil && ctx.Err() == nil {
		return watchError(p, err)
	}
	return nil
}

// watchers are the server-side watchers of CreateWatcher.
type watchers struct {
	h      *Handler
	mu     sync.Mutex
	byID   map[string]*watcher
	closed bool
}

// watcher is one server-side watch and its unread events.
type watcher struct {
	id, sandbox, path string
	cancel            context.CancelFunc
	idle              *time.Timer

	mu      sync.Mutex
	events  []filesystemEvent
	dropped int
	err     error // why the watch ended; reported once the events are read
}

func newWatchers(h *Handler) *watchers {
	return &watchers{h: h, byID: map[string]*watcher{}}
}

func (ws *watchers) close() {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	ws.closed = true
	for id, w := range ws.byID {
		w.stop()
		delete(ws.byID, id)
	}
}

func (w *watcher) stop() {
	w.cancel()
	w.idle.Stop()
}

// drop forgets watcher w (idempotent).
func (ws *watchers) drop(w *watcher) {
	ws.mu.Lock()
	if ws.byID[w.id] == w {
		delete(ws.byID, w.id)
	}
	ws.mu.Unlock()
	w.stop()
}

func (ws *watchers) create(ctx context.Context, r *http.Request, in *watchDirRequest) (*createWatcherResponse, error) {
	id, p, user, err := ws.h.watchTarget(ctx, in)
	if err != nil {
		return nil, err
	}
	var buf [16]byte
	rand.Read(buf[:])
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	w := &watcher{id: hex.EncodeToString(buf[:]), sandbox: id, path: p, cancel: cancel}
	ws.mu.Lock()
	n := 0
	for _, o := range ws.byID {
		if o.sandbox == id {
			n++
		}
	}
	switch {
	case ws.closed:
		ws.mu.Unlock()
		cancel()
		return nil, fmt.Errorf("shutting down: %w", errdefs.ErrUnavailable)
	case n >= maxWatchersPerSandbox:
		ws.mu.Unlock()
		cancel()
		return nil, rpcErrorf(codeResourceExhausted, "sandbox %s has %d watchers, the most it may have: remove one first (RemoveWatcher)", id, maxWatchersPerSandbox)
	}
	w.idle = time.AfterFunc(watcherIdle, func() { ws.drop(w) })
	ws.byID[w.id] = w
	ws.mu.Unlock()

	armed := make(chan error, 1)
	go func() {
		err := ws.h.watch(wctx, id, p, in.Recursive, user, func(ev watchEvent) error {
			if ev.Type == watchArmed {
				select {
				case armed <- nil:
				default:
				}
				return nil
			}
			return w.add(ev)
		})
		if err == nil && wctx.Err() == nil {
			err = fmt.Errorf("the watch of %s ended: %w", p, errdefs.ErrNotFound)
		}
		select {
		case armed <- err:
		default:
		}
		if wctx.Err() == nil {
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
		}
	}()
	t := time.NewTimer(watchArmTimeout)
	defer t.Stop()
	select {
	case err := <-armed:
		if err != nil {
			ws.drop(w)
			return nil, watchError(p, err)
		}
	case <-ctx.Done():
		ws.drop(w)
		return nil, ctx.Err()
	case <-t.C:
		ws.drop(w)
		return nil, rpcErrorf(codeDeadlineExceeded, "the watch of %s was not armed within %s", p, watchArmTimeout)
	}
	return &createWatcherResponse{WatcherID: w.id}, nil
}

// add buffers one event; past the bound it is counted and dropped.
func (w *watcher) add(ev watchEvent) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	t, ok := eventTypes[ev.Type]
	switch {
	case ev.Type == watchOverflow:
		w.dropped++
	case !ok:
	case w.dropped > 0 || len(w.events) >= maxWatcherEvents:
		// After a loss nothing more is buffered: the reader gets the
		// events before the gap, then the loss.
		w.dropped++
	default:
		w.events = append(w.events, filesystemEvent{Name: ev.Name, Type: t})
	}
	return nil
}

// find is the caller's sandbox's watcher with the request's id.
func (ws *watchers) find(ctx context.Context, in *watcherRequest) (*watcher, error) {
	ws.mu.Lock()
	w := ws.byID[in.WatcherID]
	ws.mu.Unlock()
	if w == nil || w.sandbox != caller(ctx).sb.ID {
		return nil, rpcErrorf(codeNotFound, "watcher %q not found (removed, ended, or idle for %s)", truncate(in.WatcherID, 64), watcherIdle)
	}
	return w, nil
}

// events returns and forgets the watcher's unread events. Once they are
// read, a watch that lost events or ended says so, and is removed.
func (ws *watchers) events(ctx context.Context, r *http.Request, in *watcherRequest) (*getWatcherEventsResponse, error) {
	w, err := ws.find(ctx, in)
	if err != nil {
		return nil, err
	}
	w.idle.Reset(watcherIdle)
	w.mu.Lock()
	evs, dropped, end := w.events, w.dropped, w.err
	w.events = nil
	w.mu.Unlock()
	if len(evs) == 0 && (dropped > 0 || end != nil) {
		ws.drop(w)
		if dropped > 0 {
			return nil, watchError(w.path, fmt.Errorf("%w: %d events", errEventsLost, dropped))
		}
		return nil, watchError(w.path, end)
	}
	if evs == nil {
		evs = []filesystemEvent{}
	}
	return &getWatcherEventsResponse{Events: evs}, nil
}

func (ws *watchers) remove(ctx context.Context, r *http.Request, in *watcherRequest) (*empty, error) {
	w, err := ws.find(ctx, in)
	if err != nil {
		return nil, err
	}
	ws.drop(w)
	return &empty{}, nil
}

// managerWatch is the sandbox manager's directory watch.
func managerWatch(m *sandbox.Manager) dirWatcher {
	return func(ctx context.Context, id, path string, recursive bool, user string, fn func(watchEvent) error) error {
		return m.Files().WatchDir(ctx, id, api.WatchRequest{Path: path, Recursive: recursive, User: user}, func(ev api.FileEvent) error {
			return fn(watchEvent{Name: ev.Name, Type: ev.Type})
		})
	}
}
