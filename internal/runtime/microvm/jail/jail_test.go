package jail_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/microvm"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
	"github.com/spacehq/space/internal/testenv"
)

// bootInputs returns QEMU, the guest kernel and an initramfs with the
// test's space-agent, or skips/fails as microvm's own boot tests do.
func bootInputs(t *testing.T) (qemu string, k microvm.Kernel, initrd, agent string) {
	t.Helper()
	testenv.RequireRoot(t)
	qemu, err := exec.LookPath(microvm.DefaultQEMU)
	testenv.Require(t, "qemu", err == nil, "install qemu-system-x86 (scripts/setup.sh)")
	k, err = microvm.FindKernel(testenv.CacheDir())
	testenv.Require(t, "microvm-kernel", err == nil, fmt.Sprintf("scripts/setup.sh unpacks the guest kernel: %v", err))
	agent = testenv.AgentBinary(t)
	initrd, err = microvm.BuildInitramfs(k, agent, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return qemu, k, initrd, agent
}

func randomID(t *testing.T) string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "jailtest-" + hex.EncodeToString(b)
}

// procStatus reads the "Key:\tvalue" lines of /proc/<pid>/status.
func procStatus(t *testing.T, pid int) map[string]string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// mountPoints lists (mount point → options) of pid's mount namespace.
func mountPoints(t *testing.T, pid int) map[string]string {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) > 5 {
			m[fs[4]] = fs[5]
		}
	}
	return m
}

