// Package jail confines the microvm runtime's QEMU processes, as
// Firecracker's jailer confines Firecracker. Every QEMU runs:
//
//   - as an unprivileged uid and gid of its own (UID), with no
//     supplementary groups, no capabilities (effective, permitted,
//     inheritable, ambient and bounding sets empty) and no_new_privs;
//   - in new mount, pid, network, ipc and uts namespaces: its network
//     namespace has only a loopback interface that is down (QEMU needs no
//     network: the agent's channel is a virtio-serial port behind a unix
//     socket), and it is PID 1 of its pid namespace, so it can name no
//     other process;
//   - on a root of its own: a small tmpfs, read-only in the end, holding
//     only the read-only binds of what QEMU runs from (QEMUPaths) and of
//     the guest's kernel, initramfs and root image, read-write binds of
//     the sandbox's own directory, and a /dev with null, zero, urandom and
//     the Spec's devices (kvm). Each bind sits at the SAME absolute path as
//     on the host, so QEMU's command line is the one it would have
//     unjailed. The host's root is detached after pivot_root. There is no
//     /proc or /sys: QEMU 7.2 looks at /proc/self/exe (it falls back to
//     argv[0], which is absolute), /proc/self/status and
//     /sys/devices/system/node (NUMA), and runs without them;
//   - in a host cgroup with memory, pids and CPU limits (v1 memory, pids,
//     cpu/cpuacct and devices on legacy and hybrid hosts, one v2 directory
//     on unified hosts), joined BEFORE QEMU runs;
//   - with QEMU's own seccomp filter, which the caller turns on in QEMU's
//     command line (microvm.VM.Seccomp: -sandbox on,obsolete=deny,…).
//
// The jail stage is its own static binary, space-jail (cmd/space-jail,
// Main), run as root on the host and never placed in a sandbox: the host
// starts it in the new namespaces, moves it into the cgroup, sends it
// the plan over a socket, and the stage builds the root, drops every
// privilege and execs QEMU. QEMU keeps the stage's pid: the *exec.Cmd that
// Start returns is QEMU's. No parent-death signal: a jailed QEMU outlives
// the server that started it (its own session), and the next server finds
// it again by pid, its cgroup by id (CgroupIDs), and its uid by id (UID).
//
// Use (the microvm runtime):
//
//	ro, _ := jail.QEMUPaths(qemu)
//	ro = append(ro, kernel, initrd, rootImage) // each readable by the jail's uid
//	cmd, err := jail.Start(jailBinary, jail.Spec{
//		ID:       id,
//		Argv:     append([]string{qemu}, args...), // vm.Args() with vm.Seccomp set
//		ReadOnly: ro,
//		Writable: []string{vmDir},         // disk, sockets, console log; chowned to UID(id)
//		Devices:  kvmDevices,              // []string{"/dev/kvm"} under KVM
//		ExtraFiles: []*os.File{stateFile}, // -incoming fd:3
//		Limits:   jail.Limits{MemoryBytes: vmMem + overhead, CPUs: cpus},
//		Stderr:   logFile,
//	})
//	… cmd.Wait(); jail.RemoveCgroup(id)
//
// Measured here: Start returns 30–100 ms after it was called; a booted
// 256 MiB TCG guest peaked at 212 MiB in its cgroup with 3 tasks.
// Requirements: root, Linux ≥ 5.12 (open_tree, move_mount,
// mount_setattr, openat2).
package jail

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// EnvFD names the descriptor of the jail stage's control socket.
const EnvFD = "SPACE_JAIL_FD"

// Hostname is the jail's hostname (its own uts namespace): QEMU does not
// learn the host's.
const Hostname = "qemu"

// startTimeout bounds the stage from start to QEMU's exec.
const startTimeout = 30 * time.Second

// plan is what the stage builds; the host computes it and sends it as JSON.
type plan struct {
	UID, GID uint32
	Argv     []string
	Binds    []bind
	Links    []link
	Devices  []devNode
}

