package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func TestResolve(t *testing.T) {
	f := &fsCall{user: "user"}
	r := &fsCall{user: "root", sb: api.Sandbox{Workdir: "/work/"}}
	for _, c := range []struct {
		f        *fsCall
		in, want string
	}{
		{f, "", "/home/user"},
		{r, "", "/work"},
		{f, "a/b.txt", "/home/user/a/b.txt"},
		{f, "./a/../b", "/home/user/b"},
		{f, "~", "/home/user"},
		{f, "~/x", "/home/user/x"},
		{r, "x", "/root/x"},
		{f, "/tmp//a/../b", "/tmp/b"},
		{f, "../../etc/passwd", "/etc/passwd"}, // as envd: a path, not a jail
	} {
		got, err := c.f.resolve(c.in)
		if err != nil || got != c.want {
			t.Errorf("resolve(%q) as %s = %q, %v; want %q", c.in, c.f.user, got, err, c.want)
		}
	}
	for _, bad := range []string{"~root/x", "a\x00b", strings.Repeat("a", 4097)} {
		if _, err := f.resolve(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("resolve(%.20q) = %v, want invalid argument", bad, err)
		}
	}
}

func TestCheckUser(t *testing.T) {
	for _, ok := range []string{"user", "root", "1000", "a_b", "deploy-bot", "x.y"} {
		if err := checkUser(ok); err != nil {
			t.Errorf("checkUser(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-x", ".x", "a:b", "a/b", "a b", "é", strings.Repeat("a", 33), "1000:1000"} {
		if err := checkUser(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("checkUser(%q) = %v, want invalid argument", bad, err)
		}
	}
}

func TestEntryInfo(t *testing.T) {
	n := names{users: map[uint32]string{1000: "user"}, groups: map[uint32]string{1000: "user"}}
	mt := time.Date(2026, 1, 2, 3, 4, 5, 600_000_000, time.FixedZone("x", 3600))
	// Permissions are Go's os.FileMode text, as envd shows them ("u" is setuid).
	e := n.entry(api.FileInfo{Name: "a", Path: "/a", Type: "file", Size: 12, Mode: 0o4755, ModTime: mt, UID: 1000, GID: 7})
	if e.Type != fileTypeFile || e.Mode != 0o755 || e.Permissions != "urwxr-xr-x" || e.Owner != "user" || e.Group != "7" || e.Size != 12 {
		t.Errorf("entry = %+v", e)
	}
	// protobuf's JSON Timestamp takes 0, 3, 6 or 9 fraction digits only.
	if e.ModifiedTime != "2026-01-02T02:04:05.600000000Z" {
		t.Errorf("modifiedTime = %q", e.ModifiedTime)
	}
	d := n.entry(api.FileInfo{Type: "dir", Mode: 0o1777})
	if d.Type != fileTypeDirectory || d.Permissions != "dtrwxrwxrwx" {
		t.Errorf("dir entry = %+v", d)
	}
	l := n.entry(api.FileInfo{Type: "symlink", Mode: 0o777, Target: "/x"})
	if l.Type != fileTypeSymlink || l.SymlinkTarget == nil || *l.SymlinkTarget != "/x" || l.Permissions != "Lrwxrwxrwx" {
		t.Errorf("symlink entry = %+v", l)
	}
	if o := n.entry(api.FileInfo{Type: "other"}); o.Type != fileTypeUnspecified {
		t.Errorf("other entry = %+v", o)
	}
}

func TestAcceptsGzip(t *testing.T) {
	for v, want := range map[string]bool{
		"": false, "gzip": true, "br, gzip;q=0.5": true, "GZIP": true, "gzip;q=0": false, "deflate": false, "identity, gzip ; q=0.000": false,
	} {
		r := httptest.NewRequest("GET", "/files", nil)
		if v != "" {
			r.Header.Set("Accept-Encoding", v)
		}
		if got := acceptsGzip(r); got != want {
			t.Errorf("acceptsGzip(%q) = %v", v, got)
		}
	}
}

// TestSignature checks the signature against one computed as E2B's SDK
// computes it (getSignature: sha256 of path:operation:user:token[:exp],
// base64 without padding), and that a signature holds only for its
// method, path, user and time.
func TestSignature(t *testing.T) {
	h := New(Config{Secret: []byte("secret")})
	sb := api.Sandbox{ID: "sb1", CreatedAt: time.Unix(1, 0)}
	tok := h.envdToken(sb)
	// E2B's getSignature({path: "/a", operation: "read", envdAccessToken: "tok"}).
	if got := signature("/a", "read", "", "tok", ""); got != "v1_2/gNbgFPxFSqkheS/SD0NHlzA121E/nxkOtc/ovxeoI" {
		t.Errorf("signature = %q", got)
	}
	req := func(method string, q url.Values) error {
		r := httptest.NewRequest(method, "/files?"+q.Encode(), nil)
		return (filesystemAPI{h}).checkSignature(r, sb)
	}
	q := url.Values{"path": {"/tmp/x"}, "username": {"user"}, "signature": {signature("/tmp/x", "read", "user", tok, "")}}
	if err := req("GET", q); err != nil {
		t.Fatalf("valid read signature: %v", err)
	}
	if err := req("POST", q); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Errorf("read signature used to write: %v", err)
	}
	for k, v := range map[string]string{"path": "/tmp/y", "username": "root"} {
		q2 := url.Values{}
		for k, v := range q {
			q2[k] = v
		}
		q2.Set(k, v)
		if err := req("GET", q2); !errors.Is(err, errdefs.ErrUnauthorized) {
			t.Errorf("signature with another %s: %v", k, err)
		}
	}
	other := api.Sandbox{ID: "sb2", CreatedAt: time.Unix(1, 0)}
	if err := (filesystemAPI{h}).checkSignature(httptest.NewRequest("GET", "/files?"+q.Encode(), nil), other); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Errorf("signature of another sandbox: %v", err)
	}
	future := strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10)
	past := strconv.FormatInt(time.Now().Add(-time.Second).Unix(), 10)
	q = url.Values{"path": {"/p"}, "signature": {signature("/p", "write", "", tok, future)}, "signature_expiration": {future}}
	if err := req("POST", q); err != nil {
		t.Errorf("unexpired write signature: %v", err)
	}
	q.Set("signature_expiration", past)
	if err := req("POST", q); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Errorf("signature with a moved expiry: %v", err)
	}
	q.Set("signature", signature("/p", "write", "", tok, past))
	if err := req("POST", q); !errors.Is(err, errdefs.ErrUnauthorized) || !strings.Contains(err.Error(), "expired") {
		t.Errorf("expired signature: %v", err)
	}
	q.Set("signature_expiration", "soon")
	if err := req("POST", q); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Errorf("malformed expiry: %v", err)
	}
}