// TestJailedQEMU boots the groundwork guest under TCG through Start, with
// QEMU's seccomp on, and checks from the host everything the jail
// promises, then that killing it leaves nothing behind.
func TestJailedQEMU(t *testing.T) {
	qemu, k, initrd, agent := bootInputs(t)
	dir, err := os.MkdirTemp("", "jail") // short: socket paths
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	id := randomID(t)
	vm := microvm.VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: microvm.AccelTCG, CPUs: 1, MemoryMiB: 256,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"), Seccomp: true}
	args, err := vm.Args()
	if err != nil {
		t.Fatal(err)
	}
	// Two disk files as the runtime gives them (a read-only image from
	// elsewhere, a writable one in the sandbox's directory): QEMU opens
	// and locks a -drive's file at start even with no device for the
	// guest (which then need not know them).
	image := filepath.Join(t.TempDir(), "root.img")
	disk := filepath.Join(dir, "disk.img")
	for _, f := range []string{image, disk} {
		if err := os.WriteFile(f, make([]byte, 1<<20), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(image, 0o444); err != nil {
		t.Fatal(err)
	}
	args = append(args,
		"-drive", "id=timg,file="+image+",format=raw,if=none,readonly=on",
		"-drive", "id=tdisk,file="+disk+",format=raw,if=none,discard=unmap")
	ro, err := jail.QEMUPaths(qemu)
	if err != nil {
		t.Fatal(err)
	}
	ro = append(ro, k.Vmlinuz, initrd, image)
	var stderr bytes.Buffer
	const memLimit = 512 << 20
	start := time.Now()
	cmd, err := jail.Start(testenv.JailBinary(t), jail.Spec{ID: id, Argv: append([]string{qemu}, args...), ReadOnly: ro, Writable: []string{dir},
		Limits: jail.Limits{MemoryBytes: memLimit, CPUs: 1, Pids: 64}, Stderr: &stderr})
	if err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	cleaned := false
	defer func() {
		if !cleaned {
			_ = cmd.Process.Kill()
			<-done
			_ = jail.RemoveCgroup(id)
		}
	}()
	t.Logf("jailed QEMU pid %d started in %v", pid, time.Since(start).Round(time.Millisecond))

	// The guest answers through the socket in the jail's writable dir.
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	h, err := health(ctx, vm.AgentSocket, done)
	if err != nil {
		con, _ := os.ReadFile(vm.ConsoleLog)
		t.Fatalf("health: %v\nqemu stderr: %s\nconsole tail: %s", err, stderr.String(), tail(string(con), 2048))
	}
	t.Logf("guest agent %s answered %v after start", h, time.Since(start).Round(time.Millisecond))

	// It holds both disk files open.
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	open := map[string]bool{}
	for _, fd := range fds {
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil {
			open[l] = true
		}
	}
	if !open[image] || !open[disk] {
		t.Errorf("QEMU's open files %v lack %s or %s", open, image, disk)
	}

	// What QEMU made is its own and no one else's.
	for _, p := range []string{vm.AgentSocket, vm.ConsoleLog} {
		var fst syscall.Stat_t
		if err := syscall.Lstat(p, &fst); err != nil {
			t.Errorf("%v", err)
		} else if fst.Uid != jail.UID(id) || fst.Mode&0o077 != 0 {
			t.Errorf("%s: owner %d mode %o, want %d and no group/other access", p, fst.Uid, fst.Mode&0o777, jail.UID(id))
		}
	}

	// Credentials: its own uid and gid, no groups, no capabilities,
	// no_new_privs, QEMU's seccomp filter.
	st := procStatus(t, pid)
	want := strconv.Itoa(int(jail.UID(id)))
	for _, key := range []string{"Uid", "Gid"} {
		for _, f := range strings.Fields(st[key]) {
			if f != want {
				t.Errorf("%s: %q, want all %s", key, st[key], want)
			}
		}
	}
	for key, v := range map[string]string{"Groups": "", "NoNewPrivs": "1", "Seccomp": "2",
		"CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
		"CapBnd": "0000000000000000", "CapAmb": "0000000000000000"} {
		if st[key] != v {
			t.Errorf("%s: %q, want %q", key, st[key], v)
		}
	}
	if !strings.Contains(st["NSpid"], "\t1") && !strings.HasSuffix(st["NSpid"], " 1") {
		t.Errorf("NSpid %q: QEMU is not PID 1 of its own pid namespace", st["NSpid"])
	}
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || exe != qemu {
		t.Errorf("exe %q (%v), want %s", exe, err, qemu)
	}

	// Namespaces: none shared with the host (the test's own).
	for _, ns := range []string{"mnt", "pid", "net", "ipc", "uts"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		its, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
		if err != nil || its == mine {
			t.Errorf("%s namespace %q (%v) is the host's %q", ns, its, err, mine)
		}
	}
	// Its network namespace has a loopback only.
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/dev", pid)); err == nil {
		var ifs []string
		for _, line := range strings.Split(string(b), "\n")[2:] {
			if name, _, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
				ifs = append(ifs, name)
			}
		}
		if len(ifs) != 1 || ifs[0] != "lo" {
			t.Errorf("network interfaces %v, want [lo]", ifs)
		}
	}

	// Its root: only the allowed paths.
	root := fmt.Sprintf("/proc/%d/root", pid)
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var top []string
	for _, e := range ents {
		top = append(top, e.Name())
	}
	sort.Strings(top)
	allowed := map[string]bool{"dev": true, "usr": true, "lib": true, "lib64": true, "lib32": true, "etc": true, "var": true, "tmp": true}
	for _, n := range top {
		if !allowed[n] {
			t.Errorf("unexpected /%s in the jail's root %v", n, top)
		}
	}
	for _, p := range []string{"/work", "/root", "/home", "/etc/shadow", "/etc/passwd", "/proc/1", "/sys/kernel",
		"/var/cache/space/base-bookworm", "/dev/sda", "/dev/kvm", "/dev/mem", agent, filepath.Dir(initrd) + "/../x"} {
		if _, err := os.Lstat(root + p); err == nil {
			t.Errorf("%s is visible in the jail", p)
		}
	}
	devs, _ := os.ReadDir(root + "/dev")
	var devNames []string
	for _, d := range devs {
		devNames = append(devNames, d.Name())
	}
	if strings.Join(devNames, " ") != "null urandom zero" {
		t.Errorf("/dev holds %v, want null urandom zero", devNames)
	}
	for _, p := range []string{"/lib64/ld-linux-x86-64.so.2", k.Vmlinuz, initrd, qemu} {
		if _, err := os.Stat(root + p); err != nil {
			t.Errorf("%s is missing in the jail: %v", p, err)
		}
	}
	mounts := mountPoints(t, pid)
	for mp, opts := range mounts {
		writable := mp == dir
		if ro := strings.HasPrefix(opts, "ro"); ro == writable {
			t.Errorf("mount %s has options %s (writable: %v)", mp, opts, writable)
		}
		if !strings.Contains(opts, "nosuid") {
			t.Errorf("mount %s has options %s: no nosuid", mp, opts)
		}
	}
	wantMounts := []string{"/", dir}
	for _, p := range ro {
		if fi, err := os.Lstat(p); err == nil && fi.Mode()&os.ModeSymlink == 0 {
			wantMounts = append(wantMounts, p)
		}
	}
	for _, mp := range wantMounts {
		if _, ok := mounts[mp]; !ok {
			t.Errorf("no mount at %s in the jail: %v", mp, mounts)
		}
	}
	if len(mounts) != len(wantMounts) {
		t.Errorf("jail mounts %v: want exactly %v", mounts, wantMounts)
	}

	// Its cgroup, with the limits, from before QEMU ran.
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cgroups:\n%s", cg)
	v1 := !strings.HasPrefix(strings.TrimSpace(string(cg)), "0::") || strings.Contains(string(cg), ":memory:")
	if v1 {
		for _, c := range []string{"memory", "pids", "cpu"} {
			if !regexpLine(string(cg), c, "/space-jail/"+id) {
				t.Errorf("not in the %s cgroup /space-jail/%s", c, id)
			}
		}
		checkFile(t, "/sys/fs/cgroup/memory/space-jail/"+id+"/memory.limit_in_bytes", strconv.Itoa(memLimit))
		checkFile(t, "/sys/fs/cgroup/pids/space-jail/"+id+"/pids.max", "64")
		checkFile(t, "/sys/fs/cgroup/cpu/space-jail/"+id+"/cpu.cfs_quota_us", "100000")
		checkFile(t, "/sys/fs/cgroup/devices/space-jail/"+id+"/devices.list", "c 1:3 rwm\nc 1:5 rwm\nc 1:9 rwm")
		// What a booted 256 MiB TCG guest costs, for sizing the limit.
		usage, _ := os.ReadFile("/sys/fs/cgroup/memory/space-jail/" + id + "/memory.max_usage_in_bytes")
		pids, _ := os.ReadFile("/sys/fs/cgroup/pids/space-jail/" + id + "/pids.current")
		t.Logf("peak memory %s bytes, tasks %s", strings.TrimSpace(string(usage)), strings.TrimSpace(string(pids)))
	} else {
		if !strings.Contains(string(cg), "0::/space-jail/"+id) {
			t.Errorf("not in /space-jail/%s", id)
		}
		checkFile(t, "/sys/fs/cgroup/space-jail/"+id+"/memory.max", strconv.Itoa(memLimit))
		checkFile(t, "/sys/fs/cgroup/space-jail/"+id+"/pids.max", "64")
		checkFile(t, "/sys/fs/cgroup/space-jail/"+id+"/cpu.max", "100000 100000")
	}
	cpu, err := jail.CgroupCPU(id)
	if err != nil || cpu <= 0 {
		t.Errorf("CgroupCPU: %d, %v (a guest booted: want > 0)", cpu, err)
	}
	t.Logf("cgroup CPU after boot: %v", time.Duration(cpu))
	found := false
	for _, x := range jail.CgroupIDs() {
		found = found || x == id
	}
	if !found {
		t.Errorf("CgroupIDs does not list %s", id)
	}
	// Killed as the runtime kills it: by its pid.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("QEMU survives SIGKILL")
	}
	if err := jail.RemoveCgroup(id); err != nil {
		t.Fatalf("RemoveCgroup: %v", err)
	}
	cleaned = true

	// Nothing left: process, cgroup, mounts.
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("QEMU pid %d still exists: %v", pid, err)
	}
	for _, x := range jail.CgroupIDs() {
		if x == id {
			t.Errorf("cgroup %s left", id)
		}
	}
	if _, err := jail.CgroupCPU(id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("CgroupCPU of a removed jail: %v, want not found", err)
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mi), dir) || strings.Contains(string(mi), initrd) {
		t.Errorf("a mount of the jail is left on the host:\n%s", mi)
	}
	if err := jail.RemoveCgroup(id); err != nil {
		t.Errorf("RemoveCgroup of a removed cgroup: %v", err)
	}
}

