package microvm

import (
	"context"
	"crypto/rand"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/microvm/vmctl"
	"github.com/spacehq/space/internal/testenv"
)

var guestEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"}

// guest is one booted sandbox guest for the tests below.
type guest struct {
	t    *testing.T
	p    *Process
	c    *agentclient.Client
	ctl  *vmctl.Client
	disk string
}

func (g *guest) exec(cmd ...string) api.ExecResult {
	g.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	res, err := g.c.Exec(ctx, agentproto.ExecRequest{Cmd: cmd, Env: guestEnv, TimeoutSeconds: 80})
	if err != nil {
		g.t.Fatalf("exec %q: %v\nconsole:\n%s", cmd, err, g.p.ConsoleTail(2048))
	}
	return res
}

func (g *guest) sh(script string) api.ExecResult {
	g.t.Helper()
	return g.exec("/bin/sh", "-c", script)
}

// mustSh runs script and returns its stdout, failing on a non-zero exit.
func (g *guest) mustSh(script string) string {
	g.t.Helper()
	res := g.sh(script)
	if res.ExitCode != 0 {
		g.t.Fatalf("%q: %+v", script, res)
	}
	return res.Stdout
}

func (g *guest) stats() vmctl.Stats {
	g.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := g.ctl.Stats(ctx)
	if err != nil {
		g.t.Fatalf("vmctl stats: %v", err)
	}
	return s
}

// bootGuest boots a sandbox guest on img and disk and returns it once its
// agent and its control port answer. Its QEMU is killed at the test's end.
func bootGuest(t *testing.T, k Kernel, initrd, img, disk, hostname string) *guest {
	t.Helper()
	dir := shortDir(t)
	vm := VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: AccelTCG, CPUs: 1, MemoryMiB: 384,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"),
		CtlSocket: filepath.Join(dir, "ctl.sock"), RootImage: img, Disk: disk,
		Hostname: hostname, SandboxMemoryMiB: 128, Pids: 64}
	start := time.Now()
	p, err := Start(vm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	c, h, err := p.WaitHealthy(ctx)
	if err != nil {
		t.Fatalf("health: %v\nconsole:\n%s", err, p.ConsoleTail(4096))
	}
	t.Cleanup(func() { c.Close() })
	t.Logf("boot→health %v under TCG with a root image (agent pid %d)", time.Since(start).Round(time.Millisecond), h.Pid)
	for _, line := range strings.Split(p.ConsoleTail(8192), "\n") {
		if strings.Contains(line, "vm init:") {
			t.Log(strings.TrimSpace(line))
		}
	}
	if h.Pid != 1 {
		t.Errorf("agent pid %d in its namespace, want 1", h.Pid)
	}
	conn, err := net.Dial("unix", vm.CtlSocket)
	if err != nil {
		t.Fatal(err)
	}
	ctl := vmctl.NewClient(conn)
	t.Cleanup(func() { ctl.Close() })
	if err := ctl.Ping(ctx); err != nil {
		t.Fatalf("vmctl ping: %v", err)
	}
	return &guest{t: t, p: p, c: c, ctl: ctl, disk: disk}
}

