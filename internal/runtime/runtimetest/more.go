package runtimetest

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/confine"
)

// ptySession drives an attached TTY process.
type ptySession struct {
	t      *testing.T
	conn   *websocket.Conn
	frames *agentclient.FrameReader
	out    bytes.Buffer
	exit   *api.ExitStatus
}

func (p *ptySession) send(typ byte, payload []byte) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.conn.Write(ctx, websocket.MessageBinary, append([]byte{typ}, payload...)); err != nil {
		p.t.Fatalf("attach write: %v", err)
	}
}

// expect reads frames until the accumulated stdout contains want.
func (p *ptySession) expect(want string) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for !strings.Contains(p.out.String(), want) {
		f, _, err := p.frames.Next(ctx)
		if err != nil {
			p.t.Fatalf("waiting for %q in PTY output %q: %v", want, p.out.String(), err)
		}
		switch f.Type {
		case api.FrameStdout, api.FrameStderr:
			p.out.Write(f.Data)
		case api.FrameExit:
			es := f.Exit
			p.exit = &es
			if !strings.Contains(p.out.String(), want) {
				p.t.Fatalf("process exited (%+v) before %q appeared in %q", es, want, p.out.String())
			}
		}
	}
}

func testPTY(t *testing.T, h Harness) {
	sb := Start(t, h, nil, DefaultLimits)
	ctx := ctxFor(t, time.Minute)
	if _, err := sb.Client.StartProc(ctx, agentproto.ProcStart{
		ID: "pty1", Cmd: []string{"/bin/sh"}, Env: append([]string{"TERM=dumb", "PS1=$ "}, defaultEnv...),
		TTY: true, Rows: 24, Cols: 80,
	}); err != nil {
		t.Fatalf("StartProc: %v", err)
	}
	conn, err := sb.Client.Attach(ctx, "pty1", 0, 0)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	defer conn.CloseNow()
	p := &ptySession{t: t, conn: conn, frames: agentclient.Frames(conn)}
	p.send(api.FrameStdin, []byte("tty; echo SIZE=$(stty size)\n"))
	p.expect("SIZE=24 80")
	if !strings.Contains(p.out.String(), "/dev/pts/") {
		t.Fatalf("tty did not print a /dev/pts path: %q", p.out.String())
	}
	resize, _ := json.Marshal(api.Resize{Rows: 50, Cols: 132})
	p.send(api.FrameResize, resize)
	// The resize is asynchronous to the shell: ask until it shows.
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.out.Reset()
		// The terminal echoes the command line, so the marker's two halves
		// only meet in the command's output.
		p.send(api.FrameStdin, []byte("echo NOW=$(stty size)=EN''D\n"))
		p.expect("=END")
		if strings.Contains(p.out.String(), "NOW=50 132=END") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("resize to 50x132 not visible: %q", p.out.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	p.send(api.FrameStdin, []byte("exit 5\n"))
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for p.exit == nil {
		f, _, err := p.frames.Next(rctx)
		if err != nil {
			t.Fatalf("waiting for exit frame: %v", err)
		}
		if f.Type == api.FrameExit {
			p.exit = &f.Exit
		}
	}
	if p.exit.ExitCode != 5 {
		t.Fatalf("exit status %+v, want 5", p.exit)
	}
}

// hostSecret creates a file on the host that no sandbox may ever read.
func hostSecret(t *testing.T) (path, content string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "space-host-secret-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	content = "host-secret-" + newID()
	path = filepath.Join(dir, "secret")
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	return path, content
}

func readFile(ctx context.Context, c *agentclient.Client, path string) (string, error) {
	rc, err := c.ReadFile(ctx, path)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	return string(b), err
}

func testFiles(t *testing.T, h Harness) {
	sb := Start(t, h, nil, DefaultLimits)
	ctx := ctxFor(t, time.Minute)
	c := sb.Client

	fi, err := c.WriteFile(ctx, "/tmp/a.txt", 0o640, strings.NewReader("hello files"))
	if err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	if fi.Size != 11 || fi.Mode&0o777 != 0o640 {
		t.Fatalf("WriteFile info: %+v", fi)
	}
	if got, err := readFile(ctx, c, "/tmp/a.txt"); err != nil || got != "hello files" {
		t.Fatalf("ReadFile: %q, %v", got, err)
	}
	if out := sb.MustSh(t, "cat /tmp/a.txt; stat -c %a /tmp/a.txt"); out != "hello files640\n" {
		t.Fatalf("file seen from inside: %q", out)
	}
	if _, err := c.Mkdir(ctx, "/tmp/d/e", 0o755); err != nil {
		t.Fatalf("Mkdir: %v", err)
	}
	if err := c.Rename(ctx, "/tmp/a.txt", "/tmp/d/e/b.txt"); err != nil {
		t.Fatalf("Rename: %v", err)
	}
	if ents, err := c.List(ctx, "/tmp/d/e"); err != nil || len(ents) != 1 || ents[0].Name != "b.txt" {
		t.Fatalf("List: %+v, %v", ents, err)
	}
	if err := c.Remove(ctx, "/tmp/d", true); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if _, err := c.Stat(ctx, "/tmp/d"); err == nil {
		t.Fatal("Stat after recursive Remove succeeded")
	}

	// Confinement: a symlink made inside to a host path resolves inside.
	secretPath, secret := hostSecret(t)
	sandboxShadow := sb.MustSh(t, "cat /etc/shadow")
	sb.MustSh(t, "ln -s /etc/shadow /tmp/shadow-link && ln -s "+secretPath+" /tmp/secret-link && ln -s / /tmp/root-link")
	got, err := readFile(ctx, c, "/tmp/shadow-link")
	if err != nil || got != sandboxShadow {
		t.Fatalf("symlink to /etc/shadow read %d bytes (%v), want the sandbox's own %d bytes", len(got), err, len(sandboxShadow))
	}
	for _, p := range []string{"/tmp/secret-link", "/tmp/root-link" + secretPath, "/../../../.." + secretPath, "../../../../.." + secretPath, "/tmp/../../.." + secretPath} {
		got, err := readFile(ctx, c, p)
		if strings.Contains(got, secret) {
			t.Fatalf("ReadFile(%q) read the host's secret", p)
		}
		if err == nil {
			t.Fatalf("ReadFile(%q) succeeded (%q): the path does not exist inside", p, got)
		}
	}
	// Writes through ../ and symlinks stay inside too.
	escape := filepath.Join(filepath.Dir(secretPath), "written")
	for _, p := range []string{"/../../../.." + escape, "/tmp/root-link" + escape} {
		c.WriteFile(ctx, p, 0o644, strings.NewReader("x"))
		if _, err := os.Stat(escape); err == nil {
			t.Fatalf("WriteFile(%q) created a file on the host", p)
		}
	}
	// Tar with ../ entries and a symlink-then-write must not leave the sandbox.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hostTar := filepath.Join(filepath.Dir(secretPath), "from-tar")
	tw.WriteHeader(&tar.Header{Name: "../../../../../.." + hostTar, Mode: 0o644, Size: 1, Typeflag: tar.TypeReg})
	tw.Write([]byte("x"))
	tw.WriteHeader(&tar.Header{Name: "evil", Linkname: "/", Typeflag: tar.TypeSymlink})
	tw.WriteHeader(&tar.Header{Name: "evil" + hostTar + "2", Mode: 0o644, Size: 1, Typeflag: tar.TypeReg})
	tw.Write([]byte("y"))
	tw.WriteHeader(&tar.Header{Name: "ok.txt", Mode: 0o644, Size: 2, Typeflag: tar.TypeReg})
	tw.Write([]byte("ok"))
	tw.Close()
	c.Mkdir(ctx, "/tmp/tarput", 0o755)
	_ = c.TarPut(ctx, "/tmp/tarput", &buf)
	for _, p := range []string{hostTar, hostTar + "2"} {
		if _, err := os.Stat(p); err == nil {
			t.Fatalf("TarPut wrote %s on the host", p)
		}
	}
	// Round trip of a directory through tar.
	sb.MustSh(t, "mkdir -p /tmp/tg/sub && echo one > /tmp/tg/sub/one")
	rc, err := c.TarGet(ctx, "/tmp/tg")
	if err != nil {
		t.Fatalf("TarGet: %v", err)
	}
	data, _ := io.ReadAll(rc)
	rc.Close()
	if err := c.TarPut(ctx, "/tmp/tg2", bytes.NewReader(data)); err != nil {
		t.Fatalf("TarPut of TarGet output: %v", err)
	}
	if out := sb.MustSh(t, "cat $(find /tmp/tg2 -name one)"); out != "one\n" {
		t.Fatalf("tar round trip: %q", out)
	}
}

func testLimits(t *testing.T, h Harness) {
	limits := api.Limits{CPUs: 1, MemoryMiB: 128, Pids: 64, DiskMiB: 64}
	sb := Start(t, h, nil, limits)
	ctx := ctxFor(t, 3*time.Minute)

	t.Run("memory", func(t *testing.T) {
		before, err := sb.Inst.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		res := sb.Exec(t, "python3", "-c", "b = []\nwhile True: b.append(bytearray(16 << 20))")
		if res.Signal != "KILL" && res.ExitCode != 137 {
			t.Fatalf("allocating past the limit: %+v, want SIGKILL", res)
		}
		after, err := sb.Inst.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if after.OOMKills <= before.OOMKills {
			t.Fatalf("OOMKills %d → %d, want an increment", before.OOMKills, after.OOMKills)
		}
		// The counter alone, where the instance offers it (the manager
		// reads it around every exec), is the one Stats reports.
		if oc, ok := sb.Inst.(runtime.OOMCounter); ok {
			n, err := oc.OOMKills()
			if err != nil {
				t.Fatalf("OOMKills: %v", err)
			}
			if n != after.OOMKills {
				t.Fatalf("OOMKills() = %d, Stats().OOMKills = %d", n, after.OOMKills)
			}
		}
		if after.MemoryBytes > limits.MemoryMiB<<20 {
			t.Fatalf("memory usage %d above the limit", after.MemoryBytes)
		}
		if out := sb.MustSh(t, "echo survived"); out != "survived\n" {
			t.Fatal("sandbox unusable after an OOM kill")
		}
		t.Logf("OOM kill: %+v, stats %+v", res, after)
	})

	t.Run("pids", func(t *testing.T) {
		script := "import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('bounded', n, e.errno)\n"
		res := sb.Exec(t, "python3", "-c", script)
		if !strings.HasPrefix(res.Stdout, "bounded ") {
			t.Fatalf("fork bomb not bounded: %+v", res)
		}
		n, _ := strconv.Atoi(strings.Fields(res.Stdout)[1])
		if n >= int(limits.Pids) {
			t.Fatalf("forked %d processes under a limit of %d", n, limits.Pids)
		}
		st, err := sb.Inst.Stats(ctx)
		if err != nil || st.Pids > limits.Pids {
			t.Fatalf("Stats pids %d (limit %d), %v", st.Pids, limits.Pids, err)
		}
		// The bomb's children exit on their own; the sandbox then works.
		deadline := time.Now().Add(30 * time.Second)
		for {
			st, _ := sb.Inst.Stats(ctx)
			res, err := sb.Client.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"/bin/echo", "ok"}, Env: defaultEnv, TimeoutSeconds: 10})
			if err == nil && res.Stdout == "ok\n" && st.Pids < limits.Pids/2 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("sandbox did not recover from the fork bomb: %+v %v", res, err)
			}
			time.Sleep(500 * time.Millisecond)
		}
	})

	t.Run("disk", func(t *testing.T) {
		res := sb.Sh(t, "dd if=/dev/zero of=/root/big bs=1M count=200 2>&1; echo rc=$?")
		if !strings.Contains(res.Stdout, "No space left on device") || strings.Contains(res.Stdout, "rc=0") {
			t.Fatalf("writing past DiskMiB: %+v", res)
		}
		sb.MustSh(t, "rm -f /root/big")
		if out := sb.MustSh(t, "echo fits > /root/small && cat /root/small"); out != "fits\n" {
			t.Fatal("disk unusable after ENOSPC")
		}
	})
}

