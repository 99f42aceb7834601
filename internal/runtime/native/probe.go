package native

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

// Probe implements runtime.Runtime. Everything is measured once: a user
// namespace really mounting an overlay, loop devices and mkfs, the cgroup
// controllers, the Landlock ABI, and whether CRIU works.
func (r *Runtime) Probe(ctx context.Context) runtime.Capabilities {
	return r.probe.Get(ctx, runtime.ProbeDisk{}, func(ctx context.Context) (runtime.Capabilities, bool) {
		return r.measure(ctx), true
	})
}

func (r *Runtime) measure(ctx context.Context) runtime.Capabilities {
	abi := nsinit.LandlockABI()
	isolation := Isolation
	if abi == 0 {
		isolation = "namespaces+seccomp"
	}
	c := runtime.Capabilities{
		Isolation:   isolation,
		Strength:    strength,
		Verbs:       map[string]bool{},
		VerbReasons: map[string]string{},
		Details: map[string]string{
			"landlock_abi":   strconv.Itoa(abi),
			"cgroup_version": strconv.Itoa(cgroupVersion()),
			"seccomp":        "allowlist",
			"uid_map":        fmt.Sprintf("0-%d -> %d", idRange-1, hostIDBase),
		},
	}
	if err := r.check(ctx); err != nil {
		c.Reason = err.Error()
	} else if d, err := r.probeDisk(ctx); err != nil {
		c.Reason = err.Error()
	} else {
		c.Available = true
		c.Details["disk_prepare_ms"] = strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64)
	}
	for _, v := range []string{api.OpCreate, api.OpDelete, api.OpStop, api.OpStart, api.OpPause, api.OpResume, api.OpWake} {
		c.Verbs[v] = c.Available
		if !c.Available {
			c.VerbReasons[v] = c.Reason
		}
	}
	why := criuReason(ctx)
	for _, v := range []string{api.OpSuspend, api.OpRestore, api.OpFork} {
		c.Verbs[v] = false
		c.VerbReasons[v] = why
	}
	return c
}

// check returns why the runtime cannot work here, or nil.
func (r *Runtime) check(ctx context.Context) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root (loop devices, cgroups, uid mapping)")
	}
	if err := r.checkAgent(); err != nil {
		return err
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return fmt.Errorf("no loop devices: %v", err)
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		return fmt.Errorf("mkfs.ext4 not found (install e2fsprogs)")
	}
	if err := checkCgroups(); err != nil {
		return err
	}
	return r.probeOverlay(ctx)
}

func checkCgroups() error {
	if cgroupVersion() == 2 {
		data, err := os.ReadFile(filepath.Join(cgroupRoot, "cgroup.controllers"))
		if err != nil {
			return fmt.Errorf("cgroup v2: %v", err)
		}
		for _, c := range []string{"memory", "pids", "cpu"} {
			if !strings.Contains(" "+string(data)+" ", " "+c+" ") && !strings.Contains(string(data), c) {
				return fmt.Errorf("cgroup v2 controller %s missing", c)
			}
		}
		return nil
	}
	for _, c := range []string{"memory", "pids", "freezer"} {
		var st unix.Statfs_t
		if err := unix.Statfs(filepath.Join(cgroupRoot, c), &st); err != nil || st.Type != unix.CGROUP_SUPER_MAGIC {
			return fmt.Errorf("cgroup v1 controller %s not mounted", c)
		}
	}
	return nil
}

// probeOverlay starts the agent binary in a new user and mount namespace
// (nsinit.RoleProbe) and has it mount an overlay with userxattr.
func (r *Runtime) probeOverlay(ctx context.Context) error {
	if err := os.MkdirAll(r.cfg.DataDir, 0o700); err != nil {
		return err
	}
	dir, err := os.MkdirTemp(r.cfg.DataDir, ".probe-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var layers [4]string // lower, upper, work, merged
	for i := range layers {
		d, err := os.MkdirTemp(dir, "")
		if err != nil {
			return err
		}
		if err := os.Chown(d, hostIDBase, hostIDBase); err != nil {
			return err
		}
		layers[i] = d
	}
	bin, err := os.Open(r.cfg.AgentBinary)
	if err != nil {
		return err
	}
	defer bin.Close()
	cfgW, cfgR, err := configSocket()
	if err != nil {
		return err
	}
	defer cfgW.Close()
	defer cfgR.Close()
	statR, statW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer statR.Close()
	defer statW.Close()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, fmt.Sprintf("/proc/self/fd/%d", nsinit.FDAgentBinary))
	cmd.Args = []string{"space-agent", nsinit.RoleProbe}
	cmd.Env = []string{} // nothing of the server's (nil would inherit it)
	// fd 3 (the listener) is unused by the probe.
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer devnull.Close()
	cmd.ExtraFiles = []*os.File{devnull, cfgR, statW, bin}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  unix.CLONE_NEWUSER | unix.CLONE_NEWNS,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostIDBase, Size: idRange}},
		// Become the namespace's root (host uid 100000000): the host's
		// root is not mapped inside and would be "nobody" without caps.
		Credential:  &syscall.Credential{Uid: 0, Gid: 0},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostIDBase, Size: idRange}},
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("user namespaces unusable: %v", err)
	}
	statW.Close()
	cfgR.Close()
	if err := sendConfig(cfgW, cmd.Process.Pid, nsinit.Config{}, layers[:]); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return err
	}
	cfgW.Close()
	msg, _ := io.ReadAll(io.LimitReader(statR, 4096))
	werr := cmd.Wait()
	if len(msg) > 0 {
		return fmt.Errorf("probe: %s", bytes.TrimSpace(msg))
	}
	if werr != nil {
		return fmt.Errorf("probe failed: %v: %s", werr, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// criuReason says, measured, why this runtime offers no memory
// checkpoint. Even where criu works the native runtime does not implement
// it yet, and says that instead.
func criuReason(ctx context.Context) string {
	path, err := exec.LookPath("criu")
	if err != nil {
		return "CRIU is not installed on this host, so process memory cannot be checkpointed"
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, "check")
	// criu check runs `iptables -L` when iptables is installed, which
	// resolves rule addresses through the host's resolver: in a network
	// namespace of its own (loopback only, down) it can send nothing.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	out, err := cmd.CombinedOutput()
	if err != nil {
		first, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		return fmt.Sprintf("CRIU is not usable on this host (criu check fails: %s)", first)
	}
	return "the native runtime does not implement CRIU checkpoints"
}

// probeDisk formats, loop-mounts and unmounts a small disk image exactly as
// Create does, and reports how long mkfs+mount took (the reason no pool of
// pre-formatted images is kept: it is a small part of a create).
func (r *Runtime) probeDisk(ctx context.Context) (time.Duration, error) {
	dir, err := os.MkdirTemp(r.cfg.DataDir, ".probe-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	t0 := time.Now()
	img := filepath.Join(dir, "disk.img")
	if err := formatDisk(ctx, img, 16); err != nil {
		return 0, fmt.Errorf("probe disk: %w", err)
	}
	mnt := filepath.Join(dir, "rw")
	if err := mountDisk(img, mnt); err != nil {
		return 0, fmt.Errorf("probe disk: %w", err)
	}
	d := time.Since(t0)
	if err := hostfs.UnmountAll(mnt); err != nil {
		return 0, fmt.Errorf("probe disk: %w", err)
	}
	return d, nil
}
