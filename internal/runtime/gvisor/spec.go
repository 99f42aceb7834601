package gvisor

import (
	"encoding/json"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
)

// The OCI runtime spec, only the fields this runtime writes. Declared here
// rather than imported so the runtime needs no new module.
type ociSpec struct {
	Version  string     `json:"ociVersion"`
	Process  ociProcess `json:"process"`
	Root     ociRoot    `json:"root"`
	Hostname string     `json:"hostname,omitempty"`
	Mounts   []ociMount `json:"mounts"`
	Linux    ociLinux   `json:"linux"`
}

type ociProcess struct {
	Terminal        bool      `json:"terminal"`
	User            ociUser   `json:"user"`
	Args            []string  `json:"args"`
	Env             []string  `json:"env"`
	Cwd             string    `json:"cwd"`
	Capabilities    ociCaps   `json:"capabilities"`
	Rlimits         []ociRlim `json:"rlimits,omitempty"`
	NoNewPrivileges bool      `json:"noNewPrivileges"`
	OOMScoreAdj     *int      `json:"oomScoreAdj,omitempty"`
}

type ociUser struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

type ociCaps struct {
	Bounding    []string `json:"bounding"`
	Effective   []string `json:"effective"`
	Permitted   []string `json:"permitted"`
	Inheritable []string `json:"inheritable"`
}

type ociRlim struct {
	Type string `json:"type"`
	Hard uint64 `json:"hard"`
	Soft uint64 `json:"soft"`
}

type ociRoot struct {
	Path     string `json:"path"`
	Readonly bool   `json:"readonly"`
}

type ociMount struct {
	Destination string   `json:"destination"`
	Type        string   `json:"type,omitempty"`
	Source      string   `json:"source,omitempty"`
	Options     []string `json:"options,omitempty"`
}

type ociLinux struct {
	CgroupsPath string            `json:"cgroupsPath"`
	Resources   ociResources      `json:"resources"`
	Namespaces  []ociNamespace    `json:"namespaces"`
	Seccomp     *ociSeccomp       `json:"seccomp,omitempty"`
	MaskedPaths []string          `json:"maskedPaths,omitempty"`
	Sysctl      map[string]string `json:"sysctl,omitempty"`
}

type ociResources struct {
	Memory *ociMemory `json:"memory,omitempty"`
	CPU    *ociCPU    `json:"cpu,omitempty"`
	Pids   *ociPids   `json:"pids,omitempty"`
}

type ociMemory struct {
	Limit int64 `json:"limit"`
	Swap  int64 `json:"swap"`
}

type ociCPU struct {
	Shares *uint64 `json:"shares,omitempty"`
	Quota  int64   `json:"quota"`
	Period uint64  `json:"period"`
}

// background gives s the lowest CPU weight (runsc writes it to the
// sandbox's host cgroup): a warm pool's member in the making.
func (s *ociSpec) background() {
	if s.Linux.Resources.CPU == nil {
		s.Linux.Resources.CPU = &ociCPU{}
	}
	shares := uint64(cgroupfs.CPUShares(cgroupfs.BackgroundCPUWeight))
	s.Linux.Resources.CPU.Shares = &shares
}

type ociPids struct {
	Limit int64 `json:"limit"`
}

type ociNamespace struct {
	Type string `json:"type"`
	Path string `json:"path,omitempty"`
}

type ociSeccomp struct {
	DefaultAction string           `json:"defaultAction"`
	Architectures []string         `json:"architectures"`
	Syscalls      []ociSeccompRule `json:"syscalls"`
}

type ociSeccompRule struct {
	Names    []string        `json:"names"`
	Action   string          `json:"action"`
	ErrnoRet *uint           `json:"errnoRet,omitempty"`
	Args     []ociSeccompArg `json:"args,omitempty"`
}

type ociSeccompArg struct {
	Index    uint   `json:"index"`
	Value    uint64 `json:"value"`
	ValueTwo uint64 `json:"valueTwo"`
	Op       string `json:"op"`
}

// Paths inside the sandbox.
const (
	// agentDir is a host directory of the sandbox mounted read-write: the
	// agent binds its socket there (runsc --host-uds=create makes that a
	// host socket the server dials).
	agentDir = "/run/space"
	// agentPath is the agent binary, bind-mounted read-only.
	agentPath  = agentDir + "/space-agent"
	agentSock  = "agent.sock"
	noFile     = 65536
	cgroupBase = "space-gvisor"
)

// agentEnv is the environment of the agent, the same as native's: each
// command gets its own environment from the request anyway.
var agentEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root",
	"LANG=C.UTF-8",
}

func u(v uint) *uint { return &v }

