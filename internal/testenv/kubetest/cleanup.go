package kubetest

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/hostfs"
)

// The kernel settings the kubelet sets at start when protectKernelDefaults
// is off (pkg/kubelet/cm setupKernelTunables: overcommit, panic on OOM and
// on oops, the root keyring's quotas). With it on, the kubelet refuses to
// start on a machine whose values differ — as this one's do — so the
// harness lets it set them and puts the old values back.
var kubeletSysctls = []string{
	"vm/overcommit_memory",
	"vm/panic_on_oom",
	"kernel/panic",
	"kernel/panic_on_oops",
	"kernel/keys/root_maxkeys",
	"kernel/keys/root_maxbytes",
}

// containerLogsDir is where the kubelet links every container's log
// (hard-coded in the kubelet, unlike podLogsDir).
const containerLogsDir = "/var/log/containers"

// hostPaths are the directories made outside the cluster's directory
// whatever they are told: by the kubelet, the container log links and the
// device plugin registry (its socket there is hard-coded); by containerd's
// CRI once pods have a network, libcni's result cache and the named
// network namespaces. Those that did not exist before are removed again,
// deepest first, once empty. (On a machine that is a real node these are
// that node's: kubetest is not for one.)
var hostPaths = []string{
	containerLogsDir,
	"/var/lib/kubelet", "/var/lib/kubelet/device-plugins",
	"/var/lib/cni", "/var/lib/cni/results",
	"/var/run/netns",
}

// deviceSocket is the kubelet's device plugin registration socket.
const deviceSocket = "/var/lib/kubelet/device-plugins/kubelet.sock"

// nodeState is what the kubelet will change on the host, written before it
// starts so that Close — or a later Sweep — can undo it.
type nodeState struct {
	Sysctls        map[string]string
	MadePaths      []string // of hostPaths, those that did not exist
	CgroupRoots    []string // this cluster's cgroup root in every hierarchy
	ContainerLinks string   // links in containerLogsDir into this prefix are ours
	CNIConfig      string   // the pod network's config file (cni.go)
}

func stateFile(dir string) string { return filepath.Join(dir, "node-state.json") }

// takeNodeState records the host's state and makes the cluster's cgroup
// root (the kubelet wants its cgroupRoot to exist) in every hierarchy.
func (c *Cluster) takeNodeState() error {
	st := nodeState{Sysctls: map[string]string{}, ContainerLinks: c.Dir + "/"}
	for _, k := range kubeletSysctls {
		b, err := os.ReadFile("/proc/sys/" + k)
		if err != nil {
			return err
		}
		st.Sysctls[k] = strings.TrimSpace(string(b))
	}
	for _, p := range hostPaths {
		if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
			st.MadePaths = append(st.MadePaths, p)
		}
	}
	mps, err := cgroupMounts()
	if err != nil {
		return err
	}
	for _, mp := range mps {
		st.CgroupRoots = append(st.CgroupRoots, filepath.Join(mp, c.id()))
	}
	if c.opts.CNIConfDir != "" {
		st.CNIConfig = filepath.Join(c.opts.CNIConfDir, cniConfigName)
	}
	// Written before anything is made, so a crash in between is undone.
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if err := os.WriteFile(stateFile(c.Dir), b, 0o600); err != nil {
		return err
	}
	for _, d := range st.CgroupRoots {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
		// A v1 cpuset cgroup starts with no CPUs and no memory nodes.
		if _, err := os.Stat(filepath.Join(d, "cpuset.cpus")); err == nil {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
					return fmt.Errorf("%s: %w", filepath.Join(d, f), err)
				}
			}
		}
	}
	return nil
}

// cgroupMounts lists the mount points of every cgroup hierarchy (v1 and
// v2) in this mount namespace.
func cgroupMounts() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent maj:min root mountpoint opts [optional...] - fstype ...
		fields := strings.Fields(sc.Text())
		i := slices.Index(fields, "-")
		if i < 0 || i+1 >= len(fields) || len(fields) < 5 {
			continue
		}
		if fs := fields[i+1]; fs == "cgroup" || fs == "cgroup2" {
			if !slices.Contains(out, fields[4]) {
				out = append(out, fields[4])
			}
		}
	}
	return out, sc.Err()
}

// cleanDir undoes everything a cluster in dir did to the host, in order:
// the cgroups (their processes killed first — the CRI should have left
// none), the kernel settings, the kubelet's log links and directory, every
// mount below dir; then removes dir. Its processes are already gone.
func cleanDir(dir string) error {
	var errs []error
	if b, err := os.ReadFile(stateFile(dir)); err == nil {
		var st nodeState
		if err := json.Unmarshal(b, &st); err != nil {
			errs = append(errs, err)
		} else {
			errs = append(errs, st.undo()...)
		}
	}
	if err := hostfs.UnmountAll(dir); err != nil {
		errs = append(errs, err)
	}
	// Never remove through a mount that would not go: it could be a
	// host directory bound into a pod.
	if left, err := hostfs.MountsUnder(dir); err != nil || len(left) > 0 {
		errs = append(errs, fmt.Errorf("still mounted under %s: %v %v", dir, left, err))
	} else if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (st nodeState) undo() []error {
	var errs []error
	for _, root := range st.CgroupRoots {
		if err := removeCgroupTree(root); err != nil {
			errs = append(errs, err)
		}
	}
	if st.CNIConfig != "" {
		if err := os.Remove(st.CNIConfig); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	for k, v := range st.Sysctls {
		cur, err := os.ReadFile("/proc/sys/" + k)
		if err == nil && strings.TrimSpace(string(cur)) == v {
			continue
		}
		if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restoring %s=%s: %w", k, v, err))
		}
	}
	if st.ContainerLinks != "" {
		ents, _ := os.ReadDir(containerLogsDir)
		for _, e := range ents {
			p := filepath.Join(containerLogsDir, e.Name())
			if t, err := os.Readlink(p); err == nil && strings.HasPrefix(t, st.ContainerLinks) {
				os.Remove(p)
			}
		}
	}
	made := slices.Clone(st.MadePaths)
	slices.SortFunc(made, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	for _, p := range made {
		if p == filepath.Dir(deviceSocket) {
			os.Remove(deviceSocket)
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("%s was made by the kubelet: %w", p, err))
		}
	}
	return errs
}

// removeCgroupTree removes root and every cgroup below it, leaves first,
// killing whatever still runs in one.
func removeCgroupTree(root string) error {
	if _, err := os.Stat(root); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var dirs []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	slices.Reverse(dirs) // WalkDir visits a parent before its children
	var errs []error
	for _, d := range dirs {
		var err error
		for try := 0; try < 50; try++ {
			killProcs(d)
			if err = unix.Rmdir(d); err == nil || errors.Is(err, unix.ENOENT) {
				err = nil
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("rmdir %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

func killProcs(cg string) {
	b, _ := os.ReadFile(filepath.Join(cg, "cgroup.procs"))
	for _, l := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(l); err == nil && pid > 1 {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func syscallFlockNB(f *os.File) error {
	return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
}

// CgroupDirs are the cluster's cgroup root (the kubelet's cgroupRoot) in
// every hierarchy: the kubelet's kubepods tree is below them.
func (c *Cluster) CgroupDirs() []string {
	b, err := os.ReadFile(stateFile(c.Dir))
	if err != nil {
		return nil
	}
	var st nodeState
	if json.Unmarshal(b, &st) != nil {
		return nil
	}
	return st.CgroupRoots
}
