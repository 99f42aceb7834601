package nsinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
)

// Setup runs in the init process the host started in fresh user, mount,
// pid, net, ipc and uts namespaces (RoleSetup). It builds the sandbox and
// execs the agent binary as the plain agent serving on FDAgentListener, so
// it returns only on failure.
//
// Why exec: namespaces (cgroup), capabilities, no_new_privs, Landlock and
// seccomp are per-thread kernel state, and the Go runtime has already started
// several threads. Doing everything on one locked thread and then calling
// execve makes that thread's state the state of the whole new process, with
// no thread left behind unconfined.
func Setup() error {
	// This thread execs the agent; it must never run other goroutines.
	goruntime.LockOSThread()
	return report(build(time.Now()))
}

// Probe is RoleProbe: it reports on FDStatus whether an overlay can be
// mounted and written in this user namespace, and exits.
func Probe() error { return report(probe()) }

// report writes err on the status pipe so the host's Start fails with the
// real reason rather than a timeout.
func report(err error) error {
	if err == nil {
		return nil
	}
	status := os.NewFile(FDStatus, "status")
	if status != nil {
		fmt.Fprintf(status, "%v", err)
		status.Close()
	}
	return err
}

// readConfig receives the config message and its descriptors, placing
// those at FDLower…FDRoot. It blocks until the host has put this process
// into the sandbox's cgroups.
func readConfig(v any) error {
	buf := make([]byte, 1<<16)
	oob := make([]byte, unix.CmsgSpace(LayerFDs*4))
	n, oobn, _, _, err := unix.Recvmsg(FDConfig, buf, oob, unix.MSG_CMSG_CLOEXEC)
	unix.Close(FDConfig)
	if err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return fmt.Errorf("config descriptors: %w", err)
	}
	var fds []int
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return fmt.Errorf("config descriptors: %w", err)
		}
		fds = append(fds, got...)
	}
	if len(fds) != LayerFDs {
		return fmt.Errorf("config came with %d descriptors, want %d", len(fds), LayerFDs)
	}
	for i, fd := range fds {
		if err := unix.Dup3(fd, FDLower+i, unix.O_CLOEXEC); err != nil {
			return fmt.Errorf("placing descriptor: %w", err)
		}
		unix.Close(fd)
	}
	if err := json.Unmarshal(buf[:n], v); err != nil {
		return fmt.Errorf("decoding config: %w", err)
	}
	return nil
}

// build sets the sandbox up; entered is when this process got to main.
func build(entered time.Time) error {
	var cfg Config
	if err := readConfig(&cfg); err != nil {
		return err
	}
	configured := time.Now()
	if cfg.NoFile == 0 {
		cfg.NoFile = 65536
	}
	// None of the host's descriptors may reach the agent.
	for fd := FDStatus; fd <= FDAgentExe; fd++ {
		unix.CloseOnExec(fd)
	}
	// Only now is the process inside its cgroups, so only now does a cgroup
	// namespace rooted at them hide the host's hierarchy.
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("unshare cgroup namespace: %w", err)
	}
	// Open the agent's binary (the host's FDAgentExe, else our own) before
	// the host's filesystem disappears: the final exec goes through this
	// descriptor, so the binary never has to be visible inside the sandbox.
	exe, err := agentExe()
	if err != nil {
		return err
	}
	if err := buildRoot(); err != nil {
		return err
	}
	if err := sethostname(cfg.Hostname); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	if err := pivotRoot(); err != nil {
		return err
	}
	// Only after pivot_root: the writable layer is the sandbox's, and a
	// symlink it planted must resolve inside the sandbox, never on the host.
	writeHostFiles(cfg.Hostname)
	writeResolvConf(cfg.ResolvConf)
	if err := setRlimits(cfg.NoFile); err != nil {
		return err
	}
	if err := confine.DropCapabilities(confine.ThisThread); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	abi, err := restrictLandlock(exe)
	if err != nil {
		return err
	}
	if err := confine.LoadFilter(confine.HostKernel, 0); err != nil {
		return err
	}
	// Goes to the host's init.log (outside the sandbox) for diagnostics.
	fmt.Fprintf(os.Stderr, "nsinit: sandbox ready (init %s): landlock ABI %d, seccomp allowlist of %d syscalls (exec+Go start %v, config wait %v, setup %v)\n",
		filepath.Base(os.Args[0]), abi, len(confine.Allowed), entered.Sub(time.Unix(0, cfg.SpawnedUnixNano)).Round(time.Microsecond),
		configured.Sub(entered).Round(time.Microsecond), time.Since(configured).Round(time.Microsecond))
	// The listener is named on the command line, not in the environment:
	// the agent's environment has nothing of the runtime's in it (it is
	// PID 1, and its /proc entries are the first a sandbox process looks
	// at). The agent marks the listener close-on-exec.
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/root",
		"LANG=C.UTF-8",
	}
	argv := []string{"space-agent", "--fd", strconv.Itoa(FDAgentListener)}
	err = unix.Exec(fmt.Sprintf("/proc/self/fd/%d", exe), argv, env)
	return fmt.Errorf("exec agent: %w", err)
}