// fakeWatch is a test dirWatcher: it arms at once, then sends what the
// test feeds it.
type fakeWatch struct {
	feed    chan watchEvent
	end     chan error
	running chan struct{}
}

func newFakeWatch() *fakeWatch {
	return &fakeWatch{feed: make(chan watchEvent, 100), end: make(chan error, 1), running: make(chan struct{}, 100)}
}

func (f *fakeWatch) watch(ctx context.Context, id, p string, recursive bool, user string, fn func(watchEvent) error) error {
	f.running <- struct{}{}
	defer func() { <-f.running }()
	if p == "/missing" {
		return fmt.Errorf("watch %s: %w", p, errdefs.ErrNotFound)
	}
	if err := fn(watchEvent{Type: watchArmed}); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-f.end:
			return err
		case ev := <-f.feed:
			if err := fn(ev); err != nil {
				return err
			}
		}
	}
}

func watchCtx(id string) context.Context {
	return context.WithValue(context.Background(), callerKey{}, envdCaller{sb: api.Sandbox{ID: id}})
}

func TestWatchers(t *testing.T) {
	h := New(Config{})
	defer h.Close()
	fw := newFakeWatch()
	h.watch = fw.watch
	ctx := watchCtx("sb1")
	ws := h.watchers
	cw, err := ws.create(ctx, nil, &watchDirRequest{Path: "/tmp"})
	if err != nil {
		t.Fatal(err)
	}
	fw.feed <- watchEvent{Name: "a", Type: watchCreate}
	fw.feed <- watchEvent{Name: "a", Type: watchWrite}
	fw.feed <- watchEvent{Name: "x", Type: "bogus"}
	fw.feed <- watchEvent{Name: "a", Type: watchRemove}
	var got []filesystemEvent
	for deadline := time.Now().Add(5 * time.Second); len(got) < 3 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		out, err := ws.events(ctx, nil, &watcherRequest{WatcherID: cw.WatcherID})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, out.Events...)
	}
	if fmt.Sprint(got) != "[{a EVENT_TYPE_CREATE <nil>} {a EVENT_TYPE_WRITE <nil>} {a EVENT_TYPE_REMOVE <nil>}]" {
		t.Errorf("events = %v", got)
	}
	// Another sandbox cannot see it.
	if _, err := ws.events(watchCtx("sb2"), nil, &watcherRequest{WatcherID: cw.WatcherID}); err == nil {
		t.Error("another sandbox read the watcher")
	}
	// A missing directory fails the create.
	if _, err := ws.create(ctx, nil, &watchDirRequest{Path: "/missing"}); err == nil || !strings.Contains(err.Error(), "not_found") {
		t.Errorf("create on a missing dir: %v", err)
	}
	if _, err := ws.remove(ctx, nil, &watcherRequest{WatcherID: cw.WatcherID}); err != nil {
		t.Fatal(err)
	}
	if _, err := ws.events(ctx, nil, &watcherRequest{WatcherID: cw.WatcherID}); err == nil {
		t.Error("a removed watcher still answers")
	}
	waitIdle(t, fw)

	// At most maxWatchersPerSandbox per sandbox.
	for i := 0; i < maxWatchersPerSandbox; i++ {
		if _, err := ws.create(ctx, nil, &watchDirRequest{Path: "/tmp"}); err != nil {
			t.Fatal(i, err)
		}
	}
	if _, err := ws.create(ctx, nil, &watchDirRequest{Path: "/tmp"}); err == nil || !strings.Contains(err.Error(), "resource_exhausted") {
		t.Errorf("watcher %d: %v", maxWatchersPerSandbox+1, err)
	}
	if _, err := ws.create(watchCtx("sb2"), nil, &watchDirRequest{Path: "/tmp"}); err != nil {
		t.Errorf("another sandbox's watcher: %v", err)
	}
	// Closing the layer ends every watch.
	h.Close()
	waitIdle(t, fw)
}

