package sandbox

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/build"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// stepHarness is a manager over the real native runtime, with the base
// rootfs imported as template "base:latest".
type stepHarness struct {
	dir  string // short: the agent socket path must fit in sockaddr_un
	db   *store.DB
	tmpl *template.Store
	rt   *native.Runtime
	m    *Manager
	base api.Template
}

func newStepHarness(t *testing.T) *stepHarness {
	t.Helper()
	testenv.RequireRoot(t)
	rootfs := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "bs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	db, err := store.Open(filepath.Join(dir, "space.db"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tmpl, err := template.Open(db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), log)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	base, err := tmpl.ImportDir(ctx, rootfs, template.ImportOptions{Tags: []string{"base:latest"}, Source: "dir"})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := runtime.New(native.Name, runtime.Config{DataDir: filepath.Join(dir, "n"), AgentBinary: agent, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	if c := rt.Probe(ctx); !c.Available {
		testenv.Require(t, "native-runtime", false, c.Reason)
	}
	h := &stepHarness{dir: dir, db: db, tmpl: tmpl, rt: rt.(*native.Runtime), base: base}
	h.m = New(Config{DB: db, Templates: tmpl, Runtimes: map[string]runtime.Runtime{native.Name: rt}, Logger: log})
	t.Cleanup(func() {
		h.m.Close()
		h.rt.Close()
		db.Close()
	})
	return h
}

// assertNoSandbox checks that no sandbox is left: none in the store, no
// directory, mount or cgroup of one in the runtime.
func (h *stepHarness) assertNoSandbox(t *testing.T) {
	t.Helper()
	sbs, err := h.db.ListSandboxes(context.Background(), store.SandboxFilter{})
	if err != nil || len(sbs) != 0 {
		t.Errorf("sandboxes in the store after the step: %v %v", sbs, err)
	}
	ents, _ := os.ReadDir(filepath.Join(h.rt.DataDir(), "sandboxes"))
	if len(ents) != 0 {
		t.Errorf("sandbox directories left: %v", ents)
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mi), filepath.Join(h.rt.DataDir(), "sandboxes")+"/") {
		t.Errorf("mounts left under %s:\n%s", h.rt.DataDir(), mi)
	}
}

// syncBuffer is an io.Writer safe to read while RunStep writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestRunStepNative(t *testing.T) {
	h := newStepHarness(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	t.Run("changes", func(t *testing.T) {
		var out syncBuffer
		var derived api.Template
		applied := 0
		code, err := h.m.builds.RunStep(ctx, build.Step{
			Template: h.base.Digest,
			Cmd:      []string{"sh", "-c", "echo hi; echo oops >&2; mkdir -p /opt/x && echo data > /opt/x/f && rm /etc/hostname; exit 0"},
			Env:      map[string]string{"GREETING": "x"},
			Output:   &out,
			Apply: func(ctx context.Context, u template.Upper) error {
				applied++
				var st unix.Stat_t
				if err := unix.Lstat(filepath.Join(u.Dir, "opt/x/f"), &st); err != nil || st.Uid != u.IDBase {
					t.Errorf("upper opt/x/f: uid %d (IDBase %d), %v", st.Uid, u.IDBase, err)
				}
				if err := unix.Lstat(filepath.Join(u.Dir, "etc/hostname"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
					t.Errorf("upper etc/hostname is not a whiteout: mode %o, %v", st.Mode, err)
				}
				if u.OpaqueXattr != native.OpaqueXattr {
					t.Errorf("opaque xattr %q", u.OpaqueXattr)
				}
				var err error
				derived, err = h.tmpl.Derive(ctx, h.base.Digest, template.DeriveOptions{
					Config: h.base.Config,
					Layer:  api.TemplateLayer{CreatedBy: "RUN test"},
					Apply:  func(ctx context.Context, tr *template.Tree) error { return tr.ApplyUpperDir(ctx, u) },
				})
				return err
			},
		})
		if err != nil || code != 0 {
			t.Fatalf("RunStep: %d %v\noutput: %s", code, err, out.String())
		}
		// stdout and stderr are two pipes: their relative order is the
		// agent's reading order, not a guarantee.
		if got := out.String(); got != "hi\noops\n" && got != "oops\nhi\n" {
			t.Errorf("output %q, want stdout's hi and stderr's oops", got)
		}
		if applied != 1 {
			t.Fatalf("Apply called %d times", applied)
		}
		_, rootfs, err := h.tmpl.Resolve(ctx, derived.Digest)
		if err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(rootfs, "opt/x/f"), &st); err != nil || st.Uid != 0 || st.Gid != 0 {
			t.Errorf("derived opt/x/f: uid %d gid %d, %v; want 0 0", st.Uid, st.Gid, err)
		}
		if b, err := os.ReadFile(filepath.Join(rootfs, "opt/x/f")); err != nil || string(b) != "data\n" {
			t.Errorf("derived opt/x/f: %q %v", b, err)
		}
		if _, err := os.Lstat(filepath.Join(rootfs, "etc/hostname")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("derived template still has etc/hostname: %v", err)
		}
		// The build sandbox's own host files are not the step's changes.
		if _, err := os.Lstat(filepath.Join(rootfs, "etc/hosts")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("derived template has the build sandbox's etc/hosts: %v", err)
		}
		if derived.Parent != h.base.Digest || derived.TreeDigest == h.base.TreeDigest {
			t.Errorf("derived %+v", derived)
		}
		h.assertNoSandbox(t)

		// The next step runs on the derived template (whose runtime copy
		// links the parent copy's unchanged files) and sees the change,
		// and no hostname line of the previous step's sandbox.
		out = syncBuffer{}
		t0 := time.Now()
		code, err = h.m.builds.RunStep(ctx, build.Step{
			Template: derived.Digest,
			Cmd:      []string{"sh", "-c", "cat /opt/x/f; grep -c 127.0.1.1 /etc/hosts"},
			Output:   &out,
			Apply:    func(context.Context, template.Upper) error { return nil },
		})
		if err != nil || code != 0 || out.String() != "data\n1\n" {
			t.Fatalf("step on the derived template: %d %v %q", code, err, out.String())
		}
		t.Logf("a step on a derived template took %s", time.Since(t0).Round(time.Millisecond))
		h.assertNoSandbox(t)
	})

	t.Run("failing step", func(t *testing.T) {
		var out syncBuffer
		code, err := h.m.builds.RunStep(ctx, build.Step{
			Template: h.base.Digest,
			Cmd:      []string{"sh", "-c", "echo before; touch /new; exit 3"},
			Output:   &out,
			Apply: func(context.Context, template.Upper) error {
				t.Error("Apply called for a failing step")
				return nil
			},
		})
		if err != nil || code != 3 {
			t.Fatalf("RunStep: %d %v, want exit 3", code, err)
		}
		if out.String() != "before\n" {
			t.Errorf("output %q", out.String())
		}
		h.assertNoSandbox(t)
	})

	t.Run("cancelled", func(t *testing.T) {
		var out syncBuffer
		cctx, ccancel := context.WithCancel(ctx)
		defer ccancel()
		go func() {
			for cctx.Err() == nil && !strings.Contains(out.String(), "started") {
				time.Sleep(10 * time.Millisecond)
			}
			ccancel()
		}()
		code, err := h.m.builds.RunStep(cctx, build.Step{
			Template: h.base.Digest,
			Cmd:      []string{"sh", "-c", "echo started; sleep 60"},
			Output:   &out,
			Apply: func(context.Context, template.Upper) error {
				t.Error("Apply called for a cancelled step")
				return nil
			},
		})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("RunStep: %d %v, want context.Canceled", code, err)
		}
		h.assertNoSandbox(t)
	})

	t.Run("network refused", func(t *testing.T) {
		_, err := h.m.builds.RunStep(ctx, build.Step{
			Template: h.base.Digest, Cmd: []string{"true"}, Network: true,
			Apply: func(context.Context, template.Upper) error { return nil },
		})
		// This manager has no network gateway.
		if !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), "no network gateway") {
			t.Fatalf("network step: %v, want ErrNotSupported saying there is no gateway", err)
		}
		h.assertNoSandbox(t)
	})
}

