package microvm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
	"github.com/spacehq/space/internal/runtime/microvm/vmctl"
	"github.com/spacehq/space/internal/runtime/microvm/vminit"
)

// Accelerators QEMU can run a guest with.
const (
	AccelKVM = "kvm"
	AccelTCG = "tcg"
)

// DefaultQEMU is the QEMU binary (Debian's qemu-system-x86).
const DefaultQEMU = "qemu-system-x86_64"

// VM describes one QEMU -M microvm guest.
type VM struct {
	QEMU      string // empty: DefaultQEMU from PATH
	Kernel    string // bzImage
	Initrd    string // from BuildInitramfs
	Accel     string // AccelKVM or AccelTCG
	CPUs      int
	MemoryMiB int
	// AgentSocket is the unix socket QEMU listens on for the agent's
	// virtio-serial port; the host dials it.
	AgentSocket string
	// ConsoleLog receives the guest's serial console (kernel messages,
	// the agent's stderr).
	ConsoleLog string

	// RootImage is the template's read-only erofs image (Images.Prepare)
	// and Disk the sandbox's writable ext4 image; the guest finds them by
	// their virtio-blk serials (vminit.RootSerial, vminit.DiskSerial) and
	// joins them with overlayfs. Both empty: the guest runs from its
	// initramfs alone (boot tests).
	RootImage string
	Disk      string
	// CtlSocket is the unix socket of the guest init's control port
	// (package vmctl); empty: no control port.
	CtlSocket string
	// QMPSocket is QEMU's machine protocol socket; empty: none.
	QMPSocket string
	// NetSocket and NetPeer are the two ends of the sandbox's NIC, a
	// virtio-net device (MAC hostnet.SandboxMAC) whose backend is a unix
	// datagram socket (-netdev dgram): QEMU binds NetSocket, reads the
	// frames the guest receives from it, and sends each frame the guest
	// transmits as one datagram to NetPeer, where the host binds the
	// descriptor NIC returns (nic.go). Both empty: no NIC.
	NetSocket string
	NetPeer   string
	// Hostname, SandboxMemoryMiB and Pids reach the guest's init on the
	// kernel command line (vminit.Env*): the sandbox's hostname and the
	// limits of its cgroup inside the guest.
	Hostname         string
	SandboxMemoryMiB int64
	Pids             int64
	// IncomingFD > 0 starts QEMU waiting for a migration stream on that
	// descriptor (-incoming fd:N) instead of booting: a restore.
	IncomingFD int
	// Seccomp enables QEMU's own seccomp sandbox (-sandbox on,…).
	Seccomp bool
	// TBSizeMiB bounds TCG's translation cache (default 1 GiB); 0 leaves
	// QEMU's default.
	TBSizeMiB int
}

// maxUnixPath is the longest path a sockaddr_un holds (108 bytes with NUL).
const maxUnixPath = 107