func waitIdle(t *testing.T, fw *fakeWatch) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); len(fw.running) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d watches still running", len(fw.running))
		}
	}
}

// TestWatcherOverflow: past the buffer, events are dropped; the reader
// gets those before the gap, then the loss, and the watcher is gone.
func TestWatcherOverflow(t *testing.T) {
	w := &watcher{}
	for i := 0; i < maxWatcherEvents+5; i++ {
		w.add(watchEvent{Name: strconv.Itoa(i), Type: watchCreate})
	}
	if len(w.events) != maxWatcherEvents || w.dropped != 5 {
		t.Fatalf("buffered %d, dropped %d", len(w.events), w.dropped)
	}
	h := New(Config{})
	defer h.Close()
	fw := newFakeWatch()
	h.watch = fw.watch
	ctx := watchCtx("sb1")
	cw, err := h.watchers.create(ctx, nil, &watchDirRequest{Path: "/tmp"})
	if err != nil {
		t.Fatal(err)
	}
	fw.feed <- watchEvent{Name: "a", Type: watchCreate}
	fw.feed <- watchEvent{Type: watchOverflow}
	fw.feed <- watchEvent{Name: "b", Type: watchCreate} // after the gap: not delivered
	time.Sleep(100 * time.Millisecond)
	out, err := h.watchers.events(ctx, nil, &watcherRequest{WatcherID: cw.WatcherID})
	if err != nil || len(out.Events) != 1 || out.Events[0].Name != "a" {
		t.Fatalf("events = %+v, %v", out, err)
	}
	// Through the Connect handler: a unary error with its own status.
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", "/GetWatcherEvents", strings.NewReader(`{"watcherId":"`+cw.WatcherID+`"}`)).WithContext(ctx)
	req.Header.Set("Content-Type", "application/json")
	unary(h.watchers.events)(rec, req)
	if rec.Code != 500 || !strings.Contains(rec.Body.String(), `"code":"data_loss"`) {
		t.Errorf("after the loss: %d %s", rec.Code, rec.Body)
	}
	if _, err := h.watchers.events(ctx, nil, &watcherRequest{WatcherID: cw.WatcherID}); err == nil || !strings.Contains(err.Error(), "not_found") {
		t.Errorf("after reporting the loss: %v", err)
	}
	waitIdle(t, fw)
}

func TestFullReader(t *testing.T) {
	r := fullReader{iotest.OneByteReader(strings.NewReader("0123456789abc"))}
	buf := make([]byte, 10)
	if n, err := r.Read(buf); n != 10 || err != nil {
		t.Fatalf("first read: %d, %v", n, err)
	}
	if n, err := r.Read(buf); n != 3 || err != io.EOF || string(buf[:n]) != "abc" {
		t.Fatalf("last read: %d %q, %v", n, buf[:n], err)
	}
}