// bind is one host path bound at the same (real) path in the jail.
type bind struct {
	Path     string // real path (no symlink in it)
	Dir      bool
	Writable bool
}

// link is a symlink of the host recreated in the jail (merged-usr's /lib64).
type link struct {
	Path, Target string
}

// devNode is a device node made in the jail's /dev.
type devNode struct {
	Path string
	Rdev uint64
	Mode uint32
	Own  bool // owned by the jail's uid (0600) instead of root (0666)
}

// makePlan resolves s's paths on the host.
func makePlan(s *Spec) (*plan, error) {
	p := &plan{UID: s.UID, GID: s.GID, Argv: s.Argv}
	links := map[string]string{}
	// addLinks records every symlink among p's prefixes (p included).
	addLinks := func(path string) error {
		for q := path; q != "/"; q = filepath.Dir(q) {
			if st, err := os.Lstat(q); err == nil && st.Mode()&os.ModeSymlink != 0 {
				t, err := os.Readlink(q)
				if err != nil {
					return err
				}
				links[q] = t
			}
		}
		return nil
	}
	add := func(path string, writable bool) error {
		if err := addLinks(path); err != nil {
			return err
		}
		if st, err := os.Lstat(path); err == nil && st.Mode()&os.ModeSymlink != 0 {
			return nil // the link only; its target is listed on its own
		}
		real, err := filepath.EvalSymlinks(path)
		if err != nil {
			return fmt.Errorf("jail: %q: %w: %w", path, err, errdefs.ErrNotFound)
		}
		st, err := os.Stat(real)
		if err != nil {
			return fmt.Errorf("jail: %q: %w: %w", path, err, errdefs.ErrNotFound)
		}
		p.Binds = append(p.Binds, bind{Path: real, Dir: st.IsDir(), Writable: writable})
		return nil
	}
	for _, r := range s.ReadOnly {
		if err := add(r, false); err != nil {
			return nil, err
		}
	}
	for _, w := range s.Writable {
		if err := add(w, true); err != nil {
			return nil, err
		}
	}
	// Parents before children: a nested bind's mount point then already
	// exists inside its parent's bind.
	sort.Slice(p.Binds, func(i, j int) bool { return p.Binds[i].Path < p.Binds[j].Path })
	for i := 1; i < len(p.Binds); i++ {
		if p.Binds[i].Path == p.Binds[i-1].Path {
			return nil, invalid("%q is listed twice (through a symlink)", p.Binds[i].Path)
		}
	}
	for q, t := range links {
		p.Links = append(p.Links, link{Path: q, Target: t})
	}
	sort.Slice(p.Links, func(i, j int) bool { return p.Links[i].Path < p.Links[j].Path })
	for _, d := range append(append([]string{}, baseDevices...), s.Devices...) {
		var st unix.Stat_t
		if err := unix.Stat(d, &st); err != nil {
			return nil, fmt.Errorf("jail: device %q: %w: %w", d, err, errdefs.ErrNotFound)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFCHR {
			return nil, invalid("device %q is not a character device", d)
		}
		own := !isBase(d)
		mode := uint32(0o666)
		if own {
			mode = 0o600
		}
		p.Devices = append(p.Devices, devNode{Path: d, Rdev: st.Rdev, Mode: mode, Own: own})
	}
	return p, nil
}

func isBase(d string) bool {
	for _, b := range baseDevices {
		if b == d {
			return true
		}
	}
	return false
}

// chownTree gives path (recursively, without following symlinks) to uid:gid.
func chownTree(path string, uid, gid uint32) error {
	return filepath.WalkDir(path, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := os.Lchown(p, int(uid), int(gid)); err != nil {
			return fmt.Errorf("jail: chown %s: %w", p, err)
		}
		return nil
	})
}