// Args returns QEMU's command line (without the program name).
//
// Choices, measured on this project's hosts (../shared/MACHINE.md): the
// compressed bzImage (the uncompressed vmlinux's PVH entry hangs under
// TCG); microvm keeps ACPI, through which the guest finds its virtio-mmio
// devices without virtio_mmio.device= parameters; virtio-serial instead of
// vsock (no vhost-vsock on the host); panic=-1 with -no-reboot, so a guest
// that panics or whose init dies ends its QEMU instead of hanging.
func (v VM) Args() ([]string, error) {
	for _, p := range []string{v.Kernel, v.Initrd, v.AgentSocket, v.ConsoleLog} {
		// QEMU's option syntax splits on commas; refuse rather than escape.
		if p == "" || strings.ContainsRune(p, ',') {
			return nil, fmt.Errorf("microvm: path %q is empty or has a comma: %w", p, errdefs.ErrInvalidArgument)
		}
	}
	for _, p := range []string{v.RootImage, v.Disk, v.CtlSocket, v.QMPSocket, v.NetSocket, v.NetPeer} {
		if strings.ContainsRune(p, ',') {
			return nil, fmt.Errorf("microvm: path %q has a comma: %w", p, errdefs.ErrInvalidArgument)
		}
	}
	if (v.RootImage == "") != (v.Disk == "") {
		return nil, fmt.Errorf("microvm: a root image needs a writable disk and the other way round: %w", errdefs.ErrInvalidArgument)
	}
	if (v.NetSocket == "") != (v.NetPeer == "") {
		return nil, fmt.Errorf("microvm: a NIC needs both its sockets: %w", errdefs.ErrInvalidArgument)
	}
	for _, p := range []string{v.AgentSocket, v.CtlSocket, v.QMPSocket, v.NetSocket, v.NetPeer} {
		if len(p) > maxUnixPath {
			return nil, fmt.Errorf("microvm: socket path %q is longer than %d bytes: %w", p, maxUnixPath, errdefs.ErrInvalidArgument)
		}
	}
	if v.Hostname != "" && !hostnameRE.MatchString(v.Hostname) {
		return nil, fmt.Errorf("microvm: hostname %q: %w", v.Hostname, errdefs.ErrInvalidArgument)
	}
	if v.Accel != AccelKVM && v.Accel != AccelTCG {
		return nil, fmt.Errorf("microvm: accelerator %q: %w", v.Accel, errdefs.ErrInvalidArgument)
	}
	cpus, mem := v.CPUs, v.MemoryMiB
	if cpus <= 0 {
		cpus = 1
	}
	if mem <= 0 {
		mem = 256
	}
	accel := v.Accel
	if v.Accel == AccelTCG && v.TBSizeMiB > 0 {
		accel += ",tb-size=" + strconv.Itoa(v.TBSizeMiB)
	}
	args := []string{
		"-M", "microvm",
		"-accel", accel,
		"-cpu", "max",
		"-smp", strconv.Itoa(cpus),
		"-m", strconv.Itoa(mem),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-serial", "file:" + v.ConsoleLog,
		"-kernel", v.Kernel,
		"-initrd", v.Initrd,
		"-append", v.kernelCmdline(),
		"-device", "virtio-rng-device",
		// Free page reporting: the guest reports free memory in 2 MiB
		// blocks and QEMU gives it back to the host. Without it a guest
		// stays as large as the most it ever touched — and a migration
		// (suspend, fork, warm snapshot) touches all of it on both sides,
		// so every warm clone held its whole RAM on the host.
		"-device", "virtio-balloon-device,free-page-reporting=on",
		"-device", "virtio-serial-device",
		"-chardev", "socket,id=agent,path=" + v.AgentSocket + ",server=on,wait=off",
		"-device", "virtserialport,chardev=agent,name=" + vminit.PortName,
	}
	if v.CtlSocket != "" {
		args = append(args,
			"-chardev", "socket,id=ctl,path="+v.CtlSocket+",server=on,wait=off",
			"-device", "virtserialport,chardev=ctl,name="+vmctl.PortName)
	}
	if v.RootImage != "" {
		args = append(args,
			"-drive", "id=root,file="+v.RootImage+",format=raw,if=none,readonly=on",
			"-device", "virtio-blk-device,drive=root,serial="+vminit.RootSerial,
			"-drive", "id=disk,file="+v.Disk+",format=raw,if=none,discard=unmap",
			"-device", "virtio-blk-device,drive=disk,serial="+vminit.DiskSerial)
	}
	if v.NetSocket != "" {
		// No vnet header on a dgram backend: QEMU offers the guest no
		// checksum or segmentation offloads, so every frame is a whole,
		// checksummed Ethernet frame of at most the link's MTU.
		args = append(args,
			"-netdev", "dgram,id=net0,local.type=unix,local.path="+v.NetSocket+",remote.type=unix,remote.path="+v.NetPeer,
			"-device", "virtio-net-device,netdev=net0,mac="+hostnet.SandboxMAC)
	}
	if v.QMPSocket != "" {
		args = append(args, "-qmp", "unix:"+v.QMPSocket+",server=on,wait=off")
	}
	if v.IncomingFD > 0 {
		args = append(args, "-incoming", "fd:"+strconv.Itoa(v.IncomingFD))
	}
	if v.Seccomp {
		args = append(args, "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny")
	}
	return args, nil
}

