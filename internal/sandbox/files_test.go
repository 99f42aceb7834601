package sandbox

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
)

// underEtc denies writes and deletes of /etc and below, the rule set the
// attacks below try to get around.
func underEtc(a actions.Action) string {
	if (a.Kind == actions.FileWrite || a.Kind == actions.FileDelete) && (a.Path == "/etc" || strings.HasPrefix(a.Path, "/etc/")) {
		return "/etc is read-only here"
	}
	return ""
}

type tarEntry struct {
	name, link string
	typ        byte
	body       string
}

func tarOf(t *testing.T, entries ...tarEntry) *bytes.Buffer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		hdr := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: 0o644, Size: int64(len(e.body))}
		if e.typ != tar.TypeReg {
			hdr.Size = 0
		}
		if e.typ == tar.TypeDir {
			hdr.Mode = 0o755
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	return &buf
}

// TestFilesDecidedOnTheRealPath tries every way around a rule on /etc that
// the files API offers: unclean paths, symlinks planted earlier, tar entries
// and hard links. Each is refused with the rule's reason, audited, and
// leaves /etc as it was; the same operations elsewhere pass.
func TestFilesDecidedOnTheRealPath(t *testing.T) {
	h, d, rec := newPolicyHarness(t, fakeruntime.Options{})
	sb := h.create(api.CreateSandboxRequest{})
	ctx := h.ctx()
	fs, err := h.m.files.OpenFiles(ctx, sb.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()

	// The fake's root starts empty. Planted while no rule applies: symlinks into /etc, absolute and relative.
	if err := fs.TarPut(ctx, "/tmp", tarOf(t,
		tarEntry{name: "abs", link: "/etc", typ: tar.TypeSymlink},
		tarEntry{name: "rel", link: "../etc", typ: tar.TypeSymlink},
		tarEntry{name: "hello", link: "/etc/hello", typ: tar.TypeSymlink},
		tarEntry{name: "work", typ: tar.TypeDir},
		tarEntry{name: "work/a", typ: tar.TypeReg, body: "a"},
	)); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Mkdir(ctx, "/etc", 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Write(ctx, "/etc/hello", 0o644, strings.NewReader("hi")); err != nil {
		t.Fatal(err)
	}
	d.set(underEtc)

	denied := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, errdefs.ErrPolicyDenied) || !strings.Contains(err.Error(), "/etc is read-only here") {
			t.Errorf("%s: want the rule's refusal, got %v", what, err)
		}
	}
	for _, p := range []string{"/tmp/../etc/x", "//etc/x", "/./etc/x", "/etc//x", "/tmp/abs/x", "/tmp/rel/x", "/tmp/abs/../abs/x"} {
		_, err := fs.Write(ctx, p, 0, strings.NewReader("owned"))
		denied("write "+p, err)
		_, err = fs.Mkdir(ctx, p+"/d", 0o755)
		denied("mkdir "+p+"/d", err)
		denied("rename to "+p, fs.Rename(ctx, "/tmp/work/a", p))
		denied("tar into "+p, fs.TarPut(ctx, p, tarOf(t, tarEntry{name: "f", typ: tar.TypeReg, body: "x"})))
	}
	for _, p := range []string{"/tmp/../etc/hello", "//etc/hello", "/tmp/abs/hello", "/tmp/rel/hello"} {
		denied("remove "+p, fs.Remove(ctx, p, false))
		denied("rename from "+p, fs.Rename(ctx, p, "/tmp/stolen"))
	}
	// Writing at a symlink replaces the link, it does not write through it:
	// /tmp/hello is the path acted on, and it is allowed.
	if _, err := fs.Write(ctx, "/tmp/hello", 0, strings.NewReader("mine")); err != nil {
		t.Errorf("replacing the symlink /tmp/hello: %v", err)
	}
	// Every entry of a tar is an action: one refused entry refuses the
	// upload and nothing of it lands, not even the allowed entries before.
	denied("tar entry etc/x at /", fs.TarPut(ctx, "/", tarOf(t,
		tarEntry{name: "tmp/first", typ: tar.TypeReg, body: "1"},
		tarEntry{name: "etc/x", typ: tar.TypeReg, body: "x"})))
	if _, err := fs.Stat(ctx, "/tmp/first"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("an entry before the refused one was extracted: %v", err)
	}
	denied("tar dir entry ./etc", fs.TarPut(ctx, "/", tarOf(t, tarEntry{name: "./etc/", typ: tar.TypeDir})))
	denied("tar hard link to etc/hello", fs.TarPut(ctx, "/", tarOf(t,
		tarEntry{name: "tmp/hl", link: "etc/hello", typ: tar.TypeLink})))
	// A symlink in the same archive cannot carry a later entry elsewhere:
	// entries are extracted with symlinks refused on the way.
	err = fs.TarPut(ctx, "/tmp", tarOf(t,
		tarEntry{name: "s", link: "/etc", typ: tar.TypeSymlink},
		tarEntry{name: "s/x", typ: tar.TypeReg, body: "x"}))
	if err == nil {
		t.Error("a tar entry below a symlink of the same archive was extracted")
	}

	for _, p := range []string{"/etc/x", "/etc/d", "/etc/f", "/tmp/etc"} {
		if _, err := fs.Stat(ctx, p); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("%s exists after the refusals: %v", p, err)
		}
	}
	rc, err := fs.Read(ctx, "/etc/hello")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != "hi" {
		t.Errorf("/etc/hello is %q", b)
	}

	// Allowed: clean and unclean paths outside /etc, through a symlink
	// that stays outside.
	if _, err := fs.Write(ctx, "/tmp/./work//b", 0, strings.NewReader("b")); err != nil {
		t.Errorf("write /tmp/./work//b: %v", err)
	}
	if err := fs.TarPut(ctx, "/tmp", tarOf(t, tarEntry{name: "w", link: "work", typ: tar.TypeSymlink})); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Write(ctx, "/tmp/w/c", 0, strings.NewReader("c")); err != nil {
		t.Errorf("write through /tmp/w -> work: %v", err)
	}
	if fi, err := fs.Stat(ctx, "/tmp/work/c"); err != nil || fi.Size != 1 {
		t.Errorf("/tmp/work/c: %+v %v", fi, err)
	}

	// The refusals are in the audit log, each naming the rule.
	n := 0
	for _, ev := range rec.Events() {
		if ev.Kind == audit.KindPolicy && ev.Action == string(actions.Deny) && ev.Detail["rule"] == "test-rule" {
			n++
		}
	}
	if n < 30 {
		t.Errorf("%d policy denials audited, want one per refusal", n)
	}
}