func regexpLine(cg, controller, path string) bool {
	for _, line := range strings.Split(cg, "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || parts[2] != path {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == controller {
				return true
			}
		}
	}
	return false
}

func checkFile(t *testing.T, path, want string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Errorf("%v", err)
		return
	}
	if got := strings.TrimSpace(string(b)); got != want {
		t.Errorf("%s = %q, want %q", path, got, want)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// health asks the guest's agent for its health until it answers, QEMU
// exits or ctx ends.
func health(ctx context.Context, sock string, exited <-chan error) (string, error) {
	var last error
	for {
		select {
		case err := <-exited:
			return "", fmt.Errorf("QEMU exited: %v (last: %v)", err, last)
		case <-ctx.Done():
			return "", fmt.Errorf("%v (last: %v)", ctx.Err(), last)
		default:
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", sock)
		if err != nil {
			last = err
			time.Sleep(20 * time.Millisecond)
			continue
		}
		c, err := agentclient.New(conn)
		if err != nil {
			last = err
			conn.Close()
			continue
		}
		for i := 0; i < 30; i++ {
			hctx, cancel := context.WithTimeout(ctx, time.Second)
			h, err := c.Health(hctx)
			cancel()
			if err == nil {
				c.Close()
				return h.Version, nil
			}
			last = err
			select {
			case <-c.Done():
				i = 30
			default:
			}
		}
		c.Close()
	}
}

// TestJailShell runs a shell instead of QEMU: it sees the jail from inside
// (root listing, hostname, ids, no /proc) and writes what it saw to the
// descriptor 3 that Start passed through.
func TestJailShell(t *testing.T) {
	testenv.RequireRoot(t)
	ro, err := jail.QEMUPaths("/usr/bin/sh")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	id := randomID(t)
	script := `exec >&3 2>&3; ls -a /; ls /dev; hostname; id -u; id -g; id -G; echo x > ` + dir + `/f && echo wrote; ` +
		`echo x > /usr/f || echo usr-ro; ls /proc/self || echo no-proc; ls ` + filepath.Dir(dir) + `; ` + dir + `/sh -c true || echo noexec`
	if err := copyFile("/usr/bin/dash", dir+"/sh"); err != nil {
		t.Fatal(err)
	}
	// An extra device (/dev/kvm for a KVM guest; /dev/full stands in
	// where the host has none) is the jail's own node, owned by its uid.
	extra, rdev := "/dev/kvm", "10, 232"
	if fi, err := os.Stat(extra); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		extra, rdev = "/dev/full", "1, 7"
	}
	devices := []string{extra}
	script += "; ls -ln " + extra
	cmd, err := jail.Start(testenv.JailBinary(t), jail.Spec{ID: id, Argv: []string{"/usr/bin/sh", "-c", script}, ReadOnly: ro, Writable: []string{dir},
		Devices: devices, ExtraFiles: []*os.File{w}, Limits: jail.Limits{MemoryBytes: 64 << 20, CPUs: 0.5}})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer jail.RemoveCgroup(id)
	var out bytes.Buffer
	_, _ = out.ReadFrom(r)
	if err := cmd.Wait(); err != nil {
		t.Errorf("shell: %v", err)
	}
	got := out.String()
	t.Logf("inside the jail:\n%s", got)
	uid := strconv.Itoa(int(jail.UID(id)))
	if want := "crw------- 1 " + uid + " " + uid + " " + rdev; !strings.Contains(got, want) {
		t.Errorf("%s in the jail: want %q", extra, want)
	}
	if want := ".\n..\ndev\netc\nlib\nlib64\ntmp\nusr\n"; !strings.HasPrefix(got, want) {
		t.Errorf("the jail's root is not just %q", want)
	}
	for _, want := range []string{"null\nurandom\nzero\n", "\n" + jail.Hostname + "\n",
		"\n" + uid + "\n" + uid + "\n" + uid + "\n", "wrote", "usr-ro", "no-proc", "\n" + filepath.Base(dir) + "\n", "noexec"} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if err := jail.RemoveCgroup(id); err != nil {
		t.Error(err)
	}
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}

// TestStartFailureReported: a program that cannot run in the jail (its
// ELF interpreter, under /lib64, is not bound) fails Start with the
// stage's reason, and leaves no cgroup.
func TestStartFailureReported(t *testing.T) {
	testenv.RequireRoot(t)
	fi, err := os.Lstat("/lib64")
	testenv.Require(t, "merged-usr", err == nil && fi.Mode()&os.ModeSymlink != 0, "needs a merged-usr host (/lib64 a symlink), as Debian 12 is")
	id := randomID(t)
	_, err = jail.Start(testenv.JailBinary(t), jail.Spec{ID: id, Argv: []string{"/usr/bin/true"}, ReadOnly: []string{"/usr"},
		Limits: jail.Limits{MemoryBytes: 64 << 20, CPUs: 1}})
	if err == nil || !strings.Contains(err.Error(), "exec /usr/bin/true in the jail") || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("err = %v, want the stage's exec failure", err)
	}
	t.Log(err)
	for _, x := range jail.CgroupIDs() {
		if x == id {
			t.Errorf("failed start left cgroup %s", id)
		}
	}
}

