package runtimetest

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// channelProbe runs as root inside the sandbox, as a command the agent
// started (so with none of the agent's descriptors), and tries every way
// it has to reach the agent's channel to the host or the agent itself.
// Each attempt prints "OK what detail" when it was refused and
// "LEAK what detail" when it got through. Arguments: the agent's pid.
//
// The agent's processes are PID 1, the pid the agent reports, and any
// process whose command line names space-agent.
const channelProbe = `
import ctypes, errno, os, socket, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def leak(what, detail=""): print("LEAK", what, detail)
def ok(what, detail=""): print("OK", what, detail)
def en(e): return errno.errorcode.get(e.errno, str(e.errno)) if isinstance(e, OSError) else str(e)

print("UID", os.getuid(), os.geteuid())
for k in os.environ:
    if k.startswith("SPACE_"):
        leak("own-environ", k)

agents = {1} | {int(a) for a in sys.argv[1:]}
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    try:
        if b"space-agent" in open("/proc/%s/cmdline" % p, "rb").read():
            agents.add(int(p))
    except OSError:
        pass
print("AGENTS", sorted(agents))

for pid in sorted(agents):
    d = "/proc/%d" % pid
    if not os.path.exists(d):
        continue
    try:
        env = open(d + "/environ", "rb").read()
        names = sorted({e.split(b"=")[0].decode() for e in env.split(b"\0") if e.startswith(b"SPACE_")})
        if names:
            leak("environ", "%d %s" % (pid, ",".join(names)))
        else:
            ok("environ", "%d readable, no SPACE_ markers (%d bytes)" % (pid, len(env)))
    except OSError as e:
        ok("environ", "%d %s" % (pid, en(e)))
    for f in ("mem", "maps", "auxv", "syscall", "stack"):
        try:
            with open(d + "/" + f, "rb") as fh:
                b = fh.read(64)
            if f != "mem" and not b:
                ok(f, "%d readable but empty" % pid)
            else:
                leak(f, "%d read %d bytes" % (pid, len(b)))
        except OSError as e:
            ok(f, "%d %s" % (pid, en(e)))
    for f in ("root", "cwd"):
        try:
            os.listdir(d + "/" + f)
            leak(f, "%d listable" % pid)
        except OSError as e:
            ok(f, "%d %s" % (pid, en(e)))
    try:
        fds = os.listdir(d + "/fd")
    except OSError as e:
        fds = []
        ok("fd-list", "%d %s" % (pid, en(e)))
    # Even when the directory lists, no entry may be followed or opened.
    for fd in fds:
        p = "%s/fd/%s" % (d, fd)
        try:
            leak("fd-readlink", "%s -> %s" % (p, os.readlink(p)))
        except OSError as e:
            ok("fd-readlink", "%s %s" % (p, en(e)))
        for name, flags in (("rdwr", os.O_RDWR), ("rdonly", os.O_RDONLY), ("wronly", os.O_WRONLY), ("path", getattr(os, "O_PATH", 0o10000000))):
            try:
                h = os.open(p, flags | os.O_NONBLOCK | os.O_NOCTTY)
                os.close(h)
                leak("fd-open-" + name, p)
            except OSError as e:
                ok("fd-open-" + name, "%s %s" % (p, en(e)))
    for fdinfo in fds[:1]:
        try:
            open("%s/fdinfo/%s" % (d, fdinfo)).read()
            ok("fdinfo", "%d readable (positions and flags only)" % pid)
        except OSError as e:
            ok("fdinfo", "%d %s" % (pid, en(e)))
    # ptrace, process_vm_readv, pidfd_getfd: x86-64 syscall numbers.
    r = libc.syscall(101, 16, pid, 0, 0)  # PTRACE_ATTACH
    if r == 0:
        libc.syscall(101, 17, pid, 0, 0)  # PTRACE_DETACH
        leak("ptrace-attach", str(pid))
    else:
        ok("ptrace-attach", "%d %s" % (pid, errno.errorcode.get(ctypes.get_errno())))
    buf = ctypes.create_string_buffer(16)
    class iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    local = iovec(ctypes.cast(buf, ctypes.c_void_p), 16)
    remote = iovec(0x400000, 16)
    r = libc.syscall(310, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    e = ctypes.get_errno()
    # EFAULT or ESRCH would mean the permission check passed.
    if r >= 0 or e not in (errno.EPERM, errno.EACCES, errno.ENOSYS):
        leak("process_vm_readv", "%d r=%d %s" % (pid, r, errno.errorcode.get(e)))
    else:
        ok("process_vm_readv", "%d %s" % (pid, errno.errorcode.get(e)))
    pidfd = libc.syscall(434, pid, 0)
    if pidfd < 0:
        ok("pidfd_open", "%d %s" % (pid, errno.errorcode.get(ctypes.get_errno())))
    else:
        got = []
        for n in range(0, 64):
            h = libc.syscall(438, pidfd, n, 0)
            if h >= 0:
                got.append(n)
                os.close(h)
        os.close(pidfd)
        if got:
            leak("pidfd_getfd", "%d fds %s" % (pid, got))
        else:
            ok("pidfd_getfd", "%d none" % pid)

# Every unix socket this network namespace knows of, and every socket file
# under the directories a runtime could keep one in.
paths = set()
try:
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8:
            paths.add(f[7])
except OSError as e:
    ok("proc-net-unix", en(e))
for top in ("/run", "/tmp", "/var/run", "/dev", "/"):
    depth0 = top.rstrip("/").count("/")
    for dirpath, dirnames, filenames in os.walk(top):
        if dirpath.startswith(("/proc", "/sys")) or dirpath.count("/") - depth0 > 3:
            dirnames[:] = []
            continue
        for n in filenames:
            p = os.path.join(dirpath, n)
            try:
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    paths.add(p)
            except OSError:
                pass
        if top == "/":
            dirnames[:] = []
print("SOCKETS", sorted(paths))
for p in sorted(paths):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect("\0" + p[1:] if p.startswith("@") else p)
        leak("unix-connect", p)
    except OSError as e:
        ok("unix-connect", "%s %s" % (p, en(e)))
    finally:
        s.close()

# A sandbox process may not bind where the host dials its agent.
for d in ("/run/space",):
    if os.path.isdir(d):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        p = d + "/impostor.sock"
        try:
            s.bind(p)
            os.unlink(p)
            leak("unix-bind", p)
        except OSError as e:
            ok("unix-bind", "%s %s" % (p, en(e)))
        finally:
            s.close()
        try:
            names = os.listdir(d)
            socks = [n for n in names if stat.S_ISSOCK(os.lstat(os.path.join(d, n)).st_mode)]
            if socks:
                leak("list", "%s sockets %s" % (d, socks))
            else:
                ok("list", "%s no sockets %s" % (d, names))
        except OSError as e:
            ok("list", "%s %s" % (d, en(e)))

# Character devices a host channel could be (virtio-serial ports, consoles).
devs = set()
for d in ("/dev", "/dev/virtio-ports", "/dev/char"):
    try:
        for n in os.listdir(d):
            p = os.path.join(d, n)
            target = os.path.basename(os.path.realpath(p))
            if target.startswith(("vport", "hvc")) or d == "/dev/virtio-ports":
                devs.add(p)
    except OSError:
        pass
try:
    ports = os.listdir("/sys/class/virtio-ports")
except OSError:
    ports = []
portdevs = set()
for port in ports:
    try:
        major, minor = open("/sys/class/virtio-ports/%s/dev" % port).read().split(":")
        portdevs.add(os.makedev(int(major), int(minor)))
    except OSError:
        pass
# A covered node (a bind of /dev/null) opens, but as /dev/null: what counts
# is which device the descriptor is.
for p in sorted(devs):
    try:
        h = os.open(p, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY)
        rdev = os.fstat(h).st_rdev
        os.close(h)
        if rdev in portdevs or (os.major(rdev) != 1 and not portdevs):
            leak("dev-open", "%s (%d:%d)" % (p, os.major(rdev), os.minor(rdev)))
        else:
            ok("dev-open", "%s is %d:%d, not a port" % (p, os.major(rdev), os.minor(rdev)))
    except OSError as e:
        ok("dev-open", "%s %s" % (p, en(e)))
for port in ports:
    try:
        major, minor = open("/sys/class/virtio-ports/%s/dev" % port).read().split(":")
        p = "/tmp/.space-probe-" + port
        os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(int(major), int(minor)))
        try:
            h = os.open(p, os.O_RDWR | os.O_NONBLOCK)
            os.close(h)
            leak("mknod-open", port)
        except OSError as e:
            ok("mknod-open", "%s %s" % (port, en(e)))
        finally:
            os.unlink(p)
    except OSError as e:
        ok("mknod", "%s %s" % (port, en(e)))
print("DONE")
`

