package vminit

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/microvm/vmctl"
)

// Cgroup is the sandbox's cgroup in the guest; the agent and everything it
// starts live in it from their first instruction (CLONE_INTO_CGROUP).
const Cgroup = "/sys/fs/cgroup/sandbox"

// agentEnv is the agent's environment, as gvisor gives it: each command
// gets its own environment from the request anyway.
var agentEnv = []string{
	"PATH=" + defaultPath,
	"HOME=/root",
	"LANG=C.UTF-8",
}

// maxAgentLog bounds what PID 1 copies from the agent's stderr to the
// console: code in the sandbox can write there (through /proc/<agent>/fd),
// and the console is a file on the host.
const maxAgentLog = 256 << 10

// runSandbox builds the sandbox and runs it to its end (package doc).
// It never returns: the guest halts when the agent exits or on a failure.
func runSandbox(cfg config, rootDev, diskDev string, ph *phases) {
	if err := mountRoot(rootDev, diskDev); err != nil {
		fail(err)
	}
	ph.mark("root")
	if err := prepareRoot(); err != nil {
		fail(err)
	}
	if err := switchRoot(); err != nil {
		fail(err)
	}
	if cfg.hostname != "" {
		if err := setHostname(cfg.hostname); err != nil {
			fail(err)
		}
	}
	if err := setupCgroup(cfg); err != nil {
		fail(err)
	}
	ph.mark("switch")
	port, err := findPort(PortName, portWait)
	if err != nil {
		fail(err)
	}
	ctl, err := findPort(vmctl.PortName, portWait)
	if err != nil {
		fail(err)
	}
	ph.mark("ports")
	// The confined agent (sandbox root, IDBase here) opens its port; the
	// control port stays guest root's alone.
	if err := os.Chown(port, confine.IDBase, confine.IDBase); err != nil {
		fail(fmt.Errorf("give the agent its port: %w", err))
	}
	if err := os.Chmod(port, 0o600); err != nil {
		fail(err)
	}
	if err := os.Chmod(ctl, 0o600); err != nil {
		fail(err)
	}
	if err := loopbackUp(); err != nil {
		fail(err)
	}
	if nic, err := nicUp(); err != nil {
		fail(err)
	} else if nic {
		writeResolvConf()
	}
	ph.mark("net")
	if err := hardenKernel(); err != nil {
		fail(err)
	}

	agent, logs, err := startAgent(port)
	if err != nil {
		fail(err)
	}
	ph.mark("agent")
	fmt.Fprintf(os.Stderr, "space-agent: vm init: %s\n", ph)
	go copyBounded(os.Stderr, logs, maxAgentLog)
	go serveControl(ctl, &control{})

	err = agent.Wait()
	fmt.Fprintf(os.Stderr, "space-agent: vm init: the agent ended (%v); stopping the guest\n", exitString(err))
	halt()
}

// guestSysctls are set before the sandbox starts. The sandbox cannot
// write /proc/sys (its files are guest root's); these settle what the
// guest kernel tells or does for it regardless of the kernel's build
// defaults:
//   - printk: the kernel's console chatter (an OOM kill prints a page) is
//     for nobody once the sandbox runs, and the sandbox can cause as much
//     of it as it likes, into a file on the host: only emergencies and
//     alerts (panics, oopses — what the host's exit reason needs) go on;
//   - dmesg_restrict, kptr_restrict: no kernel log, no kernel addresses;
//   - sysrq: off (its trigger file is masked in the sandbox's /proc too).
var guestSysctls = []struct{ path, value string }{
	{"/proc/sys/kernel/printk", "2 4 1 7"},
	{"/proc/sys/kernel/dmesg_restrict", "1"},
	{"/proc/sys/kernel/kptr_restrict", "2"},
	{"/proc/sys/kernel/sysrq", "0"},
}

func hardenKernel() error {
	for _, s := range guestSysctls {
		if err := os.WriteFile(s.path, []byte(s.value), 0); err != nil {
			return fmt.Errorf("sysctl %s=%s: %w", s.path, s.value, err)
		}
	}
	return nil
}

// setupCgroup creates the sandbox cgroup with its limits.
func setupCgroup(cfg config) error {
	if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory +pids"), 0); err != nil {
		return fmt.Errorf("cgroup controllers: %w", err)
	}
	if err := os.Mkdir(Cgroup, 0o755); err != nil {
		return fmt.Errorf("sandbox cgroup: %w", err)
	}
	set := func(file, v string) error {
		if err := os.WriteFile(Cgroup+"/"+file, []byte(v), 0); err != nil {
			return fmt.Errorf("sandbox cgroup %s=%s: %w", file, v, err)
		}
		return nil
	}
	if cfg.memoryMiB > 0 {
		if err := set("memory.max", strconv.FormatInt(cfg.memoryMiB<<20, 10)); err != nil {
			return err
		}
		// No swap beyond the limit (the guest has no swap device either;
		// the file exists only with swap accounting).
		if _, err := os.Stat(Cgroup + "/memory.swap.max"); err == nil {
			if err := set("memory.swap.max", "0"); err != nil {
				return err
			}
		}
	}
	if cfg.pids > 0 {
		if err := set("pids.max", strconv.FormatInt(cfg.pids, 10)); err != nil {
			return err
		}
	}
	return nil
}