// TestGuestSandbox boots the base template as a sandbox guest — shifted
// erofs root image, ext4 disk, overlay root, the agent confined in its
// namespaces and cgroup — and checks from inside and through the control
// port what PID 1 built.
func TestGuestSandbox(t *testing.T) {
	testenv.RequireRoot(t)
	requireMkfsErofs(t)
	k, initrd := requireBoot(t)
	base := testenv.BaseRootfs(t)
	ctx := context.Background()

	im := &Images{Dir: t.TempDir(), AgentBinary: testenv.AgentBinary(t)}
	img, err := im.Prepare(ctx, "sha256:guest-test-base", base)
	if err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(t.TempDir(), "disk.img")
	if err := hostfs.FormatExt4(ctx, disk, 256, confine.IDBase); err != nil {
		t.Fatal(err)
	}
	const hostname = "guest-test"
	g := bootGuest(t, k, initrd, img, disk, hostname)
	p, ctl := g.p, g.ctl
	t.Run("identity", func(t *testing.T) {
		g.t = t
		if out := g.mustSh("hostname; cat /etc/hostname; getent hosts " + hostname); !strings.HasPrefix(out, hostname+"\n"+hostname+"\n127.0.1.1") {
			t.Errorf("hostname, /etc/hostname, hosts entry: %q", out)
		}
		if out := g.mustSh("stat -f -c %T /tmp; stat -c %a:%u /tmp"); out != "tmpfs\n1777:0\n" {
			t.Errorf("/tmp: %q, want a tmpfs owned by root, 1777", out)
		}
		if out := g.mustSh("id -u; stat -c %u /etc/passwd; stat -c %u:%g /"); out != "0\n0\n0:0\n" {
			t.Errorf("id -u / owner of /etc/passwd / owner of /: %q, want root's", out)
		}
		m := strings.Fields(g.mustSh("cat /proc/self/uid_map"))
		if len(m) != 3 || m[0] != "0" || m[1] != strconv.Itoa(confine.IDBase) || m[2] != strconv.Itoa(confine.IDSize) {
			t.Errorf("uid_map %q, want 0 %d %d", m, confine.IDBase, confine.IDSize)
		}
		if out := g.mustSh("ps -e --no-headers | wc -l"); func() int { n, _ := strconv.Atoi(strings.TrimSpace(out)); return n }() > 6 {
			t.Errorf("ps sees %s processes:\n%s", out, g.mustSh("ps -ef"))
		}
		if out := g.mustSh("test -x /run/space/space-agent && ! touch /run/space/space-agent 2>/dev/null && ! touch /run/space/x 2>/dev/null && echo ro"); out != "ro\n" {
			t.Errorf("agent binary: %q", out)
		}
	})

	t.Run("confinement", func(t *testing.T) {
		g.t = t
		res := g.exec("python3", "-c", probeSyscalls)
		if res.ExitCode != 0 {
			t.Fatalf("probe: %+v", res)
		}
		for _, line := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
			f := strings.Fields(line)
			if len(f) != 2 || f[1] == "0" {
				t.Errorf("%q: succeeded inside the sandbox", line)
				continue
			}
			switch f[0] {
			case "mount", "unshare_user", "keyctl", "bpf", "add_key", "sethostname", "init_module":
				if f[1] != "1" {
					t.Errorf("%s: errno %s, want EPERM", f[0], f[1])
				}
			}
		}
		t.Logf("privileged syscalls (errno): %s", strings.ReplaceAll(strings.TrimSpace(res.Stdout), "\n", ", "))
		for _, cmd := range []string{"mount -t tmpfs none /mnt", "unshare -U true", "unshare -m true"} {
			// mount(8) says "permission denied" for EPERM.
			if res := g.sh(cmd + " 2>&1"); res.ExitCode == 0 || !strings.Contains(res.Stdout, "not permitted") && !strings.Contains(res.Stdout, "permission denied") {
				t.Errorf("%q: %+v, want EPERM", cmd, res)
			}
		}
		out := g.mustSh("grep -E '^Cap(Eff|Prm|Bnd|Amb|Inh)' /proc/self/status")
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			v, err := strconv.ParseUint(f[1], 16, 64)
			if err != nil || v&^confine.CapabilityMask() != 0 {
				t.Errorf("%s holds capabilities beyond the kept set", line)
			}
		}
		for _, p := range confine.MaskedPaths {
			probe := "{ if [ -d " + p + " ]; then ls -A " + p + "; else head -c 64 " + p + "; fi; } 2>/dev/null | wc -c"
			if out := g.sh(probe).Stdout; out != "0\n" {
				t.Errorf("%s is readable (%s bytes)", p, strings.TrimSpace(out))
			}
		}
		if g.sh("test -c /proc/sysrq-trigger").ExitCode != 0 {
			t.Error("/proc/sysrq-trigger is not masked")
		}
		for _, cmd := range []string{"echo 1 > /proc/sys/kernel/sysrq", "touch /sys/space-probe",
			"echo 1 > /sys/fs/cgroup/sandbox/pids.max", "echo $$ > /sys/fs/cgroup/cgroup.procs", "echo 1 > /proc/sysrq-trigger && grep -q . /proc/sysrq-trigger"} {
			if res := g.sh(cmd); res.ExitCode == 0 {
				t.Errorf("%q succeeded inside the sandbox", cmd)
			}
		}
		// Only loopback, and it works; the guest kernel keeps its log and
		// addresses to itself.
		res = g.exec("python3", "-c", `
import socket
print(sorted(n for _, n in socket.if_nameindex()))
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(1)
c = socket.create_connection(l.getsockname(), timeout=3); print("loopback ok")
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("10.0.2.2", 22)); print("connected")
except OSError as e:
    print("unreachable", e.errno)
`)
		if res.Stdout != "['lo']\nloopback ok\nunreachable 101\n" {
			t.Errorf("network from inside: %+v", res)
		}
		if res := g.sh("dmesg"); res.ExitCode == 0 {
			t.Errorf("dmesg works inside: %q", res.Stdout)
		}
		if out := g.mustSh("awk '$1 != \"0000000000000000\"' /proc/kallsyms | head -3"); out != "" {
			t.Errorf("kernel addresses visible: %q", out)
		}
		// Of the guest's device nodes the sandbox opens only the harmless
		// ones (devtmpfs has them all; the rest belong to guest root).
		res = g.exec("python3", "-c", `
import os, stat
for root, dirs, files in os.walk("/dev"):
    for f in files:
        p = os.path.join(root, f)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            continue
        for flag, how in ((os.O_RDONLY, "r"), (os.O_WRONLY, "w")):
            try:
                fd = os.open(p, flag | os.O_NONBLOCK | os.O_NOCTTY)
            except OSError:
                continue
            # A node the agent covered (its channel port) opens as
            # /dev/null: judge by what the descriptor is, not its name.
            rdev = os.fstat(fd).st_rdev
            os.close(fd)
            if p != "/dev/null" and (os.major(rdev), os.minor(rdev)) == (1, 3):
                continue
            print(p, how)
`)
		allowed := map[string]bool{"/dev/null": true, "/dev/zero": true, "/dev/full": true, "/dev/random": true,
			"/dev/urandom": true, "/dev/tty": true, "/dev/pts/ptmx": true}
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, "/dev/null w\n") {
			t.Fatalf("device walk: %+v", res)
		}
		for _, line := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
			if f := strings.Fields(line); len(f) == 2 && !allowed[f[0]] {
				t.Errorf("device %s opens for %s inside the sandbox", f[0], f[1])
			}
		}
		// The control port is guest root's: not the sandbox's to open.
		res = g.exec("python3", "-c", `
import os, glob
for d in sorted(glob.glob("/sys/class/virtio-ports/*")):
    name = open(d + "/name").read().strip()
    try:
        os.close(os.open("/dev/" + os.path.basename(d), os.O_RDWR | os.O_NONBLOCK)); print(name, "opened")
    except OSError as e:
        print(name, "refused", e.errno)
`)
		if !strings.Contains(res.Stdout, vmctl.PortName+" refused 13") {
			t.Errorf("opening the control port from inside: %+v, want EACCES", res)
		}
		t.Logf("ports from inside: %s", strings.ReplaceAll(strings.TrimSpace(res.Stdout), "\n", ", "))
	})

	t.Run("memory", func(t *testing.T) {
		g.t = t
		before := g.stats()
		res := g.exec("python3", "-c", "b = []\nwhile True: b.append(bytearray(16 << 20))")
		if res.Signal != "KILL" && res.ExitCode != 137 {
			t.Fatalf("allocating past 128 MiB: %+v, want SIGKILL", res)
		}
		after := g.stats()
		if after.OOMKills <= before.OOMKills || after.MemoryBytes > 128<<20 || after.MemoryBytes <= 0 {
			t.Errorf("stats %+v → %+v: want one more OOM kill and memory within 128 MiB", before, after)
		}
		if out := g.mustSh("echo survived"); out != "survived\n" {
			t.Error("sandbox unusable after an OOM kill")
		}
		t.Logf("OOM kill: %+v, stats %+v", res, after)
	})

	t.Run("pids", func(t *testing.T) {
		g.t = t
		script := "import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('bounded', n, e.errno)\n"
		res := g.exec("python3", "-c", script)
		if !strings.HasPrefix(res.Stdout, "bounded ") {
			t.Fatalf("fork bomb not bounded: %+v", res)
		}
		if n, _ := strconv.Atoi(strings.Fields(res.Stdout)[1]); n >= 64 {
			t.Errorf("forked %d processes under a limit of 64", n)
		}
		if s := g.stats(); s.Pids > 64 || s.Pids <= 0 {
			t.Errorf("stats pids %d, limit 64", s.Pids)
		}
		t.Logf("fork bomb: %s", strings.TrimSpace(res.Stdout))
		// The bomb's children exit on their own; then the sandbox works.
		deadline := time.Now().Add(30 * time.Second)
		for g.stats().Pids > 16 || g.sh("true").ExitCode != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("sandbox did not recover from the fork bomb: %+v", g.stats())
			}
			time.Sleep(500 * time.Millisecond)
		}
	})

	t.Run("restored", func(t *testing.T) {
		g.t = t
		seed := make([]byte, 64)
		rand.Read(seed)
		future := time.Now().Add(10 * time.Hour)
		rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		if err := ctl.Restored(rctx, seed, future, "restored-host"); err != nil {
			t.Fatal(err)
		}
		out := strings.Fields(g.mustSh("date +%s; hostname; cat /etc/hostname; getent hosts restored-host | cut -f1 -d' '"))
		if len(out) != 4 {
			t.Fatalf("after restored: %q", out)
		}
		if sec, _ := strconv.ParseInt(out[0], 10, 64); sec < future.Unix() || sec > future.Unix()+120 {
			t.Errorf("guest clock %s, want about %d", out[0], future.Unix())
		}
		if out[1] != "restored-host" || out[2] != "restored-host" || out[3] != "127.0.1.1" {
			t.Errorf("hostname after restored: %q", out[1:])
		}
		// Checked by the guest before it acts.
		if err := ctl.Restored(rctx, nil, time.Now(), "Bad_Name"); err == nil || !strings.Contains(err.Error(), "hostname") {
			t.Errorf("restored with a bad hostname: %v", err)
		}
		if err := ctl.Restored(rctx, make([]byte, 4096), time.Now(), ""); err == nil {
			t.Error("restored with a 4 KiB seed: accepted")
		}
		if err := ctl.Restored(rctx, nil, time.Now(), ""); err != nil {
			t.Errorf("setting the clock back: %v", err)
		}
	})

	t.Run("disk", func(t *testing.T) {
		g.t = t
		// What the next boot's PID 1 meets on this disk is the sandbox's
		// doing: symlinks out of the root and across mounts, a FIFO
		// (/run and /tmp cannot be replaced: they hold mounts, and
		// overlayfs refuses to rename a lower directory).
		g.mustSh("echo kept > /root/on-disk && rm -f /etc/hostname /etc/hosts && ln -s /proc/sys/kernel/hostname /etc/hostname && " +
			"mkfifo /etc/hosts && sync")
		p.Kill()
		mnt := t.TempDir()
		loop, err := hostfs.AttachLoop(disk)
		if err != nil {
			t.Fatal(err)
		}
		// Read-only mount; the rw loop device lets ext4 replay its journal.
		err = unix.Mount(loop.Name(), mnt, "ext4", unix.MS_RDONLY|unix.MS_NODEV|unix.MS_NOSUID|unix.MS_NOEXEC, "")
		loop.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Unmount(mnt, 0)
		f := filepath.Join(mnt, "upper", "root", "on-disk")
		b, err := os.ReadFile(f)
		if err != nil || string(b) != "kept\n" {
			t.Fatalf("%s on the host: %q, %v", f, b, err)
		}
		var st unix.Stat_t
		if err := unix.Stat(f, &st); err != nil || st.Uid != confine.IDBase {
			t.Errorf("file written by sandbox root is owned by %d on the disk, want IDBase", st.Uid)
		}
		if fi, err := os.Lstat(filepath.Join(mnt, "upper", "etc", "hostname")); err != nil || fi.Mode().Type() != os.ModeSymlink {
			t.Errorf("/etc/hostname in the upper layer: %v, %v", fi, err)
		}
		unix.Unmount(mnt, 0)

		g2 := bootGuest(t, k, initrd, img, disk, "second-boot")
		g2.t = t
		out := g2.mustSh("hostname; cat /etc/hostname; getent hosts second-boot; cat /root/on-disk; stat -c %F /etc/hostname /etc/hosts")
		want := "second-boot\nsecond-boot\n127.0.1.1       second-boot\nkept\nregular file\nregular file\n"
		if out != want {
			t.Errorf("second boot on the same disk:\n%s\nwant\n%s", out, want)
		}
		if out := g2.mustSh("cat /proc/sys/kernel/hostname; test -x /run/space/space-agent && echo agent"); out != "second-boot\nagent\n" {
			t.Errorf("second boot: %q", out)
		}

		// A sandbox that fills its disk still boots: its hostname files
		// are its own business past a console line.
		res := g2.sh("rm /etc/hostname && ln -s /proc/sys/kernel/hostname /etc/hostname && " +
			"dd if=/dev/zero of=/root/fill bs=1M 2>&1; df -k / | tail -1; sync")
		if !strings.Contains(res.Stdout, "No space left") {
			t.Fatalf("filling the disk: %+v", res)
		}
		g2.p.Kill()
		g3 := bootGuest(t, k, initrd, img, disk, "third-boot")
		g3.t = t
		if out := g3.mustSh("hostname; cat /root/on-disk"); out != "third-boot\nkept\n" {
			t.Errorf("boot on a full disk: %q", out)
		}
		for _, line := range strings.Split(g3.p.ConsoleTail(4096), "\n") {
			if strings.Contains(line, "vm init:") && !strings.Contains(line, "mounts ") {
				t.Logf("console: %s", line)
			}
		}

		// What the sandbox deletes goes back to the host: the disk file
		// shrinks (ext4 mounted with discard, QEMU's discard=unmap).
		var full, freed unix.Stat_t
		unix.Stat(disk, &full)
		g3.mustSh("rm /root/fill && sync")
		deadline := time.Now().Add(20 * time.Second)
		for unix.Stat(disk, &freed); full.Blocks*512-freed.Blocks*512 < 100<<20 && time.Now().Before(deadline); unix.Stat(disk, &freed) {
			time.Sleep(200 * time.Millisecond)
		}
		t.Logf("disk file: %d MiB used when full, %d MiB after rm", full.Blocks*512>>20, freed.Blocks*512>>20)
		if full.Blocks*512-freed.Blocks*512 < 100<<20 {
			t.Errorf("deleting ~200 MiB in the guest freed %d MiB of the disk file", (full.Blocks-freed.Blocks)*512>>20)
		}

		// The sandbox can end its own agent (here: make it the OOM
		// killer's first choice, then run out of memory); PID 1 then ends
		// the guest, and QEMU exits.
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			g3.c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"/bin/sh", "-c",
				"echo 1000 > /proc/1/oom_score_adj && python3 -c 'b = []\nwhile True: b.append(bytearray(16 << 20))'"},
				Env: guestEnv, TimeoutSeconds: 80})
		}()
		select {
		case <-g3.p.Done():
		case <-time.After(90 * time.Second):
			t.Fatalf("guest still runs after its agent was killed:\n%s", g3.p.ConsoleTail(2048))
		}
		if tail := g3.p.ConsoleTail(2048); !strings.Contains(tail, "the agent ended (signal: killed); stopping the guest") {
			t.Errorf("console at the end:\n%s", tail)
		}
		if err := g3.p.Err(); err != nil {
			t.Errorf("QEMU exit: %v", err)
		}
	})
	if t.Failed() {
		t.Logf("console:\n%s", p.ConsoleTail(4096))
	}
}

// probeSyscalls is runtimetest's probe (x86_64 numbers) plus what only a
// real kernel under the sandbox makes worth asking.
const probeSyscalls = `
import ctypes, socket
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
call("finit_module", 313, 0, 0, 0)
call("userfaultfd", 323, 0)
call("io_uring_setup", 425, 1, 0)
call("pivot_root", 155, b"/", b"/")
call("open_by_handle_at", 304, 0, 0, 0)
call("sethostname", 170, b"x", 1)
call("reboot", 169, 0xfee1dead, 672274793, 0x1234567, 0)
call("syslog", 103, 3, 0, 0)
call("clock_settime", 227, 0, 0)
for fam, name in ((17, "af_packet"), (40, "af_vsock")):
    try:
        socket.socket(fam, socket.SOCK_RAW if fam == 17 else socket.SOCK_STREAM, 0); print(name, 0)
    except OSError as e:
        print(name, e.errno)
`