// seccompPolicy denies inside the sandbox what package confine denies
// everywhere (confine.Denied: keyrings, bpf, perf, ptrace, kernel modules,
// io_uring, userfaultfd, handles, …), to every process of the sandbox, the
// container's init included. gVisor implements these in its own kernel, so
// this is about one behaviour for every runtime more than about the host;
// it costs nothing measurable.
func seccompPolicy() *ociSeccomp {
	eperm := u(uint(unix.EPERM))
	p := &ociSeccomp{
		DefaultAction: "SCMP_ACT_ALLOW",
		Architectures: []string{"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"},
		Syscalls: []ociSeccompRule{
			{Names: confine.DeniedNames(), Action: "SCMP_ACT_ERRNO", ErrnoRet: eperm},
			// clone3 passes its flags in memory a filter cannot read: ENOSYS
			// makes libc fall back to clone, which is checked above.
			{Names: []string{"clone3"}, Action: "SCMP_ACT_ERRNO", ErrnoRet: u(uint(unix.ENOSYS))},
		},
	}
	// New namespaces (clone/unshare flags) and mounts are refused by
	// confine's filter in the agent's namespaces (ginit): the container's
	// init needs to create them once, to put the agent there.
	return p
}

// bundleSpec builds the sandbox's OCI spec. netns is the network namespace
// the sandbox runs in (its NIC, see network.go); empty: a new, empty one.
func bundleSpec(id, rootfs, hostname, hostAgentDir, agentBinary, netns string, l api.Limits) ociSpec {
	if hostname == "" {
		hostname = id
	}
	caps := confine.CapabilityNames()
	s := ociSpec{
		Version: "1.0.2",
		Process: ociProcess{
			User: ociUser{UID: 0, GID: 0},
			Args: []string{agentPath, ginit.Role, "--socket", agentDir + "/" + agentSock},
			Env:  agentEnv,
			Cwd:  "/",
			Capabilities: ociCaps{
				Bounding: caps, Effective: caps, Permitted: caps,
			},
			Rlimits: []ociRlim{
				{Type: "RLIMIT_NOFILE", Hard: noFile, Soft: noFile},
				{Type: "RLIMIT_CORE", Hard: 0, Soft: 0},
			},
			// As native's sandboxes: no privilege gained through execve
			// (setuid binaries, file capabilities).
			NoNewPrivileges: true,
		},
		Root:     ociRoot{Path: rootfs},
		Hostname: hostname,
		Mounts: []ociMount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			// gVisor's /proc has a harmless sysrq-trigger file; mask it as
			// native does, so no tool mistakes it for the host's.
			{Destination: "/proc/sysrq-trigger", Type: "bind", Source: "/dev/null", Options: []string{"bind", "ro"}},
			{Destination: agentDir, Type: "bind", Source: hostAgentDir, Options: []string{"rbind", "rw", "nosuid", "nodev"}},
			{Destination: agentPath, Type: "bind", Source: agentBinary, Options: []string{"bind", "ro", "nosuid", "nodev"}},
		},
		Linux: ociLinux{
			CgroupsPath: "/" + cgroupBase + "/" + id,
			Resources:   ociResources{},
			Namespaces: []ociNamespace{
				{Type: "pid"}, {Type: "ipc"}, {Type: "uts"}, {Type: "mount"}, {Type: "network", Path: netns},
			},
			// runsc (--network=sandbox) copies the namespace's links into
			// the sentry's stack; this keeps IPv6 out of it (the link is
			// IPv4 only, and the TAP has IPv6 disabled).
			Sysctl:  map[string]string{"net.ipv6.conf.all.disable_ipv6": "1"},
			Seccomp: seccompPolicy(),
		},
	}
	if l.MemoryMiB > 0 {
		mem := l.MemoryMiB << 20
		// runsc applies this to the host cgroup and tells the sentry it is
		// the sandbox's total memory; the runtime then raises the host
		// limit to leave the sentry headroom (raiseHostMemory), and ginit's
		// memory guard enforces this one inside (limits.go).
		// swap = memory: no swap beyond the limit.
		s.Linux.Resources.Memory = &ociMemory{Limit: mem, Swap: mem}
		s.Process.Env = append(append([]string(nil), agentEnv...), guardEnv(l)...)
	}
	if l.CPUs > 0 {
		s.Linux.Resources.CPU = &ociCPU{Quota: cgroupfs.CPUQuotaUS(l.CPUs), Period: cgroupfs.CPUPeriodUS}
	}
	if l.Pids > 0 {
		s.Linux.Resources.Pids = &ociPids{Limit: hostPidsLimit(l.Pids)}
		// gVisor applies linux.resources to the host cgroup only, where the
		// sandbox's tasks are not host tasks. Inside, RLIMIT_NPROC bounds
		// the tasks of each uid (root included: the sandbox has neither
		// CAP_SYS_ADMIN nor CAP_SYS_RESOURCE).
		n := uint64(l.Pids)
		s.Process.Rlimits = append(s.Process.Rlimits, ociRlim{Type: "RLIMIT_NPROC", Hard: n, Soft: n})
	}
	return s
}

// hostPidsLimit is the host cgroup's pids limit for a sandbox allowed
// limit processes. On the host a gVisor sandbox is the sentry's and the
// gofer's threads plus, with systrap, stub processes for its address
// spaces: the host limit bounds all of that, with room for the sentry's
// own threads so that a fork bomb inside cannot make the sentry itself
// fail to start a thread.
func hostPidsLimit(limit int64) int64 { return 4*limit + 256 }

func writeSpec(bundle string, s ociSpec) error {
	b, err := json.MarshalIndent(s, "", "\t")
	if err != nil {
		return err
	}
	tmp := filepath.Join(bundle, ".config.json.tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(bundle, "config.json"))
}
