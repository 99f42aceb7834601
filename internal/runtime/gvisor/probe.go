package gvisor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime"
)

// Isolation is what a gvisor sandbox gets.
const Isolation = "gvisor(systrap)+seccomp+cgroups"

type probeCache struct {
	runtime.ProbeCache
	// checkpointErr is why a checkpoint and restore of the probe's
	// sandbox failed (nil: they work).
	checkpointErr error
}

// Probe implements runtime.Runtime. It finds runsc, reads its version, and
// really runs a tiny sandbox once (the agent binary printing its usage
// error is enough to prove runsc, the platform, the gofer and cgroups
// work); the result is cached, and a successful one is kept in DataDir for
// the rest of the boot (probecache.go).
func (r *Runtime) Probe(ctx context.Context) runtime.Capabilities {
	disk := runtime.ProbeDisk{Key: r.probeKey, Files: r.probeFiles}
	return r.probe.Get(ctx, disk, func(ctx context.Context) (runtime.Capabilities, bool) {
		return r.measure(ctx), true
	})
}

func (r *Runtime) measure(ctx context.Context) runtime.Capabilities {
	c := runtime.Capabilities{
		Isolation:   Isolation,
		Strength:    strength,
		Verbs:       map[string]bool{},
		VerbReasons: map[string]string{},
		Details: map[string]string{
			"platform":       "systrap",
			"runsc_pinned":   RunscVersion,
			"cgroup_version": "1",
			"rootfs":         "host overlayfs (template + per-sandbox ext4 upper), gofer, --overlay2=none",
			"agent_channel":  "unix socket bound by the sentry on a host directory (--host-uds=create)",
		},
	}
	if cgroupV2() {
		c.Details["cgroup_version"] = "2"
	}
	if err := r.check(ctx, &c); err != nil {
		c.Reason = err.Error()
	} else {
		c.Available = true
	}
	for _, v := range []string{api.OpCreate, api.OpDelete, api.OpStop, api.OpStart, api.OpPause, api.OpResume} {
		c.Verbs[v] = c.Available
		if !c.Available {
			c.VerbReasons[v] = c.Reason
		}
	}
	ckptErr := errors.New(c.Reason)
	if c.Available {
		ckptErr = r.probe.checkpointErr
	}
	// Wake needs restore: a suspended sandbox can only wake through it.
	for _, v := range []string{api.OpSuspend, api.OpRestore, api.OpFork, api.OpWake} {
		c.Verbs[v] = ckptErr == nil
		if ckptErr != nil {
			c.VerbReasons[v] = "checkpoint/restore does not work here: " + ckptErr.Error()
		}
	}
	return c
}

func (r *Runtime) check(ctx context.Context, c *runtime.Capabilities) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root (runsc, cgroups, loop devices)")
	}
	rs, err := r.runsc()
	if err != nil {
		return err
	}
	c.Details["runsc"] = rs.bin
	v, err := binaryVersion(rs.bin)
	if err != nil {
		return err
	}
	c.Details["runsc_version"] = v
	if _, err := os.Stat(r.cfg.AgentBinary); err != nil {
		return fmt.Errorf("agent binary: %v", err)
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		return fmt.Errorf("mkfs.ext4 not found (install e2fsprogs)")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return fmt.Errorf("no loop devices: %v", err)
	}
	d, err := r.probeRun(ctx, rs, func(id, dir string) {
		t0 := time.Now()
		r.probe.checkpointErr = probeCheckpoint(ctx, rs, id, dir)
		if r.probe.checkpointErr == nil {
			c.Details["probe_checkpoint_restore_ms"] = strconv.FormatFloat(float64(time.Since(t0).Microseconds())/1000, 'f', 1, 64)
		}
	})
	if err != nil {
		return err
	}
	c.Details["probe_run_ms"] = strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64)
	return nil
}

// probeRun starts a sandbox the way Start does — the agent as init on a
// socket the sentry binds on a host directory — from a root holding
// nothing, dials the agent, runs then, and deletes the sandbox. It returns
// how long `runsc run` took until the agent answered the dial.
func (r *Runtime) probeRun(ctx context.Context, rs *runsc, then func(id, dir string)) (time.Duration, error) {
	dir, err := os.MkdirTemp(r.cfg.DataDir, ".probe-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	root := filepath.Join(dir, "rootfs")
	agent := filepath.Join(dir, "agent")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return 0, err
	}
	if err := makeAgentDir(agent); err != nil {
		return 0, err
	}
	id := "probe-" + strconv.FormatInt(time.Now().UnixNano()%1e12, 36)
	spec := bundleSpec(id, root, id, agent, r.cfg.AgentBinary, "", api.Limits{CPUs: 1, MemoryMiB: 128, Pids: 32})
	if err := writeSpec(dir, spec); err != nil {
		return 0, err
	}
	defer rs.deleteForce(context.WithoutCancel(ctx), id)
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	t0 := time.Now()
	if _, err := rs.run(ctx, startTimeout, "run", "--detach", "--bundle", dir, id); err != nil {
		return 0, fmt.Errorf("probe sandbox: %w", err)
	}
	sock := filepath.Join(agent, agentSock)
	for {
		c, err := dialSocket(ctx, sock)
		if err == nil {
			d := time.Since(t0)
			c.Close()
			then(id, dir)
			return d, nil
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("probe sandbox: its agent never listened on %s: %v", sock, err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// dialSocket connects to the unix socket at path through an O_PATH
// descriptor (/proc/self/fd/N), so the path may be longer than a
// sockaddr_un holds (107 bytes): the sentry's gofer binds the agent's
// socket at its own short path (/run/space/agent.sock in its root), and
// only the host's dial would otherwise be limited. Nothing is followed and
// the path must be a socket, since the sandbox can write its directory.
func dialSocket(ctx context.Context, path string) (net.Conn, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return nil, fmt.Errorf("%s is not a socket", path)
	}
	var d net.Dialer
	return d.DialContext(ctx, "unix", "/proc/self/fd/"+strconv.Itoa(fd))
}
