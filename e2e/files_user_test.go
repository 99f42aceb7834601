package e2e

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/sdk"
)

// fileRuntimes are the runtimes the files-as-user and watch tests run on
// (microvm works the same way: a Linux kernel of its own).
var fileRuntimes = []string{"native", "gvisor"}

// TestFilesAsUser: the base template has E2B's "user" account, and file
// operations as that user are checked by the sandbox's kernel.
func TestFilesAsUser(t *testing.T) {
	e := setup(t)
	for _, rt := range fileRuntimes {
		t.Run(rt, func(t *testing.T) { testFilesAsUser(t, e, rt) })
	}
}

func testFilesAsUser(t *testing.T, e *env, runtime string) {
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: runtime})
	if out, code := sh(t, e, sb.ID, "id user; stat -c '%u:%g %a' /home/user; getent shadow user | cut -d: -f2"); code != 0 ||
		out != "uid=1000(user) gid=1000(user) groups=1000(user)\n1000:1000 755\n!\n" {
		t.Fatalf("the user account: %d %q", code, out)
	}
	as := sdk.AsUser("user")
	if _, err := e.client.WriteFile(ctx, sb.ID, "/home/user/f.txt", strings.NewReader("mine"), 0, as); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Mkdir(ctx, sb.ID, "/home/user/d/e", 0, as); err != nil {
		t.Fatal(err)
	}
	if out, _ := sh(t, e, sb.ID, "stat -c '%u:%g' /home/user/f.txt /home/user/d/e"); out != "1000:1000\n1000:1000\n" {
		t.Fatalf("owners of what user made: %q", out)
	}
	_, err := e.client.WriteFile(ctx, sb.ID, "/root/f.txt", strings.NewReader("x"), 0, as)
	if !errors.Is(err, errdefs.ErrUnprocessable) || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("user writing into /root: %v", err)
	}
	if _, err := e.client.ReadFile(ctx, sb.ID, "/etc/shadow", as); !errors.Is(err, errdefs.ErrUnprocessable) {
		t.Fatalf("user reading /etc/shadow: %v", err)
	}
	if err := e.client.Rename(ctx, sb.ID, "/home/user/f.txt", "/etc/f.txt", as); !errors.Is(err, errdefs.ErrUnprocessable) {
		t.Fatalf("user moving a file into /etc: %v", err)
	}
	// Root still can; and uid 1000 by number is the same user.
	if _, err := e.client.WriteFile(ctx, sb.ID, "/root/f.txt", strings.NewReader("x"), 0); err != nil {
		t.Fatal(err)
	}
	if fi, err := e.client.StatFile(ctx, sb.ID, "/home/user/f.txt", sdk.AsUser("1000")); err != nil || fi.Size != 4 {
		t.Fatalf("stat as 1000: %v %+v", err, fi)
	}
	if out, _ := sh(t, e, sb.ID, "stat -c '%u:%g' /root/f.txt"); out != "0:0\n" {
		t.Fatalf("root's file after user operations: %q", out)
	}
	if _, err := e.client.StatFile(ctx, sb.ID, "/", sdk.AsUser("no such user!")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("malformed user: %v", err)
	}
}

// TestWatchDir: directory watches on real sandboxes.
func TestWatchDir(t *testing.T) {
	e := setup(t)
	for _, rt := range fileRuntimes {
		t.Run(rt, func(t *testing.T) { testWatchDir(t, e, rt) })
	}
}

// watchRun is one WatchDir call running in the background.
type watchRun struct {
	mu     sync.Mutex
	events []string
	armed  chan struct{}
	done   chan error
	cancel context.CancelFunc
}

func watch(t *testing.T, e *env, id string, req api.WatchRequest) *watchRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w := &watchRun{armed: make(chan struct{}), done: make(chan error, 1), cancel: cancel}
	go func() {
		w.done <- e.client.WatchDir(ctx, id, req, func(ev api.FileEvent) error {
			if ev.Type == api.FileEventWatching {
				close(w.armed)
				return nil
			}
			w.mu.Lock()
			w.events = append(w.events, ev.Type+" "+ev.Name)
			w.mu.Unlock()
			return nil
		})
	}()
	select {
	case <-w.armed:
	case err := <-w.done:
		t.Fatalf("watch %+v ended before it was armed: %v", req, err)
	case <-time.After(time.Minute):
		t.Fatalf("watch %+v not armed within a minute", req)
	}
	return w
}

func (w *watchRun) list() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.events...)
}

