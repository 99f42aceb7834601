package native_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/runtime/runtimetest"
)

// loopsFor lists the loop devices backed by img (losetup -j).
func loopsFor(t *testing.T, img string) string {
	t.Helper()
	out, err := exec.Command("losetup", "-j", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup -j: %v: %s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// mountsBelow lists mount points at or below dir from /proc/self/mountinfo.
func mountsBelow(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			out = append(out, f[4])
		}
	}
	return out
}

// TestChanges runs real changes in a sandbox and reads them back as an
// overlay upper directory: the opaque-directory xattr overlayfs really
// writes in a user namespace, 0/0 whiteouts, shifted owners; the export is
// read-only, idempotent, and leaves no mount or loop device behind.
func TestChanges(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
	ctx := context.Background()
	exp := sb.Inst.(runtime.ChangeExporter)
	if _, err := exp.Changes(ctx); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("Changes of a running sandbox: %v, want ErrConflict", err)
	}
	sb.MustSh(t, `set -e
rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only
rm /etc/hostname /etc/debian_version
mkdir -p /opt/x && echo data > /opt/x/f
chown 1000:1000 /opt/x/f
ln /opt/x/f /opt/x/g`)
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	dir := sb.Inst.(interface{ Dir() string }).Dir()
	img := filepath.Join(dir, "disk.img")
	if l := loopsFor(t, img); l != "" {
		t.Logf("loop devices still bound right after Stop: %s", l)
	}

	ch, err := exp.Changes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ch.OpaqueXattr != native.OpaqueXattr || ch.IDBase != 100000000 {
		t.Fatalf("changes %+v", ch)
	}
	again, err := exp.Changes(ctx)
	if err != nil || again.Dir != ch.Dir {
		t.Fatalf("second Changes: %+v %v", again, err)
	}
	if n := len(mountsBelow(t, dir)); n != 1 {
		t.Fatalf("mounts below the sandbox after two Changes: %v", mountsBelow(t, dir))
	}

	buf := make([]byte, 8)
	n, err := unix.Lgetxattr(filepath.Join(ch.Dir, "etc/apt"), ch.OpaqueXattr, buf)
	if err != nil || string(buf[:n]) != "y" {
		t.Errorf("etc/apt: %s = %q, %v; want y", ch.OpaqueXattr, buf[:n], err)
	}
	if _, err := unix.Lgetxattr(filepath.Join(ch.Dir, "etc/apt"), "trusted.overlay.opaque", buf); err == nil {
		t.Errorf("etc/apt also carries trusted.overlay.opaque")
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(ch.Dir, "etc/hostname"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("etc/hostname whiteout: mode %o rdev %d, %v; want a 0/0 character device", st.Mode, st.Rdev, err)
	}
	if err := unix.Lstat(filepath.Join(ch.Dir, "opt/x/f"), &st); err != nil || st.Uid != ch.IDBase+1000 || st.Gid != ch.IDBase+1000 || st.Nlink != 2 {
		t.Errorf("opt/x/f: uid %d gid %d nlink %d, %v", st.Uid, st.Gid, st.Nlink, err)
	}
	if err := unix.Lstat(filepath.Join(ch.Dir, "opt/x"), &st); err != nil || st.Uid != ch.IDBase {
		t.Errorf("opt/x: uid %d, %v", st.Uid, err)
	}
	if b, err := os.ReadFile(filepath.Join(ch.Dir, "etc/apt/only")); err != nil || string(b) != "new\n" {
		t.Errorf("etc/apt/only: %q %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(ch.Dir, "host-write"), nil, 0o600); !errors.Is(err, unix.EROFS) {
		t.Errorf("writing into the export: %v, want EROFS", err)
	}

	if err := ch.Release(); err != nil {
		t.Fatal(err)
	}
	if err := again.Release(); err != nil {
		t.Fatalf("second Release: %v", err)
	}
	if m := mountsBelow(t, dir); len(m) != 0 {
		t.Fatalf("mounts left after Release: %v", m)
	}
	waitNoLoop(t, img)

	// The sandbox starts again on the same disk with its changes.
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	sb.Connect(t)
	if out := sb.MustSh(t, "cat /opt/x/f; test -e /etc/debian_version || echo gone"); out != "data\ngone\n" {
		t.Fatalf("after restart: %q", out)
	}
	// Start ends an export left open; Destroy cleans one up too.
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := exp.Changes(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if m := mountsBelow(t, filepath.Join(dir, "export")); len(m) != 0 {
		t.Fatalf("export still mounted after Start: %v", m)
	}
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := exp.Changes(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Inst.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if m := mountsBelow(t, dir); len(m) != 0 {
		t.Fatalf("mounts left after Destroy: %v", m)
	}
	waitNoLoop(t, img)
}

// TestChangesOfCreatedSandbox exports a sandbox that never ran: its disk
// is mounted for the sandbox already, and the export shares that mount's
// filesystem instead of mounting the image a second time.
func TestChangesOfCreatedSandbox(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	ctx := context.Background()
	inst, err := rt.Create(ctx, runtime.Spec{ID: "sb-changes-created", RootFS: h.RootFS, TemplateDigest: h.TemplateDigest, Limits: runtimetest.DefaultLimits})
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(ctx)
	dir := inst.(interface{ Dir() string }).Dir()
	ch, err := inst.(runtime.ChangeExporter).Changes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(ch.Dir)
	if err != nil || len(ents) != 0 {
		t.Fatalf("upper of a new sandbox: %v %v", ents, err)
	}
	if err := ch.Release(); err != nil {
		t.Fatal(err)
	}
	if m := mountsBelow(t, dir); len(m) != 1 || m[0] != filepath.Join(dir, "rw") {
		t.Fatalf("mounts after Release: %v, want only rw", m)
	}
	if err := inst.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	waitNoLoop(t, filepath.Join(dir, "disk.img"))
}

// waitNoLoop waits briefly for autoclear to detach img's loop devices.
func waitNoLoop(t *testing.T, img string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		l := loopsFor(t, img)
		if l == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("loop devices of %s left: %s", img, l)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestChangesLeaveOutRuntimeWrites: what the sandbox init writes at every
// start (/etc/hostname, the hostname's line in /etc/hosts) is not part of
// a sandbox's changes; what the sandbox itself wrote to those files is.
func TestChangesLeaveOutRuntimeWrites(t *testing.T) {
	h := harness(t)
	rt := h.New(t)
	sb := runtimetest.Start(t, h, rt, runtimetest.DefaultLimits)
	ctx := context.Background()
	if out := sb.MustSh(t, "cat /etc/hostname; grep -c sandbox-test /etc/hosts"); out != "sandbox-test\n1\n" {
		t.Fatalf("the init did not write its host files: %q", out)
	}
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	exp := sb.Inst.(runtime.ChangeExporter)
	ch, err := exp.Changes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Nothing but (copied-up) directories is left.
	filepath.WalkDir(ch.Dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			t.Error(err)
		} else if !d.IsDir() {
			t.Errorf("%s is in the changes of a sandbox that did nothing", p)
		}
		return nil
	})
	if err := ch.Release(); err != nil {
		t.Fatal(err)
	}

	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	sb.Connect(t)
	sb.MustSh(t, "echo '10.1.2.3 db' >> /etc/hosts; echo mine > /etc/hostname")
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	ch, err = exp.Changes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Release()
	b, err := os.ReadFile(filepath.Join(ch.Dir, "etc/hosts"))
	if err != nil || !strings.HasSuffix(string(b), "10.1.2.3 db\n") || strings.Contains(string(b), "sandbox-test") {
		t.Errorf("etc/hosts in the changes: %q %v; want the sandbox's line without the init's", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(ch.Dir, "etc/hostname")); err != nil || string(b) != "mine\n" {
		t.Errorf("etc/hostname in the changes: %q %v", b, err)
	}
}