// agentExe opens the binary to exec as the agent: FDAgentExe when the host
// passed one (this process is space-nsinit), else this process's own.
func agentExe() (int, error) {
	path := "/proc/self/exe"
	if _, err := unix.FcntlInt(uintptr(FDAgentExe), unix.F_GETFD, 0); err == nil {
		path = fdPath(FDAgentExe)
	}
	exe, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("opening the agent's executable: %w", err)
	}
	return exe, nil
}

func sethostname(name string) error {
	if err := unix.Sethostname([]byte(name)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	return nil
}

// loopbackUp brings lo up: a new network namespace has only a down loopback.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket for lo: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	return nil
}

func setRlimits(nofile uint64) error {
	var cur unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &cur); err != nil {
		return err
	}
	// Raising the hard limit needs CAP_SYS_RESOURCE in the host namespace,
	// which the sandbox does not have.
	if nofile > cur.Max {
		nofile = cur.Max
	}
	limits := map[int]unix.Rlimit{
		unix.RLIMIT_NOFILE: {Cur: nofile, Max: nofile},
		unix.RLIMIT_CORE:   {Cur: 0, Max: 0},
	}
	for res, lim := range limits {
		if err := unix.Setrlimit(res, &lim); err != nil {
			return fmt.Errorf("setrlimit %d: %w", res, err)
		}
	}
	return nil
}

// probe checks that this kernel lets a user namespace mount an overlay with
// userxattr and write through it, the one thing the native runtime cannot
// work without.
func probe() error {
	unix.CloseOnExec(FDStatus)
	var cfg Config
	if err := readConfig(&cfg); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := mountOverlay(); err != nil {
		return fmt.Errorf("overlay mount in user namespace: %w", err)
	}
	if err := os.WriteFile("probe", []byte("ok"), 0o644); err != nil {
		return fmt.Errorf("write through overlay: %w", err)
	}
	os.Exit(0)
	return nil
}

// writeHostFiles makes the hostname resolve inside the sandbox. It is best
// effort: the sandbox owns /etc and may have made these files anything.
// These writes are the runtime's, not the sandbox's: the host takes them
// back out of the writable layer when it exports the sandbox's changes.
func writeHostFiles(hostname string) {
	_ = os.WriteFile("/etc/hostname", HostnameFile(hostname), 0o644)
	hosts, err := os.ReadFile("/etc/hosts")
	if (err != nil && !errors.Is(err, os.ErrNotExist)) || len(hosts) > MaxHostsFile {
		return
	}
	if next, changed := AddHostname(hosts, hostname); changed {
		_ = os.WriteFile("/etc/hosts", next, 0o644)
	}
}

// writeResolvConf makes /etc/resolv.conf name the gateway as the only
// resolver. Like writeHostFiles it runs after pivot_root, so whatever the
// sandbox planted in /etc resolves inside the sandbox. A symlink in its
// place (systemd-resolved's stub, say) is replaced by a plain file through
// a rename, rather than followed into a directory that may not exist. An
// existing regular file with the right content is left alone, so the
// writable layer gets no copy of it. Best effort.
func writeResolvConf(content string) {
	const path = "/etc/resolv.conf"
	if content == "" {
		return
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode().IsRegular() && fi.Size() == int64(len(content)) {
		if b, err := os.ReadFile(path); err == nil && string(b) == content {
			return
		}
	}
	tmp := "/etc/.resolv.conf.space"
	_ = os.Remove(tmp)
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
	}
}

// MaxHostsFile is the largest /etc/hosts the sandbox init edits.
const MaxHostsFile = 1 << 20

// HostnameFile is the content of /etc/hostname the sandbox init writes.
func HostnameFile(hostname string) []byte { return []byte(hostname + "\n") }

// HostnameLine is the line the sandbox init adds to /etc/hosts.
func HostnameLine(hostname string) string { return fmt.Sprintf("127.0.1.1\t%s\n", hostname) }

// AddHostname returns hosts with hostname resolving (and localhost, if the
// file does not mention it), and whether that changed anything.
func AddHostname(hosts []byte, hostname string) ([]byte, bool) {
	for _, line := range strings.Split(string(hosts), "\n") {
		if f := strings.Fields(line); len(f) > 1 && slices.Contains(f[1:], hostname) {
			return hosts, false
		}
	}
	out := append([]byte{}, hosts...)
	if !strings.Contains(string(hosts), "localhost") {
		out = append(out, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"...)
	}
	return append(out, HostnameLine(hostname)...), true
}