// Start runs s.Argv (QEMU) jailed and returns once QEMU was exec'd inside
// the jail: in its namespaces, its cgroup, on its root, as its uid. The
// returned command's Process is QEMU (Pid is its host pid); the caller
// Waits for it (or, after a server restart, finds it by pid). Start chowns
// s.Writable to the jail's uid and creates the cgroup, which RemoveCgroup
// deletes when QEMU is gone (Start removes it itself when it fails).
//
// jailBinary is the static space-jail, whose stage (Main) builds the jail.
// Start needs root.
func Start(jailBinary string, s Spec) (*exec.Cmd, error) {
	if err := s.normalize(); err != nil {
		return nil, err
	}
	p, err := makePlan(&s)
	if err != nil {
		return nil, err
	}
	for _, w := range s.Writable {
		if err := chownTree(w, s.UID, s.GID); err != nil {
			return nil, err
		}
	}
	if err := createCgroup(&s, p.Devices); err != nil {
		return nil, err
	}
	cmd, err := start(jailBinary, &s, p)
	if err != nil {
		_ = RemoveCgroup(s.ID)
		return nil, err
	}
	return cmd, nil
}

func start(jailBinary string, s *Spec, p *plan) (*exec.Cmd, error) {
	msg, err := json.Marshal(p)
	if err != nil {
		return nil, err
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("jail: socketpair: %w", err)
	}
	hostEnd, jailEnd := os.NewFile(uintptr(fds[0]), "jail-host"), os.NewFile(uintptr(fds[1]), "jail-stage")
	defer jailEnd.Close()
	conn, err := net.FileConn(hostEnd)
	hostEnd.Close()
	if err != nil {
		return nil, fmt.Errorf("jail: control socket: %w", err)
	}
	defer conn.Close()
	uc := conn.(*net.UnixConn)

	cmd := exec.Command(jailBinary)
	cmd.Args[0] = "space-jail"
	cmd.Env = []string{EnvFD + "=" + strconv.Itoa(3+len(s.ExtraFiles))}
	cmd.Stdout, cmd.Stderr = s.Stdout, s.Stderr
	cmd.ExtraFiles = append(append([]*os.File{}, s.ExtraFiles...), jailEnd)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// Its own session (no terminal signals, survives the server);
		// deliberately no Pdeathsig.
		Setsid:     true,
		Cloneflags: unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("jail: starting the jail stage %s: %w", jailBinary, err)
	}
	fail := func(err error) (*exec.Cmd, error) {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, err
	}
	jailEnd.Close()
	// The stage waits for the plan: it runs nothing before it is in
	// the cgroup.
	if err := addToCgroup(s.ID, cmd.Process.Pid); err != nil {
		return fail(err)
	}
	_ = uc.SetDeadline(time.Now().Add(startTimeout))
	if _, err := uc.Write(msg); err != nil {
		return fail(fmt.Errorf("jail: sending the plan: %w", err))
	}
	if err := uc.CloseWrite(); err != nil {
		return fail(fmt.Errorf("jail: sending the plan: %w", err))
	}
	// The stage's end closes at exec (close-on-exec) with nothing said,
	// or carries its error before it exits.
	reply, rerr := io.ReadAll(io.LimitReader(uc, 4096))
	if len(reply) > 0 {
		return fail(fmt.Errorf("%s: %w", strings.TrimSpace(string(reply)), errdefs.ErrUnavailable))
	}
	// Nothing said: exec'd, or died without a word (killed: by the
	// memory limit, say).
	var info unix.Siginfo
	if err := unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil); err == nil && info.Signo == int32(unix.SIGCHLD) {
		werr := cmd.Wait()
		return nil, fmt.Errorf("jail: the jail ended before or at QEMU's start (%v; control socket: %v): %w", werr, rerr, errdefs.ErrUnavailable)
	}
	if rerr != nil {
		// A reset: the stage died with the plan unread.
		_ = cmd.Process.Kill()
		werr := cmd.Wait()
		return nil, fmt.Errorf("jail: the jail stage failed (%v; control socket: %v): %w", werr, rerr, errdefs.ErrUnavailable)
	}
	return cmd, nil
}