// hostnameRE is what goes on the kernel command line as the hostname: one
// RFC 1123 label (no spaces or quotes that would split the line).
var hostnameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// kernelCmdline is the guest kernel's command line.
//
// Under TCG the guest's TSC is the host's (QEMU reads the host TSC for
// rdtsc), but the guest must calibrate it against the emulated PIT, and on
// a busy host that calibration fails ("tsc: Unable to calibrate against
// PIT"): the guest then has no usable clocksource (microvm has no HPET or
// PM timer) and hangs before init. Telling it the frequency
// (tsc_early_khz) skips the calibration. Under KVM the guest uses kvmclock.
func (v VM) kernelCmdline() string {
	// reboot=t: a guest that ends (its init reboots, or panics) resets
	// through a triple fault at once, which -no-reboot turns into QEMU's
	// exit. The default method tries the ACPI reset register and the
	// keyboard controller first, which microvm does not have: the vCPU
	// then spins for seconds — tens under TCG on a loaded host.
	cmd := "console=ttyS0 quiet panic=-1 reboot=t"
	if v.Accel == AccelTCG {
		if khz := hostTSCKHz(); khz > 0 {
			cmd += " tsc_early_khz=" + strconv.FormatUint(khz, 10)
		}
	}
	if v.Hostname != "" {
		cmd += " " + vminit.EnvHostname + "=" + v.Hostname
	}
	if v.SandboxMemoryMiB > 0 {
		cmd += " " + vminit.EnvMemoryMiB + "=" + strconv.FormatInt(v.SandboxMemoryMiB, 10)
	}
	if v.Pids > 0 {
		cmd += " " + vminit.EnvPids + "=" + strconv.FormatInt(v.Pids, 10)
	}
	// Last: everything after "--" is init's arguments.
	return cmd + " " + vminit.CmdlineRole
}

var (
	tscOnce sync.Once
	tscKHz  uint64
)

// hostTSCKHz is the host's TSC frequency, or 0 when it cannot be trusted
// from /proc/cpuinfo: "cpu MHz" is the TSC's frequency only on a CPU whose
// TSC runs at a constant rate and without APERF/MPERF (with them the line
// shows the current core clock).
func hostTSCKHz() uint64 {
	tscOnce.Do(func() { tscKHz = parseTSCKHz(readFileOrEmpty("/proc/cpuinfo")) })
	return tscKHz
}

func readFileOrEmpty(p string) string {
	b, _ := os.ReadFile(p)
	return string(b)
}

func parseTSCKHz(cpuinfo string) uint64 {
	// The first processor's block is enough: the TSC is one clock.
	block, _, _ := strings.Cut(cpuinfo, "\n\n")
	var mhz string
	var flags map[string]bool
	for _, line := range strings.Split(block, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "cpu MHz":
			mhz = strings.TrimSpace(v)
		case "flags":
			flags = map[string]bool{}
			for _, f := range strings.Fields(v) {
				flags[f] = true
			}
		}
	}
	if !flags["constant_tsc"] || !flags["nonstop_tsc"] || flags["aperfmperf"] {
		return 0
	}
	f, err := strconv.ParseFloat(mhz, 64)
	if err != nil || f < 100 || f > 100000 {
		return 0
	}
	return uint64(f*1000 + 0.5)
}

// Process is a running QEMU.
type Process struct {
	vm   VM
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	err  error // Wait's result, once done is closed
}

// Start starts QEMU for v, tied to this process (Pdeathsig): probes and
// tests. It does not wait for the guest.
func Start(v VM) (*Process, error) { return Launch(v, LaunchOptions{}) }

// LaunchOptions are how a QEMU process is started, beyond its command line.
type LaunchOptions struct {
	// Incoming becomes QEMU's descriptor 3; set v.IncomingFD to 3 with it
	// (a restore reads its migration stream from there).
	Incoming *os.File
	// Detached keeps QEMU alive when this process dies (a sandbox must
	// survive a server restart): no Pdeathsig, and QEMU's stderr goes to
	// StderrPath instead of a pipe that would break with the server.
	Detached   bool
	StderrPath string
	// Dir is QEMU's working directory ("" = this process's; a jailed
	// QEMU runs in its jail's "/").
	Dir string
	// Jail, when set, runs QEMU confined by package jail.
	Jail *JailOptions
}