// waitFor waits until the events hold want in this order (others may be
// between them: a write can be reported more than once).
func (w *watchRun) waitFor(t *testing.T, want ...string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := w.list()
		i := 0
		for _, g := range got {
			if i < len(want) && g == want[i] {
				i++
			}
		}
		if i == len(want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("events\n  %s\ndo not hold, in order,\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func testWatchDir(t *testing.T, e *env, runtime string) {
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: runtime})
	if _, code := sh(t, e, sb.ID, "mkdir -p /tmp/w/pre && echo > /tmp/f"); code != 0 {
		t.Fatal("setup")
	}
	rec := watch(t, e, sb.ID, api.WatchRequest{Path: "/tmp/w", Recursive: true})
	flat := watch(t, e, sb.ID, api.WatchRequest{Path: "/tmp/w"})
	if n := agentWatches(t, e, sb.ID); n != 2 {
		t.Fatalf("the agent reports %d watches, want 2", n)
	}
	if out, code := sh(t, e, sb.ID, `cd /tmp/w && echo 1 > a.txt && echo 2 >> a.txt && chmod 600 a.txt && mv a.txt b.txt && rm b.txt &&
		mkdir sub && echo x > sub/in.txt && echo y > pre/p.txt`); code != 0 {
		t.Fatalf("changes: %d %s", code, out)
	}
	common := []string{"create a.txt", "write a.txt", "chmod a.txt", "rename a.txt", "create b.txt", "remove b.txt", "create sub"}
	rec.waitFor(t, common...)
	rec.waitFor(t, "create sub/in.txt")
	rec.waitFor(t, "create pre/p.txt", "write pre/p.txt")
	flat.waitFor(t, common...)
	// Made surely after sub's watch: seen by the recursive watch only.
	sh(t, e, sb.ID, "echo more >> /tmp/w/sub/in.txt")
	rec.waitFor(t, "write sub/in.txt")
	time.Sleep(300 * time.Millisecond)
	for _, ev := range flat.list() {
		if strings.Contains(ev, "/") {
			t.Fatalf("the non-recursive watch reported %q", ev)
		}
	}

	// Bad requests are errors before any event.
	noop := func(api.FileEvent) error { return nil }
	if err := e.client.WatchDir(ctx, sb.ID, api.WatchRequest{Path: "/tmp/f"}, noop); !errors.Is(err, errdefs.ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("watch of a file: %v", err)
	}
	if err := e.client.WatchDir(ctx, sb.ID, api.WatchRequest{Path: "/tmp/missing"}, noop); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("watch of a missing dir: %v", err)
	}
	if err := e.client.WatchDir(ctx, sb.ID, api.WatchRequest{Path: "/root", User: "user"}, noop); !errors.Is(err, errdefs.ErrUnprocessable) {
		t.Fatalf("user watching /root: %v", err)
	}
	if err := e.client.WatchDir(ctx, sb.ID, api.WatchRequest{Path: "tmp"}, noop); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("relative path: %v", err)
	}

	// A client that goes away releases the agent's side.
	flat.cancel()
	if err := <-flat.done; err != nil {
		t.Fatalf("cancelled watch: %v", err)
	}
	waitAgentWatches(t, e, sb.ID, 1)
	// Removing the watched directory ends the watch: its last event is
	// the directory's own removal, the error ErrNotFound.
	sh(t, e, sb.ID, "rm -r /tmp/w")
	select {
	case err := <-rec.done:
		if !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("watch of a removed dir: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("watch of a removed dir did not end: %v", rec.list())
	}
	if l := rec.list(); l[len(l)-1] != "remove ." {
		t.Fatalf("last event %q", l[len(l)-1])
	}
	waitAgentWatches(t, e, sb.ID, 0)

	// Stopping the sandbox ends a watch as unavailable.
	sh(t, e, sb.ID, "mkdir /tmp/w2")
	w2 := watch(t, e, sb.ID, api.WatchRequest{Path: "/tmp/w2"})
	op, err := e.client.Stop(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.WaitOperation(ctx, op.ID); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-w2.done:
		if !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("watch across a stop: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("watch did not end when its sandbox stopped")
	}
}

// agentWatches asks the sandbox's agent how many watches it serves.
func agentWatches(t *testing.T, e *env, id string) int {
	t.Helper()
	c, release, err := e.srv.Manager().Agent(ctxT(t, time.Minute), id)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	h, err := c.Health(ctxT(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	return h.Watches
}

func waitAgentWatches(t *testing.T, e *env, id string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := agentWatches(t, e, id)
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent reports %d watches, want %d", got, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