// probeScript reports, one "name errno" line each, what privileged
// operations return inside the sandbox (x86_64 syscall numbers).
const probeScript = `
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    r = libc.syscall(nr, *args)
    print(name, 0 if r >= 0 else ctypes.get_errno())
call("mount", 165, b"none", b"/mnt", b"tmpfs", 0, None)
call("unshare_user", 272, 0x10000000)
call("unshare_ns", 272, 0x00020000)
call("keyctl", 250, 0, 0, 0, 0, 0)
call("add_key", 248, b"user", b"k", b"v", 1, ctypes.c_int(-3))
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("ptrace", 101, 16, 1, 0, 0)
call("setns", 308, 0, 0)
call("kexec_load", 246, 0, 0, 0, 0)
call("init_module", 175, 0, 0, 0)
call("userfaultfd", 323, 0)
call("io_uring_setup", 425, 1, 0)
call("pivot_root", 155, b"/", b"/")
call("open_by_handle_at", 304, 0, 0, 0)
for fam, name in ((17, "af_packet"), (40, "af_vsock")):
    try:
        socket.socket(fam, socket.SOCK_RAW if fam == 17 else socket.SOCK_STREAM, 0); print(name, 0)
    except OSError as e:
        print(name, e.errno)
`

func testIsolation(t *testing.T, h Harness) {
	sb := Start(t, h, nil, DefaultLimits)
	ctx := ctxFor(t, 2*time.Minute)

	t.Run("processes", func(t *testing.T) {
		out := sb.MustSh(t, "ps -e --no-headers | wc -l")
		if n, _ := strconv.Atoi(strings.TrimSpace(out)); n == 0 || n > 8 {
			t.Fatalf("ps sees %d processes: host processes visible?\n%s", n, sb.MustSh(t, "ps -ef"))
		}
	})
	t.Run("network", func(t *testing.T) {
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
				c.Write([]byte("host"))
				c.Close()
			}
		}()
		port := ln.Addr().(*net.TCPAddr).Port
		script := fmt.Sprintf(`
import socket
print(sorted(n for _, n in socket.if_nameindex()))
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("127.0.0.1", %d)); print("connected", s.recv(4))
except OSError as e:
    print("refused", e.errno)
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(1)
c = socket.create_connection(l.getsockname(), timeout=3); print("loopback ok")
`, port)
		res := sb.Exec(t, "python3", "-c", script)
		// Loopback, and the NIC where the runtime gives one (its far end
		// is the gateway, not attached here).
		links := "['lo']"
		if _, ok := sb.Inst.(runtime.NICProvider); ok {
			links = "['eth0', 'lo']"
		}
		if !contains(res.Stdout, links, "refused", "loopback ok") {
			t.Fatalf("network from inside: %+v", res)
		}
		res = sb.Exec(t, "curl", "-sS", "-m", "3", "http://1.1.1.1/")
		if res.ExitCode == 0 {
			t.Fatalf("curl to the internet succeeded: %+v", res)
		}
	})
	t.Run("hostname", func(t *testing.T) {
		if out := sb.MustSh(t, "hostname"); out != sb.Spec.Hostname+"\n" {
			t.Fatalf("hostname %q, want %q", out, sb.Spec.Hostname)
		}
		if res := sb.Exec(t, "python3", "-c", "import socket; socket.gethostbyname(socket.gethostname())"); res.ExitCode != 0 {
			t.Fatalf("own hostname does not resolve: %+v", res)
		}
	})
	t.Run("privileged-syscalls", func(t *testing.T) {
		res := sb.Exec(t, "python3", "-c", probeScript)
		if res.ExitCode != 0 {
			t.Fatalf("probe script: %+v", res)
		}
		for _, line := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
			f := strings.Fields(line)
			if len(f) != 2 {
				t.Fatalf("probe line %q", line)
			}
			if f[1] == "0" {
				t.Errorf("%s succeeded inside the sandbox", f[0])
			}
			if f[0] == "mount" || f[0] == "unshare_user" || f[0] == "keyctl" || f[0] == "bpf" {
				if f[1] != "1" {
					t.Errorf("%s failed with errno %s, want EPERM (1)", f[0], f[1])
				}
			}
		}
		t.Logf("privileged syscalls (errno): %s", strings.ReplaceAll(strings.TrimSpace(res.Stdout), "\n", ", "))
		for _, cmd := range []string{"mount -t tmpfs none /mnt", "unshare -U true", "unshare -m true"} {
			if res := sb.Sh(t, cmd); res.ExitCode == 0 {
				t.Errorf("%q succeeded inside the sandbox", cmd)
			}
		}
	})
	t.Run("capabilities", func(t *testing.T) {
		out := sb.MustSh(t, "grep -E '^Cap(Eff|Prm|Bnd|Amb|Inh)' /proc/self/status")
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			v, err := strconv.ParseUint(f[1], 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			// At most the set the policy keeps (package confine).
			if extra := v &^ confine.CapabilityMask(); extra != 0 {
				t.Errorf("%s %s holds capabilities beyond the kept set (%#x)", f[0], f[1], extra)
			}
		}
		t.Logf("%s", strings.ReplaceAll(strings.TrimSpace(out), "\n", "; "))
		// Even the capabilities it holds are confined to its user namespace.
		if m := sb.MustSh(t, "cat /proc/self/uid_map"); strings.Fields(m)[1] == "0" {
			t.Errorf("sandbox root is host root: uid_map %q", m)
		}
	})
	t.Run("proc-sys-masks", func(t *testing.T) {
		// The policy's masked paths (package confine). Each is absent on
		// some kernels; where present a file must read empty and a
		// directory must list nothing.
		for _, p := range confine.MaskedPaths {
			probe := "{ if [ -d " + p + " ]; then ls -A " + p + "; else head -c 64 " + p + "; fi; } 2>/dev/null | wc -c"
			if out := sb.Sh(t, probe).Stdout; out != "0\n" {
				t.Errorf("%s is readable (%s bytes)", p, strings.TrimSpace(out))
			}
		}
		// Never write to it: unmasked and writable, it would act on the host.
		if sb.Sh(t, "! test -e /proc/sysrq-trigger || test -c /proc/sysrq-trigger").ExitCode != 0 {
			t.Error("/proc/sysrq-trigger is present and not masked")
		}
		if res := sb.Sh(t, "echo 1 > /proc/sys/kernel/sysrq"); res.ExitCode == 0 {
			t.Error("/proc/sys is writable")
		}
		if res := sb.Sh(t, "touch /sys/space-probe"); res.ExitCode == 0 {
			t.Error("/sys is writable")
		}
	})
	t.Run("host-paths", func(t *testing.T) {
		secretPath, _ := hostSecret(t)
		for _, p := range []string{"/work", "/root/.ssh", secretPath, "/var/cache/space"} {
			if res := sb.Sh(t, "test -e "+p); res.ExitCode == 0 {
				if _, err := os.Stat(p); err == nil {
					t.Errorf("host path %s is visible inside", p)
				}
			}
		}
	})
	t.Run("host-uid", func(t *testing.T) {
		hp, ok := sb.Inst.(HostPider)
		if !ok {
			t.Skip("instance has no host process")
		}
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", hp.Pid()))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(line, "Uid:") || strings.HasPrefix(line, "Gid:") {
				for _, id := range strings.Fields(line)[1:] {
					if id == "0" {
						t.Fatalf("sandbox init runs as host root: %s", line)
					}
				}
				t.Logf("host view of the sandbox init: %s", line)
			}
		}
	})
	_ = ctx
}