// JailOptions confine one QEMU (package jail): its own uid, namespaces,
// root and host cgroup. What it may read is derived from the VM: QEMU's
// binary and libraries, the kernel, the initramfs and the root image; it
// may write only Writable.
type JailOptions struct {
	// ID names the jail (cgroup, uid seed): the sandbox id.
	ID string
	// Binary is the static space-jail that builds the jail.
	Binary string
	// Writable directories hold the VM's disk, sockets and console log.
	Writable []string
	Limits   jail.Limits
}

// Launch starts QEMU for v with o. It does not wait for the guest.
func Launch(v VM, o LaunchOptions) (*Process, error) {
	args, err := v.Args()
	if err != nil {
		return nil, err
	}
	if (o.Incoming != nil) != (v.IncomingFD == 3) {
		return nil, fmt.Errorf("microvm: an incoming stream is descriptor 3 (IncomingFD %d): %w", v.IncomingFD, errdefs.ErrInvalidArgument)
	}
	bin := v.QEMU
	if bin == "" {
		bin = DefaultQEMU
	}
	// Stale sockets make QEMU fail to bind; a host end of the NIC left
	// from an earlier QEMU serves no one (NIC binds a new one).
	for _, s := range []string{v.AgentSocket, v.CtlSocket, v.QMPSocket, v.NetSocket, v.NetPeer} {
		if s != "" {
			_ = os.Remove(s)
		}
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = o.Dir
	if o.Incoming != nil {
		cmd.ExtraFiles = []*os.File{o.Incoming}
	}
	var stderr bytes.Buffer
	var errFile *os.File
	cmd.Stdout = io.Discard
	// Its own session (no terminal signals).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if o.Detached {
		if o.StderrPath == "" {
			return nil, fmt.Errorf("microvm: a detached QEMU needs a stderr file: %w", errdefs.ErrInvalidArgument)
		}
		errFile, err = os.OpenFile(o.StderrPath, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
		if err != nil {
			return nil, err
		}
		defer errFile.Close()
		cmd.Stdout, cmd.Stderr = nil, errFile
	} else {
		cmd.Stderr = &limitedBuffer{buf: &stderr, max: 8 << 10}
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
	if o.Jail != nil {
		if !o.Detached {
			return nil, fmt.Errorf("microvm: a jailed QEMU is detached: %w", errdefs.ErrInvalidArgument)
		}
		if cmd, err = startJailed(bin, args, v, o, errFile); err != nil {
			return nil, err
		}
	} else if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	p := &Process{vm: v, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		msg := strings.TrimSpace(stderr.String())
		if o.Detached {
			msg = strings.TrimSpace(readTail(o.StderrPath, 8<<10))
		}
		if msg != "" && err != nil {
			err = fmt.Errorf("qemu: %v: %s", err, msg)
		}
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// startJailed starts QEMU (bin with args, for v) in the jail o.Jail
// describes, its stderr going to errFile.
func startJailed(bin string, args []string, v VM, o LaunchOptions, errFile *os.File) (*exec.Cmd, error) {
	abs, err := exec.LookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("qemu %q: %w", bin, err)
	}
	if abs, err = filepath.Abs(abs); err != nil {
		return nil, err
	}
	ro, err := jail.QEMUPaths(abs)
	if err != nil {
		return nil, err
	}
	ro = append(ro, v.Kernel, v.Initrd)
	if v.RootImage != "" {
		ro = append(ro, v.RootImage)
	}
	var devices []string
	if v.Accel == AccelKVM {
		devices = append(devices, "/dev/kvm")
	}
	var extra []*os.File
	if o.Incoming != nil {
		extra = []*os.File{o.Incoming}
	}
	cmd, err := jail.Start(o.Jail.Binary, jail.Spec{
		ID:         o.Jail.ID,
		Argv:       append([]string{abs}, args...),
		ReadOnly:   ro,
		Writable:   o.Jail.Writable,
		Devices:    devices,
		ExtraFiles: extra,
		Limits:     o.Jail.Limits,
		Stderr:     errFile,
	})
	if err != nil {
		return nil, fmt.Errorf("starting jailed %s: %w", bin, err)
	}
	return cmd, nil
}

// Pid is QEMU's host pid.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// readTail returns the last max bytes of the regular file at path ("" if
// it is unreadable or not a regular file). The console log lives where
// QEMU can write: a symlink is never followed (the server would read a
// host file into an error message) and a FIFO never waited on.
func readTail(path string, max int64) string {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return ""
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		return ""
	}
	if st.Size() > max {
		_, _ = f.Seek(-max, io.SeekEnd)
	}
	b, _ := io.ReadAll(io.LimitReader(f, max))
	return string(b)
}

// Done is closed when QEMU has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is QEMU's exit status (with its stderr) once Done is closed.
func (p *Process) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Kill ends QEMU and waits for it. Idempotent.
func (p *Process) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// ConsoleTail returns the last max bytes of the guest's console.
func (p *Process) ConsoleTail(max int64) string { return readTail(p.vm.ConsoleLog, max) }

// DialAgent connects to the agent's port once QEMU listens on its socket.
// Bytes sent before the guest opens the port wait in the socket: QEMU reads
// from the chardev only while the guest has the port open.
func (p *Process) DialAgent(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "unix", p.vm.AgentSocket)
		if err == nil {
			return conn, nil
		}
		select {
		case <-p.done:
			return nil, p.exitError()
		case <-ctx.Done():
			return nil, fmt.Errorf("dialling the agent of the VM: %w: %w", ctx.Err(), errdefs.ErrUnavailable)
		case <-time.After(2 * time.Millisecond):
		}
	}
}