// testChannel: no process in the sandbox, not even its root, can reach the
// agent's channel to the host, the agent's memory, descriptors or
// environment, or speak to the agent as if it were the host. The host's
// word about a command (its output, its exit) is the agent's, so the agent
// is the one process of the sandbox nothing else in it may impersonate or
// inspect.
func testChannel(t *testing.T, h Harness) {
	sb := Start(t, h, nil, DefaultLimits)
	CheckChannel(t, sb)
}

// CheckChannel runs the channel probe in sb as root and fails on any leak.
func CheckChannel(t *testing.T, sb *Sandbox) {
	t.Helper()
	hl, err := sb.Client.Health(ctxFor(t, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	res := sb.Exec(t, "python3", "-c", channelProbe, strconv.Itoa(hl.Pid))
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "\nDONE\n") {
		t.Fatalf("channel probe: exit %d\nstdout: %s\nstderr: %s", res.ExitCode, res.Stdout, res.Stderr)
	}
	if !strings.HasPrefix(res.Stdout, "UID 0 0\n") {
		t.Fatalf("the probe must run as root: %s", strings.SplitN(res.Stdout, "\n", 2)[0])
	}
	var refused []string
	for _, line := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
		switch {
		case strings.HasPrefix(line, "LEAK "):
			t.Errorf("sandbox root reached the agent: %s", strings.TrimPrefix(line, "LEAK "))
		case strings.HasPrefix(line, "OK "):
			refused = append(refused, strings.TrimPrefix(line, "OK "))
		case strings.HasPrefix(line, "AGENTS "), strings.HasPrefix(line, "SOCKETS "):
			t.Log(line)
		}
	}
	// The probe really looked at the agent (and did not just find nothing).
	for _, want := range []string{"environ " + strconv.Itoa(hl.Pid), "mem " + strconv.Itoa(hl.Pid), "ptrace-attach " + strconv.Itoa(hl.Pid)} {
		found := false
		for _, r := range refused {
			found = found || strings.HasPrefix(r, want)
		}
		if !found && !t.Failed() {
			t.Errorf("the probe never tried %q: %s", want, res.Stdout)
		}
	}
	t.Logf("refused: %d attempts; e.g. %s", len(refused), strings.Join(refused[:min(len(refused), 6)], "; "))
	if testing.Verbose() {
		t.Logf("probe output:\n%s", res.Stdout)
	}
}