func testPause(t *testing.T, h Harness) {
	sb := Start(t, h, nil, DefaultLimits)
	ctx := ctxFor(t, 2*time.Minute)
	p, ok := sb.Inst.(interface {
		Pause(context.Context) error
		Resume(context.Context) error
	})
	if !ok {
		t.Skip("runtime does not implement runtime.Pauser")
	}
	if _, err := sb.Client.StartProc(ctx, agentproto.ProcStart{
		ID: "counter", Env: defaultEnv,
		Cmd: []string{"/bin/sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.tmp; mv /tmp/counter.tmp /tmp/counter; sleep 0.05; done"},
	}); err != nil {
		t.Fatal(err)
	}
	read := func() int {
		t.Helper()
		for i := 0; i < 50; i++ {
			out := sb.Sh(t, "cat /tmp/counter 2>/dev/null").Stdout
			if n, err := strconv.Atoi(strings.TrimSpace(out)); err == nil {
				return n
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatal("counter never appeared")
		return 0
	}
	read()
	time.Sleep(300 * time.Millisecond)
	c1 := read()
	if err := p.Pause(ctx); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if !sb.Inst.Alive() {
		t.Fatal("paused sandbox is not Alive")
	}
	time.Sleep(1500 * time.Millisecond)
	if err := p.Resume(ctx); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	c2 := read()
	// Unpaused, 1.5 s would add ~30; a few ticks happen around the calls.
	if c2-c1 > 12 {
		t.Fatalf("counter advanced %d → %d across a 1.5 s pause", c1, c2)
	}
	time.Sleep(500 * time.Millisecond)
	if c3 := read(); c3 <= c2 {
		t.Fatalf("counter stuck at %d after Resume", c3)
	}
	// A paused sandbox can be stopped (and started again).
	if err := p.Pause(ctx); err != nil {
		t.Fatalf("second Pause: %v", err)
	}
	t0 := time.Now()
	if err := sb.Inst.Stop(ctx); err != nil {
		t.Fatalf("Stop of a paused sandbox: %v", err)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Fatalf("Stop of a paused sandbox took %v", d)
	}
	if err := sb.Inst.Start(ctx); err != nil {
		t.Fatalf("Start after stopping a paused sandbox: %v", err)
	}
	sb.Connect(t)
	sb.MustSh(t, "true")
}