// TestRunStepNeedsChangeExport: with only runtimes whose instances cannot
// export changes (the fake one), a step fails clearly and leaves nothing.
func TestRunStepNeedsChangeExport(t *testing.T) {
	h := newHarness(t)
	_, err := h.m.builds.RunStep(h.ctx(), build.Step{
		Template: "tiny:latest", Cmd: []string{"true"},
		Apply: func(context.Context, template.Upper) error { return nil },
	})
	if !errors.Is(err, errdefs.ErrNotSupported) {
		t.Fatalf("RunStep on the fake runtime: %v, want ErrNotSupported", err)
	}
	if sbs, _ := h.db.ListSandboxes(h.ctx(), store.SandboxFilter{}); len(sbs) != 0 {
		t.Fatalf("sandboxes left: %+v", sbs)
	}
	// A missing template is reported as such, and its failed sandbox goes.
	_, err = h.m.builds.RunStep(h.ctx(), build.Step{
		Template: "sha256:0000000000000000000000000000000000000000000000000000000000000000", Cmd: []string{"true"},
		Apply: func(context.Context, template.Upper) error { return nil },
	})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("RunStep on a missing template: %v, want ErrNotFound", err)
	}
	if sbs, _ := h.db.ListSandboxes(h.ctx(), store.SandboxFilter{}); len(sbs) != 0 {
		t.Fatalf("sandboxes left: %+v", sbs)
	}
}

// TestDeleteBuildSandboxes removes labelled leftovers and nothing else.
func TestDeleteBuildSandboxes(t *testing.T) {
	h := newHarness(t)
	step := h.create(api.CreateSandboxRequest{Labels: map[string]string{BuildLabel: BuildLabelStep}})
	other := h.create(api.CreateSandboxRequest{Labels: map[string]string{"team": "a"}})
	n, err := h.m.builds.DeleteBuildSandboxes(h.ctx())
	if err != nil || n != 1 {
		t.Fatalf("DeleteBuildSandboxes: %d %v", n, err)
	}
	if _, err := h.m.Get(h.ctx(), step.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("build sandbox still there: %v", err)
	}
	if h.state(other.ID) != api.StateRunning {
		t.Fatal("an unlabelled sandbox was touched")
	}
}
