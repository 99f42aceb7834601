// Package vminit runs inside space-agent when it is the init of a microvm
// guest (PID 1 of a guest kernel booted by internal/runtime/microvm).
//
// With a root image and a writable disk (virtio-blk serials RootSerial and
// DiskSerial) PID 1 builds the sandbox and stays outside it:
//
//  1. kernel filesystems and the initramfs's modules;
//  2. the read-only erofs template image and the ext4 disk (upper/ and
//     work/ owned by IDBase) joined by overlayfs as the new root, with
//     /etc/hostname and a /etc/hosts line for the hostname, the agent
//     binary bound read-only at AgentPath, /proc, /sys (read-only) and
//     /dev moved in, cgroup2 at /sys/fs/cgroup;
//  3. switch root (MS_MOVE onto / and chroot, as busybox's switch_root);
//  4. cgroup "sandbox" with memory.max, memory.swap.max=0 and pids.max from
//     the kernel command line;
//  5. the agent as a child in new user, pid and mount namespaces (ids
//     0..65535 → confine.IDBase…, as gvisor's ginit does), started
//     straight into the sandbox cgroup (CLONE_INTO_CGROUP), as
//     `space-agent confine` (confine.Role): confine.Self applies the one
//     policy (its /proc, masks, capabilities, no_new_privs, seccomp) and
//     it serves on the "agent" port, whose node is given to
//     confine.IDBase;
//  6. PID 1 serves the control port (package vmctl: ping, stats from the
//     sandbox cgroup, restored) on its root-only node, and when the agent
//     exits syncs and reboots, which ends QEMU (-no-reboot).
//
// Without disks (boot tests) the agent itself runs as PID 1 from the
// initramfs, serving on the port, as the groundwork did.
//
// The host selects this role explicitly: its kernel command line ends with
// "-- init-microvm" (CmdlineRole), and the kernel passes everything after
// "--" to init as arguments, so space-agent runs as `/init init-microvm`.
// Main refuses to run as anything but PID 1. The host's other values are
// undotted key=value parameters, which the kernel hands to init as
// environment variables (a dotted one such as space.hostname=x would be
// taken for a module parameter and dropped). Every value from the host is
// checked; any failure is written to the console and halts the guest.
package vminit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
)

// Role is the first argument that makes space-agent a microvm guest's
// init; CmdlineRole is how the host's kernel command line ends to pass it.
// The init starts the agent as confine.Role.
const (
	Role        = "init-microvm"
	CmdlineRole = "-- " + Role
)

// Kernel command line parameters (init's environment) from the host.
const (
	EnvHostname  = "SPACE_HOSTNAME" // the sandbox's hostname
	EnvMemoryMiB = "SPACE_MEM_MIB"  // memory.max of the sandbox's cgroup
	EnvPids      = "SPACE_PIDS"     // pids.max of the sandbox's cgroup
)

// Serials of the virtio-blk devices: the template's read-only erofs image
// and the sandbox's writable ext4 disk. The guest finds them by serial
// (/sys/block/vdX/serial), not by probe order.
const (
	RootSerial = "space-root"
	DiskSerial = "space-disk"
)

// ModulesDir is where the initramfs holds the guest's kernel modules, named
// NN-name.ko and loaded in lexical order.
const ModulesDir = "/lib/modules/space"

// PortName is the name of the virtio-serial port the agent serves on (the
// host's -device virtserialport,name=…).
const PortName = "agent"

// portWait bounds the wait for the port: the device answers the driver's
// probe at once, but names its ports in control messages that follow.
const portWait = 10 * time.Second