// TestMain lets the test binary play a server that starts a jail and
// exits (TestJailOutlivesStarter).
func TestMain(m *testing.M) {
	if os.Getenv("JAIL_TEST_STARTER") == "1" {
		cmd, err := jail.Start(os.Getenv("JAIL_TEST_BIN"), jail.Spec{ID: os.Getenv("JAIL_TEST_ID"),
			Argv: []string{"/usr/bin/sleep", "60"}, ReadOnly: strings.Split(os.Getenv("JAIL_TEST_RO"), ":"),
			Limits: jail.Limits{MemoryBytes: 16 << 20, CPUs: 0.1}})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Println(cmd.Process.Pid)
		os.Exit(0) // without waiting: as a server that dies
	}
	os.Exit(m.Run())
}

// TestJailOutlivesStarter: a jailed process survives the process that
// started it (no parent-death signal), in a session of its own, and
// RemoveCgroup ends it.
func TestJailOutlivesStarter(t *testing.T) {
	testenv.RequireRoot(t)
	ro, err := jail.QEMUPaths("/usr/bin/sleep")
	if err != nil {
		t.Fatal(err)
	}
	id := randomID(t)
	defer jail.RemoveCgroup(id)
	starter := exec.Command(os.Args[0], "-test.run=^$")
	starter.Env = append(os.Environ(), "JAIL_TEST_STARTER=1", "JAIL_TEST_BIN="+testenv.JailBinary(t),
		"JAIL_TEST_ID="+id, "JAIL_TEST_RO="+strings.Join(ro, ":"))
	out, err := starter.Output()
	if err != nil {
		t.Fatalf("starter: %v: %s", err, out)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("starter said %q", out)
	}
	time.Sleep(100 * time.Millisecond)
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatalf("the jailed process died with its starter: %v", err)
	}
	// After "(comm)": state ppid pgrp session.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	if f[0] == "Z" || f[3] != strconv.Itoa(pid) {
		t.Errorf("state %s session %s: want a live process leading its own session %d", f[0], f[3], pid)
	}
	if err := jail.RemoveCgroup(id); err != nil {
		t.Fatal(err)
	}
	// Its parent (the starter) is gone: init reaps it.
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("pid %d survives RemoveCgroup", pid)
	}
}