func (p *Process) exitError() error {
	how := "QEMU exited normally (guest reboot or power-off)"
	if err := p.Err(); err != nil {
		how = err.Error()
	}
	return fmt.Errorf("the VM ended: %s; console:\n%s: %w", how, p.ConsoleTail(2048), errdefs.ErrUnavailable)
}

// WaitHealthy dials the agent and waits for its health answer, failing as
// soon as QEMU exits (with the console's tail) or ctx ends. On success the
// caller owns the client.
//
// An attempt whose session breaks while QEMU runs is retried on a new
// connection: the host's multiplexer gives up on a stream the guest has not
// acknowledged within its open timeout (10 s), which a slow boot under TCG
// on a loaded host can exceed.
func (p *Process) WaitHealthy(ctx context.Context) (*agentclient.Client, agentproto.Health, error) {
	for {
		c, h, err := p.tryHealth(ctx)
		if err == nil {
			return c, h, nil
		}
		select {
		case <-p.done:
			return nil, h, p.exitError()
		case <-ctx.Done():
			return nil, h, fmt.Errorf("waiting for the agent of the VM: %v (last: %v): %w", ctx.Err(), err, errdefs.ErrUnavailable)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (p *Process) tryHealth(ctx context.Context) (*agentclient.Client, agentproto.Health, error) {
	conn, err := p.DialAgent(ctx)
	if err != nil {
		return nil, agentproto.Health{}, err
	}
	c, err := agentclient.New(conn)
	if err != nil {
		return nil, agentproto.Health{}, err
	}
	type result struct {
		h   agentproto.Health
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// One short health call after another on the same session:
		// each opens a stream, and so writes to the socket.
		for {
			cctx, cancel := context.WithTimeout(ctx, healthAttempt)
			h, err := c.Health(cctx)
			cancel()
			closed := false
			select {
			case <-c.Done():
				closed = true
			default:
			}
			if err == nil || ctx.Err() != nil || closed {
				ch <- result{h, err}
				return
			}
		}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			c.Close()
			return nil, r.h, r.err
		}
		return c, r.h, nil
	case <-p.done:
		c.Close()
		<-ch
		return nil, agentproto.Health{}, p.exitError()
	case <-ctx.Done():
		c.Close()
		<-ch
		return nil, agentproto.Health{}, ctx.Err()
	}
}

// healthAttempt bounds one health call while the guest boots.
const healthAttempt = time.Second

// limitedBuffer keeps the first max bytes written to it (QEMU's stderr:
// its first complaint is the one that explains a failure).
type limitedBuffer struct {
	mu  sync.Mutex
	buf *bytes.Buffer
	max int
}

func (l *limitedBuffer) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if room := l.max - l.buf.Len(); room > 0 {
		if len(b) > room {
			l.buf.Write(b[:room])
		} else {
			l.buf.Write(b)
		}
	}
	return len(b), nil
}