// defaultPath is the PATH the agent and its children get: the kernel gives
// init only HOME and TERM.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Main runs Role: it refuses to run unless the process is PID 1 (this is no
// program to run on a host), then prepares the guest. Without disks it
// returns the agent's arguments (serve on the port) and the agent runs as
// PID 1; with them it runs the sandbox (see the package doc) and never
// returns. If
// anything fails it writes why to the console and reboots the guest, which
// ends the VM (QEMU runs with -no-reboot): it never returns an error to a
// guest without an agent.
func Main() []string {
	if os.Getpid() != 1 {
		fmt.Fprintf(os.Stderr, "space-agent: %s runs only as a microvm guest's init (PID 1)\n", Role)
		os.Exit(125)
	}
	cfg, err := configFromEnv()
	// None of these are for the agent or its children, and this process
	// is as opaque to the guest's other processes as the agent is.
	if oerr := confine.Opaque(); oerr != nil && err == nil {
		err = oerr
	}
	if os.Getenv("PATH") == "" {
		os.Setenv("PATH", defaultPath)
	}
	if err != nil {
		fail(err)
	}
	var ph phases
	if err := mountKernelFS(); err != nil {
		fail(err)
	}
	ph.mark("mounts")
	if err := loadModules(ModulesDir); err != nil {
		fail(err)
	}
	ph.mark("modules")
	root, disk, err := findDisks(diskWait)
	if err != nil {
		fail(err)
	}
	if root == "" {
		port, err := findPort(PortName, portWait)
		if err != nil {
			fail(err)
		}
		ph.mark("port " + port)
		// One console line per boot, for boot-time work: where init's time went.
		fmt.Fprintf(os.Stderr, "space-agent: vm init: %s\n", &ph)
		return []string{"--serial", port}
	}
	runSandbox(cfg, root, disk, &ph)
	panic("unreachable")
}

// fail writes why the guest cannot run to the console and ends it.
func fail(err error) {
	fmt.Fprintln(os.Stderr, "space-agent: vm init:", err)
	halt()
}

// phases times init's steps for the one console line per boot.
type phases struct {
	last  time.Time
	parts []string
}

func (p *phases) mark(name string) {
	now := time.Now()
	if p.last.IsZero() {
		p.last = bootStart
	}
	p.parts = append(p.parts, fmt.Sprintf("%s %v", name, now.Sub(p.last).Round(time.Millisecond)))
	p.last = now
}

func (p *phases) String() string { return strings.Join(p.parts, ", ") }

// bootStart is when this process started (package initialisation).
var bootStart = time.Now()

func mountKernelFS() error {
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	mounts := []struct {
		src, dst, fstype string
		flags            uintptr
		data             string
	}{
		{"proc", "/proc", "proc", nodev, ""},
		{"sysfs", "/sys", "sysfs", nodev, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0755"},
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
		{"tmpfs", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
	}
	for _, m := range mounts {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, m.data); err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount %s on %s: %w", m.fstype, m.dst, err)
		}
	}
	// /dev/ptmx of the devpts instance just mounted, not devtmpfs's.
	_ = os.Remove("/dev/ptmx")
	if err := os.Symlink("pts/ptmx", "/dev/ptmx"); err != nil {
		return fmt.Errorf("/dev/ptmx: %w", err)
	}
	return nil
}

// loadModules loads every .ko in dir in lexical order. A module already
// present (built in, or loaded as a dependency) is fine.
func loadModules(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("kernel modules: %w", err)
	}
	names := make([]string, 0, len(ents))
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".ko") {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	for _, n := range names {
		if err := loadModule(filepath.Join(dir, n)); err != nil {
			return err
		}
	}
	return nil
}

func loadModule(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("module %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := unix.FinitModule(fd, "", 0); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("loading module %s: %w", filepath.Base(path), err)
	}
	return nil
}

// findPort waits until a virtio-serial port called name appears in sysfs
// and its device node in /dev, and returns the node's path.
func findPort(name string, wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		ents, _ := os.ReadDir("/sys/class/virtio-ports")
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
			if err != nil || strings.TrimSpace(string(b)) != name {
				continue
			}
			dev := filepath.Join("/dev", e.Name())
			if _, err := os.Stat(dev); err == nil {
				return dev, nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %q after %v (ports: %d)", name, wait, len(ents))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// halt ends the guest. The reboot request makes QEMU (-no-reboot) exit; if
// it fails, exiting panics the kernel, which with panic=-1 does the same.
func halt() {
	// The console is a slow emulated UART: let the reason reach it.
	_ = os.Stderr.Sync()
	unix.Sync()
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	os.Exit(1)
}