// startAgent starts the agent confined: new user, pid and mount
// namespaces with 0..IDSize-1 mapped to IDBase…, in the sandbox cgroup
// from its start, as confine.Role (confine.Self) in it. Its stderr (and
// stdout) is a pipe PID 1 reads.
func startAgent(port string) (*exec.Cmd, io.ReadCloser, error) {
	cg, err := unix.Open(Cgroup, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open the sandbox cgroup: %w", err)
	}
	defer unix.Close(cg)
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, nil, err
	}
	defer pw.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		pr.Close()
		return nil, nil, err
	}
	defer null.Close()
	cmd := exec.Command(AgentPath, confine.Role, "--serial", port)
	cmd.Args[0] = "space-agent"
	cmd.Env = agentEnv
	cmd.Dir = "/"
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, pw, pw
	ids := []syscall.SysProcIDMap{{ContainerID: 0, HostID: confine.IDBase, Size: confine.IDSize}}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:                 unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNS,
		UidMappings:                ids,
		GidMappings:                ids,
		GidMappingsEnableSetgroups: true,
		Credential:                 &syscall.Credential{Uid: 0, Gid: 0},
		UseCgroupFD:                true,
		CgroupFD:                   cg,
	}
	if err := cmd.Start(); err != nil {
		pr.Close()
		return nil, nil, fmt.Errorf("starting the agent in its namespaces: %w", err)
	}
	return cmd, pr, nil
}

// copyBounded copies r to w until limit bytes, then drains r.
func copyBounded(w io.Writer, r io.ReadCloser, limit int64) {
	defer r.Close()
	n, _ := io.Copy(w, io.LimitReader(r, limit))
	if n >= limit {
		fmt.Fprintf(w, "\nspace-agent: vm init: agent log over %d bytes; the rest is dropped\n", limit)
		_, _ = io.Copy(io.Discard, r)
	}
}

func exitString(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ProcessState.String()
	}
	if err != nil {
		return err.Error()
	}
	return "exit status 0"
}

// serveControl serves the control port for the guest's life, reopening
// it after each host session ends (EOF), as the agent does its own.
func serveControl(path string, h vmctl.Handler) {
	var logged atomic.Bool
	for {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			if !logged.Swap(true) {
				fmt.Fprintln(os.Stderr, "space-agent: vm init: control port:", err)
			}
			time.Sleep(time.Second)
			continue
		}
		_ = vmctl.Serve(f, h)
		f.Close()
		time.Sleep(100 * time.Millisecond)
	}
}

// control is the guest side of vmctl.
type control struct{}

var _ vmctl.Handler = (*control)(nil)

// Stats reads the sandbox cgroup's counters and the disk's use.
func (*control) Stats() (vmctl.Stats, error) {
	var s vmctl.Stats
	var err error
	if s.MemoryBytes, err = cgroupfs.ReadInt(Cgroup + "/memory.current"); err != nil {
		return s, err
	}
	if s.Pids, err = cgroupfs.ReadInt(Cgroup + "/pids.current"); err != nil {
		return s, err
	}
	if s.OOMKills, err = cgroupfs.ReadKey(Cgroup+"/memory.events", "oom_kill"); err != nil {
		return s, err
	}
	if s.MemoryCacheBytes, err = cgroupfs.ReadKey(Cgroup+"/memory.stat", "file"); err != nil {
		return s, err
	}
	s.DiskUsedBytes, err = diskUsed()
	return s, err
}

// Bounds of a restore's inputs: the pool takes 4096 bits at most, and a
// clock outside these years is a host bug, not a time.
const maxSeed = 512

var (
	minClock = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()
	maxClock = time.Date(2200, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()
)

// Restored runs after the guest was restored from a snapshot: the memory
// image every restored copy shares holds the same CRNG state, so each gets
// fresh entropy, credited, and a reseed; the clock jumped while the
// snapshot lay on disk; a fork child has its own name.
func (*control) Restored(seed []byte, timeUnixNano int64, hostname string) error {
	if len(seed) > maxSeed {
		return fmt.Errorf("seed of %d bytes (at most %d)", len(seed), maxSeed)
	}
	if timeUnixNano != 0 && (timeUnixNano < minClock || timeUnixNano > maxClock) {
		return fmt.Errorf("time %d out of range", timeUnixNano)
	}
	if hostname != "" && !hostnameRE.MatchString(hostname) {
		return fmt.Errorf("hostname %q: not one RFC 1123 label", hostname)
	}
	if len(seed) > 0 {
		if err := addEntropy(seed); err != nil {
			return err
		}
	}
	if timeUnixNano != 0 {
		ts := unix.NsecToTimespec(timeUnixNano)
		if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
			return fmt.Errorf("clock_settime: %w", err)
		}
	}
	if hostname != "" {
		return setHostname(hostname)
	}
	return nil
}

// addEntropy mixes seed into the kernel's pool crediting all its bits
// (RNDADDENTROPY: struct rand_pool_info {int entropy_count; int buf_size;
// u32 buf[]}) and reseeds the CRNG from it at once (RNDRESEEDCRNG).
func addEntropy(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := make([]byte, 8+len(seed)+3) // buf[] is u32s: room to round up
	putInt32(buf[0:], int32(8*len(seed)))
	putInt32(buf[4:], int32(len(seed)))
	copy(buf[8:], seed)
	if err := ioctlPtr(f, unix.RNDADDENTROPY, buf); err != nil {
		return fmt.Errorf("RNDADDENTROPY: %w", err)
	}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); errno != 0 {
		return fmt.Errorf("RNDRESEEDCRNG: %w", errno)
	}
	return nil
}

// writeResolvConf makes the gateway the sandbox's resolver. The file is
// the sandbox's (as /etc/hosts, see setHostname) and is rewritten at every
// boot; a symlink there (systemd-resolved's stub, or one the sandbox
// planted) is replaced by a regular file, never followed. A failure is
// said on the console and left to the sandbox.
func writeResolvConf() {
	if err := writeSandboxFileResolve("/etc/resolv.conf", []byte(ResolvConf), unix.RESOLVE_NO_SYMLINKS); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: vm init: /etc/resolv.conf not written:", err)
	}
}
