package nsinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	goruntime "runtime"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// setup runs in the init process the host started in fresh user, mount, pid,
// net, ipc and uts namespaces. In StageSetup it builds the sandbox and
// re-executes the agent binary, so it returns only on failure; in the
// re-executed agent (stageServe) it returns nil at once.
//
// Why re-exec: namespaces (cgroup), capabilities, no_new_privs, Landlock and
// seccomp are per-thread kernel state, and the Go runtime has already started
// several threads. Doing everything on one locked thread and then calling
// execve makes that thread's state the state of the whole new process, with
// no thread left behind unconfined.
func setup() error {
	switch stage := os.Getenv(EnvMarker); stage {
	case stageServe:
		// The agent must not pass the marker, nor its listening socket, on
		// to the processes it runs (Go's os/exec leaks fds without
		// close-on-exec): a process holding it could answer the host.
		os.Unsetenv(EnvMarker)
		unix.CloseOnExec(FDAgentListener)
		return nil
	case StageProbe:
		return report(probe())
	case StageSetup:
		// This thread execs the agent; it must never run other goroutines.
		goruntime.LockOSThread()
		return report(build())
	default:
		return fmt.Errorf("unknown %s=%q", EnvMarker, stage)
	}
}

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

// readConfig reads one bounded JSON document from the config pipe. It blocks
// until the host has put this process into the sandbox's cgroups.
func readConfig(v any) error {
	f := os.NewFile(FDConfig, "config")
	if f == nil {
		return errors.New("config pipe (fd 4) missing")
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, 1<<16))
	if err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("decoding config: %w", err)
	}
	return nil
}

func build() error {
	var cfg Config
	if err := readConfig(&cfg); err != nil {
		return err
	}
	if err := validate(&cfg); err != nil {
		return err
	}
	unix.CloseOnExec(FDStatus)
	// Only now is the process inside its cgroups, so only now does a cgroup
	// namespace rooted at them hide the host's hierarchy.
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("unshare cgroup namespace: %w", err)
	}
	// Open our own binary before the host's filesystem disappears: the final
	// exec goes through this descriptor, so the binary never has to be
	// visible inside the sandbox.
	exe, err := unix.Open("/proc/self/exe", unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening own executable: %w", err)
	}
	if err := buildRoot(&cfg); err != nil {
		return err
	}
	if err := sethostname(cfg.Hostname); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	if err := pivotRoot(cfg.Root); err != nil {
		return err
	}
	// Only after pivot_root: the writable layer is the sandbox's, and a
	// symlink it planted must resolve inside the sandbox, never on the host.
	writeHostFiles(cfg.Hostname)
	if err := setRlimits(cfg.NoFile); err != nil {
		return err
	}
	if err := dropCapabilities(); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	if _, err := restrictLandlock(exe); err != nil {
		return err
	}
	if err := loadSeccomp(); err != nil {
		return err
	}
	env := []string{
		EnvMarker + "=" + stageServe,
		fmt.Sprintf("%s=%d", EnvAgentFD, FDAgentListener),
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/root",
		"LANG=C.UTF-8",
	}
	err = unix.Exec(fmt.Sprintf("/proc/self/fd/%d", exe), os.Args, env)
	return fmt.Errorf("exec agent: %w", err)
}

// validate refuses paths the overlay option parser would misread.
func validate(cfg *Config) error {
	for _, p := range []string{cfg.Lower, cfg.Upper, cfg.Work, cfg.Root} {
		if p == "" || !strings.HasPrefix(p, "/") || strings.ContainsAny(p, ",:\\\n") {
			return fmt.Errorf("bad path %q in config", p)
		}
	}
	if cfg.NoFile == 0 {
		cfg.NoFile = 65536
	}
	return nil
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
// userxattr, the one thing the native runtime cannot work without.
func probe() error {
	var cfg ProbeConfig
	if err := readConfig(&cfg); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s,userxattr", cfg.Lower, cfg.Upper, cfg.Work)
	if err := unix.Mount("overlay", cfg.Merged, "overlay", 0, opts); err != nil {
		return fmt.Errorf("overlay mount in user namespace: %w", err)
	}
	if err := os.WriteFile(cfg.Merged+"/probe", []byte("ok"), 0o644); err != nil {
		return fmt.Errorf("write through overlay: %w", err)
	}
	os.Exit(0)
	return nil
}

// writeHostFiles makes the hostname resolve inside the sandbox. It is best
// effort: the sandbox owns /etc and may have made these files anything.
func writeHostFiles(hostname string) {
	_ = os.WriteFile("/etc/hostname", []byte(hostname+"\n"), 0o644)
	hosts, err := os.ReadFile("/etc/hosts")
	if (err != nil && !errors.Is(err, os.ErrNotExist)) || len(hosts) > 1<<20 {
		return
	}
	for _, line := range strings.Split(string(hosts), "\n") {
		if f := strings.Fields(line); len(f) > 1 && slices.Contains(f[1:], hostname) {
			return
		}
	}
	if !strings.Contains(string(hosts), "localhost") {
		hosts = append(hosts, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"...)
	}
	hosts = append(hosts, fmt.Sprintf("127.0.1.1\t%s\n", hostname)...)
	_ = os.WriteFile("/etc/hosts", hosts, 0o644)
}