// TestJailLimits: the cgroup's limits hold for what runs in the jail — a
// 64 MiB buffer under a 24 MiB limit is OOM-killed, the 17th task under a
// pids limit of 16 cannot be made.
func TestJailLimits(t *testing.T) {
	testenv.RequireRoot(t)
	ro, err := jail.QEMUPaths("/usr/bin/sh")
	if err != nil {
		t.Fatal(err)
	}
	run := func(limits jail.Limits, argv ...string) (string, error) {
		id := randomID(t)
		defer jail.RemoveCgroup(id)
		var out bytes.Buffer
		cmd, err := jail.Start(testenv.JailBinary(t), jail.Spec{ID: id, Argv: argv, ReadOnly: ro, Limits: limits, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatal(err)
		}
		err = cmd.Wait()
		return out.String(), err
	}
	out, err := run(jail.Limits{MemoryBytes: 24 << 20, CPUs: 1}, "/usr/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Errorf("64 MiB under a 16 MiB limit: %v, want killed by the OOM killer; output %q", err, out)
	}
	out, err = run(jail.Limits{MemoryBytes: 64 << 20, CPUs: 1, Pids: jail.MinPids},
		"/usr/bin/sh", "-c", "for i in $(seq 20); do sleep 5 & done; echo started")
	if err == nil || !strings.Contains(out, "fork") {
		t.Errorf("20 background tasks under a pids limit of %d: %v, %q; want a failed fork", jail.MinPids, err, out)
	}
	t.Logf("pids limit: %v: %s", err, strings.TrimSpace(out))
}

// startVM starts vm jailed as sandbox id with extra descriptors from 3 and
// returns QEMU's command and a channel with its Wait result; cleanup kills
// it and removes its cgroup.
func startVM(t *testing.T, qemu string, vm microvm.VM, id string, ro []string, extra []*os.File) (*exec.Cmd, <-chan error) {
	t.Helper()
	args, err := vm.Args()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd, err := jail.Start(testenv.JailBinary(t), jail.Spec{ID: id, Argv: append([]string{qemu}, args...), ReadOnly: ro,
		Writable: []string{filepath.Dir(vm.AgentSocket)}, ExtraFiles: extra,
		Limits: jail.Limits{MemoryBytes: 512 << 20, CPUs: 1}, Stderr: &stderr})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		err := cmd.Wait()
		if stderr.Len() > 0 {
			err = fmt.Errorf("%v: %s", err, stderr.String())
		}
		done <- err
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = jail.RemoveCgroup(id)
	})
	return cmd, done
}