// TestFilesDeniedBeforeWake: a refused operation does not wake a stopped
// sandbox; an allowed one does.
func TestFilesDeniedBeforeWake(t *testing.T) {
	h, d, _ := newPolicyHarness(t, fakeruntime.Options{})
	sb := h.create(api.CreateSandboxRequest{})
	h.verb(sb.ID, api.OpStop)
	d.set(underEtc)
	ctx := h.ctx()
	fs, err := h.m.files.OpenFiles(ctx, sb.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	if _, err := fs.Write(ctx, "/tmp/../etc/x", 0, strings.NewReader("x")); !errors.Is(err, errdefs.ErrPolicyDenied) {
		t.Fatalf("write: %v", err)
	}
	if st := h.state(sb.ID); st != api.StateStopped {
		t.Fatalf("a refused write left the sandbox %s", st)
	}
	if _, err := fs.Write(ctx, "/x", 0, strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
	if st := h.state(sb.ID); st != api.StateRunning {
		t.Fatalf("an allowed write left the sandbox %s", st)
	}
}

// TestPortsDecidedAtTheDial: every way in to a sandbox's port dials through
// DialPort, which asks the policy before it wakes the sandbox; making a
// port public asks too, making it private does not.
func TestPortsDecidedAtTheDial(t *testing.T) {
	h, d, _ := newPolicyHarness(t, fakeruntime.Options{})
	h.netw = NewFakeNetwork()
	h.m.Close()
	h.m = h.manager()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	h.netw.Serve(8000, ln.Addr().String())
	h.netw.Serve(8001, ln.Addr().String())
	sb := h.create(api.CreateSandboxRequest{})
	h.verb(sb.ID, api.OpStop)
	d.set(func(a actions.Action) string {
		if a.Kind == actions.Port && a.Port == 8000 {
			return "port 8000 stays shut"
		}
		return ""
	})
	ctx := h.ctx()
	if _, err := h.m.net.DialPort(ctx, sb.ID, 8000); !errors.Is(err, errdefs.ErrPolicyDenied) || !strings.Contains(err.Error(), "stays shut") {
		t.Fatalf("dial 8000: %v", err)
	}
	if st := h.state(sb.ID); st != api.StateStopped {
		t.Fatalf("a refused dial left the sandbox %s", st)
	}
	if _, err := h.m.net.SetPortPublic(ctx, sb.ID, 8000, true); !errors.Is(err, errdefs.ErrPolicyDenied) {
		t.Fatalf("making 8000 public: %v", err)
	}
	if _, err := h.m.net.SetPortPublic(ctx, sb.ID, 8000, false); err != nil {
		t.Fatalf("making 8000 private: %v", err)
	}
	c, err := h.m.net.DialPort(ctx, sb.ID, 8001)
	if err != nil {
		t.Fatalf("dial 8001: %v", err)
	}
	c.Close()
	if d.count(actions.Port, "") != 3 {
		t.Errorf("%d port decisions, want 3 (the two dials and making 8000 public)", d.count(actions.Port, ""))
	}
}

// TestDeadlineDecidedAsItsVerb: a caller a rule keeps from deleting cannot
// set a deadline of now (earlier than the one there, or a short fuse where
// there was none) instead; moving it later or removing it passes.
func TestDeadlineDecidedAsItsVerb(t *testing.T) {
	h, d, _ := newPolicyHarness(t, fakeruntime.Options{})
	later := time.Now().Add(time.Hour)
	sb := h.create(api.CreateSandboxRequest{})
	ctx := h.ctx()
	if _, err := h.m.Verbs().SetExpiry(ctx, sb.ID, &later); err != nil {
		t.Fatal(err)
	}
	d.set(denyVerbs(api.OpDelete))
	now := time.Now()
	if _, err := h.m.Verbs().SetExpiry(ctx, sb.ID, &now); !errors.Is(err, errdefs.ErrPolicyDenied) {
		t.Fatalf("a deadline of now under a rule against delete: %v", err)
	}
	got, _ := h.m.Get(ctx, sb.ID)
	if got.ExpiresAt == nil || !got.ExpiresAt.Equal(later.UTC()) {
		t.Fatalf("the refused deadline changed the record: %v", got.ExpiresAt)
	}
	evenLater := later.Add(time.Hour)
	if _, err := h.m.Verbs().SetExpiry(ctx, sb.ID, &evenLater); err != nil {
		t.Fatalf("moving the deadline later: %v", err)
	}
	if _, err := h.m.Verbs().SetExpiry(ctx, sb.ID, nil); err != nil {
		t.Fatalf("removing the deadline: %v", err)
	}
	soon := time.Now().Add(time.Second)
	if _, err := h.m.Verbs().SetExpiry(ctx, sb.ID, &soon); !errors.Is(err, errdefs.ErrPolicyDenied) {
		t.Fatalf("a first deadline a second away: %v", err)
	}
	if _, err := h.m.Verbs().SetExpiry(ctx, sb.ID, &evenLater); err != nil {
		t.Fatalf("a first deadline two hours away (as E2B's connect sets one): %v", err)
	}
}
