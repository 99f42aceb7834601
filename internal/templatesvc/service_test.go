package templatesvc

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/build"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
)

// fakeSandboxes lists a fixed set of sandboxes, holds the templates of a
// fixed set of pool members, and runs no steps.
type fakeSandboxes struct {
	sbs  []api.Sandbox
	held map[string]bool
}

func (f *fakeSandboxes) PoolTemplates(context.Context) (map[string]bool, error) {
	return f.held, nil
}

func (f *fakeSandboxes) List(context.Context, string, map[string]string) ([]api.Sandbox, error) {
	return f.sbs, nil
}

func (f *fakeSandboxes) RunStep(context.Context, build.Step) (int, error) {
	return 0, errors.New("no steps here")
}

// preparer is a runtime that records what it was asked to prepare and forget.
type preparer struct {
	runtime.Runtime // nil: only Probe and the preparer methods are called
	available       bool
	mu              sync.Mutex
	prepared        []string
	forgot          []string
}

func (p *preparer) Probe(context.Context) runtime.Capabilities {
	return runtime.Capabilities{Available: p.available}
}

func (p *preparer) PrepareTemplate(_ context.Context, tree, rootfs string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.prepared = append(p.prepared, tree)
	return nil
}

func (p *preparer) ForgetTemplate(_ context.Context, tree string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.forgot = append(p.forgot, tree)
	return nil
}

func rootfsTar(t *testing.T, file string) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	tw.WriteHeader(&tar.Header{Name: file, Typeflag: tar.TypeReg, Mode: 0o644, Size: 2})
	tw.Write([]byte("x\n"))
	tw.Close()
	return b.Bytes()
}

func newService(t *testing.T, sbs *fakeSandboxes, rts map[string]runtime.Runtime) *Service {
	t.Helper()
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tmpl.Close() })
	return New(Config{Templates: tmpl, Runtimes: rts, Sandboxes: sbs, MaxBytes: 1 << 20})
}

// TestImportPrepareRemoveGC follows one template through the service: the
// import prepares it on available runtimes only, a sandbox using it (even
// one whose create has not resolved the digest yet) keeps it, and gc asks
// every runtime, available or not, to forget its tree.
func TestImportPrepareRemoveGC(t *testing.T) {
	up, down := &preparer{available: true}, &preparer{available: false}
	sbs := &fakeSandboxes{}
	s := newService(t, sbs, map[string]runtime.Runtime{"up": up, "down": down})
	ctx := context.Background()

	tp, err := s.Import(ctx, "", bytes.NewReader(rootfsTar(t, "a")), []string{"one:1"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(up.prepared, []string{tp.TreeDigest}) || len(down.prepared) != 0 {
		t.Fatalf("prepared: available %v, unavailable %v", up.prepared, down.prepared)
	}
	if _, err := s.Import(ctx, "zip", bytes.NewReader(nil), nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("unknown format: %v", err)
	}

	sbs.sbs = []api.Sandbox{
		{ID: "sb-resolved", TemplateDigest: tp.Digest, State: api.StateStopped},
		{ID: "sb-creating", Template: tp.Digest, State: api.StateCreating},
		{ID: "sb-gone", TemplateDigest: tp.Digest, State: api.StateDeleted},
	}
	got, err := s.Inspect(ctx, "one:1")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.UsedBy, []string{"sb-resolved", "sb-creating"}) {
		t.Fatalf("used by %v", got.UsedBy)
	}
	if _, err := s.Tag(ctx, "one:1", ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("empty tag: %v", err)
	}
	if err := s.Remove(ctx, "one:1", false); err != nil { // untag
		t.Fatal(err)
	}
	if err := s.Remove(ctx, tp.Digest, false); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "used by a sandbox") {
		t.Fatalf("remove in use: %v", err)
	}
	if res, err := s.GC(ctx); err != nil || len(up.forgot)+len(down.forgot) != 0 {
		t.Fatalf("gc with the template in use: %+v %v; forgot %v %v", res, err, up.forgot, down.forgot)
	}

	// A pool member (never listed) keeps its template alive as well.
	sbs.sbs, sbs.held = nil, map[string]bool{tp.Digest: true}
	if err := s.Remove(ctx, tp.Digest, false); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("remove of a pool's template: %v", err)
	}
	if res, err := s.GC(ctx); err != nil || len(up.forgot)+len(down.forgot) != 0 {
		t.Fatalf("gc with the template held by a pool: %+v %v; forgot %v %v", res, err, up.forgot, down.forgot)
	}

	sbs.held = nil
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(up.forgot, []string{tp.TreeDigest}) || !slices.Equal(down.forgot, []string{tp.TreeDigest}) {
		t.Fatalf("forgot: available %v, unavailable %v", up.forgot, down.forgot)
	}
}

// TestBuildRequestCheck refuses a bad file or tag before any context is read.
func TestBuildRequestCheck(t *testing.T) {
	for _, c := range []struct {
		req BuildRequest
		ok  bool
	}{
		{BuildRequest{}, true},
		{BuildRequest{File: "sub/../Dockerfile", Tags: []string{"app:1"}}, true},
		{BuildRequest{File: "/etc/passwd"}, false},
		{BuildRequest{File: "../x"}, false},
		{BuildRequest{File: "a/../../x"}, false},
		{BuildRequest{File: "a\x00b"}, false},
		{BuildRequest{Tags: []string{"Bad Tag"}}, false},
	} {
		err := c.req.Check()
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, errdefs.ErrInvalidArgument)) {
			t.Errorf("%+v: %v", c.req, err)
		}
	}
}