// TestJailedSuspendRestore: the runtime's suspend and restore work through
// the jail with QEMU's seccomp on — the state file reaches the running
// QEMU over QMP (getfd, migrate fd:), and a new jailed QEMU resumes from
// it on the descriptor 3 that Start passed through (-incoming fd:3).
func TestJailedSuspendRestore(t *testing.T) {
	qemu, k, initrd, _ := bootInputs(t)
	dir, err := os.MkdirTemp("", "jail")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ro, err := jail.QEMUPaths(qemu)
	if err != nil {
		t.Fatal(err)
	}
	ro = append(ro, k.Vmlinuz, initrd)
	id := randomID(t)
	vm := microvm.VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: microvm.AccelTCG, CPUs: 1, MemoryMiB: 256, Seccomp: true,
		AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"), QMPSocket: filepath.Join(dir, "qmp.sock")}
	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	defer cancel()
	_, done := startVM(t, qemu, vm, id, ro, nil)
	if _, err := health(ctx, vm.AgentSocket, done); err != nil {
		t.Fatalf("boot: %v", err)
	}
	q, err := microvm.DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	// The state file lives where the server keeps it, outside the jail.
	state := filepath.Join(t.TempDir(), "state")
	f, err := os.OpenFile(state, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := q.Execute(ctx, "stop", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := q.ExecuteWithFD(ctx, "getfd", map[string]string{"fdname": "state"}, f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := q.Execute(ctx, "migrate", map[string]string{"uri": "fd:state"}); err != nil {
		t.Fatal(err)
	}
	for {
		raw, err := q.Execute(ctx, "query-migrate", nil)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(raw), `"completed"`) {
			break
		}
		if strings.Contains(string(raw), `"failed"`) {
			t.Fatalf("migration: %s", raw)
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, _ = q.Execute(ctx, "quit", nil)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("QEMU after quit: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("QEMU did not quit")
	}
	st, _ := os.Stat(state)
	t.Logf("suspended to %d MiB in %v", st.Size()>>20, time.Since(start).Round(time.Millisecond))
	if err := jail.RemoveCgroup(id); err != nil {
		t.Fatal(err)
	}

	in, err := os.Open(state)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	vm.IncomingFD = 3
	start = time.Now()
	_, done = startVM(t, qemu, vm, id, ro, []*os.File{in})
	q2, err := microvm.DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q2.Close()
	for {
		status, err := q2.Status(ctx)
		if err != nil {
			t.Fatalf("restored QEMU: %v", err)
		}
		if status == "running" {
			break
		}
		if status == "paused" || status == "postmigrate" {
			// Loaded; it was stopped when saved, so it stays so.
			if raw, err := q2.Execute(ctx, "query-migrate", nil); err == nil && strings.Contains(string(raw), `"completed"`) {
				if _, err := q2.Execute(ctx, "cont", nil); err != nil {
					t.Fatal(err)
				}
				continue
			}
		}
		select {
		case err := <-done:
			t.Fatalf("restored QEMU exited: %v", err)
		case <-ctx.Done():
			t.Fatalf("restored QEMU stays %q", status)
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Logf("restored to running in %v", time.Since(start).Round(time.Millisecond))
	// The guest goes on: its agent answers on a new connection.
	if _, err := health(ctx, vm.AgentSocket, done); err != nil {
		t.Fatalf("restored guest: %v", err)
	}
}
