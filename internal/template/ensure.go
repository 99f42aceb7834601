package template

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// BaseTag is the tag of the built-in Debian template.
const BaseTag = "base:latest"

// baseCall is one shared EnsureBase run. Its work runs under its own
// context, cancelled only when every caller waiting for it has given up.
type baseCall struct {
	done    chan struct{}
	tmpl    api.Template
	err     error
	cancel  context.CancelFunc
	waiters int
	subs    map[int]func(Progress)
	nextSub int
	mu      sync.Mutex // guards subs, nextSub
}

// emit runs on the single build goroutine. It holds mu while calling the
// subscribers so that a caller who has left (and deleted its subscription
// under mu) is never called afterwards.
func (c *baseCall) emit(p Progress) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, fn := range c.subs {
		fn(p)
	}
}

// EnsureBase returns base:latest, building and importing it first if it is
// missing: BuildBase into the cache (reused when already complete), then
// ImportDir with source "debootstrap:bookworm". Concurrent callers share one
// run and all receive its progress; progress is called from one goroutine
// and never after EnsureBase has returned to that caller. A caller whose ctx
// ends stops waiting; the shared run is cancelled once no caller is left.
func (s *Store) EnsureBase(ctx context.Context, progressFn func(Progress)) (api.Template, error) {
	if t, err := s.Get(ctx, BaseTag); err == nil {
		return t, nil
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return api.Template{}, err
	}

	s.baseMu.Lock()
	c := s.baseCall
	if c == nil {
		workCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		c = &baseCall{done: make(chan struct{}), cancel: cancel, subs: map[int]func(Progress){}}
		s.baseCall = c
		go func() {
			c.tmpl, c.err = s.buildAndImportBase(workCtx, c.emit)
			cancel()
			s.baseMu.Lock()
			if s.baseCall == c {
				s.baseCall = nil
			}
			s.baseMu.Unlock()
			close(c.done)
		}()
	}
	c.waiters++
	s.baseMu.Unlock()

	sub := -1
	if progressFn != nil {
		c.mu.Lock()
		sub = c.nextSub
		c.nextSub++
		c.subs[sub] = progressFn
		c.mu.Unlock()
	}
	leave := func() {
		if sub >= 0 {
			c.mu.Lock()
			delete(c.subs, sub)
			c.mu.Unlock()
		}
		s.baseMu.Lock()
		c.waiters--
		if c.waiters == 0 {
			// Nobody wants it any more: stop it, and let the next
			// caller start afresh instead of joining a cancelled run.
			c.cancel()
			if s.baseCall == c {
				s.baseCall = nil
			}
		}
		s.baseMu.Unlock()
	}
	select {
	case <-c.done:
		leave()
		return c.tmpl, c.err
	case <-ctx.Done():
		leave()
		return api.Template{}, fmt.Errorf("waiting for the base template: %w", ctx.Err())
	}
}

func (s *Store) buildAndImportBase(ctx context.Context, emit func(Progress)) (api.Template, error) {
	// Another process may have imported it meanwhile.
	if t, err := s.Get(ctx, BaseTag); err == nil {
		return t, nil
	}
	rootfs, err := BuildBase(ctx, s.cacheDir, emit)
	if err != nil {
		return api.Template{}, fmt.Errorf("build base template: %w", err)
	}
	emit(Progress{Phase: PhaseImport, Message: "importing " + rootfs})
	t, err := s.ImportDir(ctx, rootfs, ImportOptions{Tags: []string{BaseTag}, Source: baseSource, Progress: emit})
	if err != nil {
		return api.Template{}, fmt.Errorf("import base template: %w", err)
	}
	emit(Progress{Phase: PhaseDone, Message: "base template " + t.Digest})
	return t, nil
}
