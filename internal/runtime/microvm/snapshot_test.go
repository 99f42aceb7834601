package microvm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
)

// startIncoming starts QEMU for v waiting for a migration stream on state
// (inherited as descriptor 3).
func startIncoming(t *testing.T, v VM, state *os.File) *Process {
	t.Helper()
	v.IncomingFD = 3
	p, err := Launch(v, LaunchOptions{Incoming: state})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func readAll(t *testing.T, c *agentclient.Client, path string) string {
	t.Helper()
	r, err := c.ReadFile(ctxT(t, 20*time.Second), path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestRawSaveRestore is the raw QMP migrate/incoming baseline: a guest
// (initramfs only, the agent is its init) holds a token in tmpfs and a
// second agent process running; its state is saved through SaveState, its
// QEMU killed, and a new QEMU continues from the file: the token and the
// very same process are there. Sizes and times are logged.
func TestRawSaveRestore(t *testing.T) {
	k, initrd := requireBoot(t)
	dir := shortDir(t)
	vm := VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG, CPUs: 1, MemoryMiB: 256,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"),
		QMPSocket: filepath.Join(dir, "qmp.sock")}
	p, err := Start(vm)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	c, _, err := p.WaitHealthy(ctxT(t, 90*time.Second))
	if err != nil {
		t.Fatalf("health: %v", err)
	}
	tokenBytes := make([]byte, 16)
	rand.Read(tokenBytes)
	token := hex.EncodeToString(tokenBytes)
	ctx := ctxT(t, 3*time.Minute)
	if _, err := c.WriteFile(ctx, "/dev/shm/token", 0o600, strings.NewReader(token)); err != nil {
		t.Fatal(err)
	}
	inner, err := c.StartProc(ctx, agentproto.ProcStart{ID: "inner", Cmd: []string{"/init", "--socket", "/dev/shm/inner.sock"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Quiesce(ctx); err != nil {
		t.Fatal(err)
	}
	c.Close()

	q, err := DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	tq := time.Now()
	if ok, err := WaitAgentPortReleased(ctx, q, 5*time.Second); err != nil || !ok {
		t.Fatalf("the quiesced agent did not release its port: %v %v", ok, err)
	}
	t.Logf("agent port released %v after the host's close", time.Since(tq).Round(time.Millisecond))

	// A save whose file QEMU cannot write fails, and the guest runs on.
	ro, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := SaveState(ctx, q, ro); err == nil {
		t.Fatal("a save into a read-only descriptor succeeded")
	} else {
		t.Logf("failed save (expected): %v", err)
	}
	ro.Close()
	if st, err := q.Status(ctx); err != nil || st != "running" {
		t.Fatalf("after a failed save the guest is %q (%v), want running", st, err)
	}

	statePath := filepath.Join(dir, "vm.state")
	f, err := os.OpenFile(statePath, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	info, err := SaveState(ctx, q, f)
	if err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	f.Close()
	t.Logf("raw save: %.1f MiB in %v (pause %v, migrate %v, fsync %v) of a %d MiB guest",
		float64(info.Bytes)/(1<<20), time.Since(t0).Round(time.Millisecond), info.Pause.Round(time.Microsecond),
		info.Migrate.Round(time.Millisecond), info.Sync.Round(time.Millisecond), vm.MemoryMiB)
	if st, err := q.Status(ctx); err != nil || st != "postmigrate" {
		t.Fatalf("after the save the guest is %q (%v), want postmigrate", st, err)
	}
	q.Close()
	p.Kill()

	state, err := os.Open(statePath)
	if err != nil {
		t.Fatal(err)
	}
	defer state.Close()
	t1 := time.Now()
	p2 := startIncoming(t, vm, state)
	defer p2.Kill()
	q2, err := DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q2.Close()
	if err := WaitIncoming(ctx, q2, p2.Done()); err != nil {
		t.Fatalf("WaitIncoming: %v\n%s", err, p2.ConsoleTail(2048))
	}
	tLoaded := time.Since(t1)
	c2, h, err := p2.WaitHealthy(ctx)
	if err != nil {
		t.Fatalf("restored agent: %v", err)
	}
	defer c2.Close()
	t.Logf("raw restore: QEMU start→running %v, →agent health %v", tLoaded.Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
	if h.Pid != 1 {
		t.Errorf("restored agent pid %d", h.Pid)
	}
	if time.Since(t1) > 20*time.Second {
		t.Errorf("the restored agent took %v to answer (a stale session?)", time.Since(t1))
	}
	if got := readAll(t, c2, "/dev/shm/token"); got != token {
		t.Fatalf("tmpfs token after restore = %q, want %q", got, token)
	}
	pi, err := c2.Proc(ctx, "inner")
	if err != nil || !pi.Running || pi.Pid != inner.Pid {
		t.Fatalf("inner process after restore: %+v %v (was pid %d)", pi, err, inner.Pid)
	}
	// The guest goes on: a new process runs.
	if _, err := c2.StartProc(ctx, agentproto.ProcStart{ID: "after", Cmd: []string{"/init", "--socket", "/dev/shm/after.sock"}}); err != nil {
		t.Fatal(err)
	}
}

// TestRestoreOfBrokenState: a QEMU given a stream it cannot load ends, and
// WaitIncoming says so instead of waiting for its deadline.
func TestRestoreOfBrokenState(t *testing.T) {
	k, initrd := requireBoot(t)
	dir := shortDir(t)
	vm := VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG, CPUs: 1, MemoryMiB: 256,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"),
		QMPSocket: filepath.Join(dir, "qmp.sock")}
	bad := filepath.Join(dir, "bad.state")
	if err := os.WriteFile(bad, []byte("QEVM\x00\x00\x00\x03 not a migration stream"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := startIncoming(t, vm, f)
	defer p.Kill()
	ctx := ctxT(t, time.Minute)
	q, err := DialQMP(ctx, vm.QMPSocket)
	if err == nil {
		defer q.Close()
		err = WaitIncoming(ctx, q, p.Done())
	}
	if err == nil {
		t.Fatal("a broken state restored")
	}
	if ctx.Err() != nil {
		t.Fatalf("ran into the deadline: %v", err)
	}
	<-p.Done()
	t.Logf("broken state: %v; QEMU: %v", err, p.Err())
}

// TestCopySparse: holes stay holes, data is copied, and the destination
// must not exist.
func TestCopySparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	chunks := map[int64][]byte{0: []byte("head"), 10 << 20: bytes.Repeat([]byte("x"), 300<<10), size - 4: []byte("tail")}
	for off, b := range chunks {
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	dst := filepath.Join(dir, "dst")
	if err := CopySparse(src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(a, b) {
		t.Fatalf("copy differs (%v)", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(dst, &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; used > 4<<20 {
		t.Errorf("copy of a sparse %d MiB file uses %d bytes", size>>20, used)
	}
	if fi, _ := os.Stat(dst); fi.Mode().Perm() != 0o600 {
		t.Errorf("copy mode %v", fi.Mode())
	}
	if err := CopySparse(src, dst); err == nil {
		t.Fatal("copy over an existing file succeeded")
	}
	if err := CopySparse(filepath.Join(dir, "none"), filepath.Join(dir, "x")); err == nil {
		t.Fatal("copy of a missing file succeeded")
	}
	if _, err := os.Stat(filepath.Join(dir, "x")); !os.IsNotExist(err) {
		t.Fatal("failed copy left its destination")
	}
}
