package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
)

// watcher runs a watch in the background and collects its events.
type watcher struct {
	mu     sync.Mutex
	events []api.FileEvent
	armed  chan struct{}
	done   chan error
	cancel context.CancelFunc
}

func startWatch(t *testing.T, c *agentclient.Client, req api.WatchRequest) *watcher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &watcher{armed: make(chan struct{}), done: make(chan error, 1), cancel: cancel}
	t.Cleanup(cancel)
	go func() {
		w.done <- c.Watch(ctx, req, func(ev api.FileEvent) error {
			if ev.Type == api.FileEventWatching {
				close(w.armed)
				return nil
			}
			w.mu.Lock()
			w.events = append(w.events, ev)
			w.mu.Unlock()
			return nil
		})
	}()
	select {
	case <-w.armed:
	case err := <-w.done:
		t.Fatalf("watch ended before it was armed: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("watch not armed in 20 s")
	}
	return w
}

func (w *watcher) list() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]string, len(w.events))
	for i, ev := range w.events {
		out[i] = ev.Type + " " + ev.Name
	}
	return out
}

// waitFor waits until the events contain want in order (others may come
// between: writes repeat, a new directory's contents may be reported twice).
func (w *watcher) waitFor(t *testing.T, want ...string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		got := w.list()
		if isSubsequence(want, got) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("events\n  %s\ndo not contain, in order,\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func isSubsequence(want, got []string) bool {
	i := 0
	for _, g := range got {
		if i < len(want) && g == want[i] {
			i++
		}
	}
	return i == len(want)
}

func (w *watcher) has(prefix string) bool {
	for _, s := range w.list() {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}

func TestWatch(t *testing.T) {
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	c := e.c
	os.MkdirAll(filepath.Join(e.root, "w", "old"), 0o755)
	os.WriteFile(filepath.Join(e.root, "w", "old", "x"), nil, 0o644)
	p := func(rel string) string { return filepath.Join(e.root, "w", rel) }

	rec := startWatch(t, c, api.WatchRequest{Path: "/w", Recursive: true})
	flat := startWatch(t, c, api.WatchRequest{Path: "/w"})
	if h, _ := c.Health(ctx); h.Watches != 2 {
		t.Fatalf("health reports %d watches, want 2", h.Watches)
	}

	os.WriteFile(p("a.txt"), []byte("1"), 0o644)
	f, _ := os.OpenFile(p("a.txt"), os.O_WRONLY|os.O_APPEND, 0)
	f.WriteString("2")
	f.Close()
	os.Chmod(p("a.txt"), 0o600)
	os.Rename(p("a.txt"), p("b.txt"))
	os.Remove(p("b.txt"))
	os.Mkdir(p("sub"), 0o755)
	// The recursive watch reports what is made in sub whether or not it
	// raced the watch on sub.
	os.WriteFile(p("sub/in.txt"), []byte("x"), 0o644)
	os.WriteFile(p("old/y"), []byte("x"), 0o644) // existed before the watch

	common := []string{"create a.txt", "write a.txt", "chmod a.txt", "rename a.txt", "create b.txt", "remove b.txt", "create sub"}
	rec.waitFor(t, common...)
	rec.waitFor(t, "create sub/in.txt")
	rec.waitFor(t, "create old/y")
	flat.waitFor(t, common...)
	// A write that surely follows the watch on sub exists.
	os.WriteFile(p("sub/in.txt"), []byte("more"), 0o644)
	rec.waitFor(t, "write sub/in.txt")
	time.Sleep(200 * time.Millisecond)
	if flat.has("create sub/") || flat.has("write sub/") || flat.has("create old/") {
		t.Fatalf("a non-recursive watch reported inside a subdirectory: %v", flat.list())
	}

	// A directory moved out stops being watched under its old name; one
	// moved in is watched.
	os.Rename(p("sub"), p("moved"))
	os.WriteFile(p("moved/z"), nil, 0o644)
	rec.waitFor(t, "rename sub", "create moved", "create moved/z")

	// Cancelling releases the agent's side.
	flat.cancel()
	if err := <-flat.done; err != nil {
		t.Fatalf("cancelled watch returned %v", err)
	}
	waitWatches(t, c, 1)

	// Removing the watched directory ends the watch with ErrNotFound.
	os.RemoveAll(p(""))
	select {
	case err := <-rec.done:
		if !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("watch of a removed dir ended with %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("watch of a removed dir did not end")
	}
	rec.waitFor(t, "remove .")
	waitWatches(t, c, 0)

	// Bad requests.
	writeRootFile(t, e.root, "file", "x")
	err := c.Watch(ctx, api.WatchRequest{Path: "/file"}, func(api.FileEvent) error { return nil })
	wantErr(t, err, errdefs.ErrInvalidArgument)
	if !strings.Contains(err.Error(), "/file: not a directory") {
		t.Fatalf("watch of a file: %v", err)
	}
	wantErr(t, c.Watch(ctx, api.WatchRequest{Path: "/missing"}, func(api.FileEvent) error { return nil }), errdefs.ErrNotFound)
	// fn's error ends the watch and is returned.
	os.MkdirAll(filepath.Join(e.root, "w2"), 0o755)
	boom := errors.New("boom")
	err = c.Watch(ctx, api.WatchRequest{Path: "/w2"}, func(api.FileEvent) error { return boom })
	if err != boom {
		t.Fatalf("fn's error: %v", err)
	}
	waitWatches(t, c, 0)
}

// TestWatchAsUser: a user watches what it may read, not what it may not.
func TestWatchAsUser(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	os.MkdirAll(filepath.Join(e.root, "priv"), 0o700)
	os.MkdirAll(filepath.Join(e.root, "pub", "closed"), 0o755)
	os.Chmod(filepath.Join(e.root, "pub", "closed"), 0o700)
	err := e.c.Watch(ctx, api.WatchRequest{Path: "/priv", User: "1000"}, func(api.FileEvent) error { return nil })
	if !strings.Contains(errString(err), "permission denied") {
		t.Fatalf("user watch of a 0700 root dir: %v", err)
	}
	w := startWatch(t, e.c, api.WatchRequest{Path: "/pub", User: "1000", Recursive: true})
	os.WriteFile(filepath.Join(e.root, "pub", "closed", "hidden"), nil, 0o644)
	os.WriteFile(filepath.Join(e.root, "pub", "seen"), nil, 0o644)
	w.waitFor(t, "create seen")
	if w.has("create closed/") {
		t.Fatalf("a user's recursive watch reported inside a dir it cannot read: %v", w.list())
	}
}

// TestWatchCap: past Config.MaxWatches directories a recursive watch
// reports one overflow (after "watching") and keeps working for what it
// watches; a directory made later past the cap is one more overflow.
func TestWatchCap(t *testing.T) {
	e := newEnv(t, agent.Config{MaxWatches: 20})
	for i := 0; i < 30; i++ {
		os.MkdirAll(filepath.Join(e.root, "big", fmt.Sprint(i/10), fmt.Sprint(i%10)), 0o755)
	}
	w := startWatch(t, e.c, api.WatchRequest{Path: "/big", Recursive: true})
	w.waitFor(t, "overflow ")
	os.WriteFile(filepath.Join(e.root, "big", "top"), nil, 0o644)
	w.waitFor(t, "overflow ", "create top")
	if n := strings.Count(strings.Join(w.list(), ","), "overflow"); n != 1 {
		t.Fatalf("%d overflow events for one capped walk: %v", n, w.list())
	}
}

func waitWatches(t *testing.T, c *agentclient.Client, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		h, err := c.Health(context.Background())
		if err == nil && h.Watches == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent reports %d watches (err %v), want %d", h.Watches, err, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
