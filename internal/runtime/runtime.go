// Package runtime defines the small interfaces every isolation backend
// implements, and the registry through which backends make themselves known.
//
// A backend lives in its own package (internal/runtime/native, …) and calls
// Register from init. Nothing outside a backend switches on runtime names:
// the manager asks the registry, probes capabilities, and discovers optional
// abilities (pause, suspend, fork) by type assertion on the Instance.
package runtime

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Config is what the server hands every runtime factory.
type Config struct {
	// DataDir is the runtime's own directory (<server data>/runtimes/<name>);
	// everything the runtime creates on disk lives below it.
	DataDir string
	// AgentBinary is the host path of the static space-agent binary.
	AgentBinary string
	// JailBinary is the host path of the static space-jail binary (the
	// microvm runtime's QEMU jailer, run as root on the host); empty:
	// space-jail next to AgentBinary.
	JailBinary string
	Logger     *slog.Logger
}

// Capabilities is the result of a probe: what this runtime can really do on
// this host, measured, never assumed.
type Capabilities struct {
	Available bool
	Reason    string // why not Available
	// Isolation names what a sandbox of this runtime gets, e.g.
	// "namespaces+seccomp+landlock". Sandboxes report it.
	Isolation string
	// Strength orders runtimes for "auto": the strongest available wins.
	Strength int
	// Verbs maps lifecycle verbs (api.Op*) to whether they work here;
	// VerbReasons says why a verb does not.
	Verbs       map[string]bool
	VerbReasons map[string]string
	// Details are facts worth showing in `space info` (landlock_abi, cgroup_version, …).
	Details map[string]string
}

// Spec is everything a runtime needs to create one sandbox instance.
type Spec struct {
	ID     string // sandbox id: [a-z0-9-], ≤ 40 chars, unique on this host
	RootFS string // template root directory (read-only; never written)
	// TemplateDigest is the digest of the root tree (api.Template.TreeDigest):
	// templates differing only in defaults share it, so runtimes key what
	// they derive from RootFS by it.
	TemplateDigest string
	Limits         api.Limits // resolved: every field > 0 except OutputMiB
	Hostname       string
	// Background marks a sandbox made ahead of demand (a warm pool's
	// member): its host cgroup starts at the lowest CPU weight, so making
	// it never takes CPU from sandboxes in use, until Foreground.
	Background bool
}

// Stats are host-side measurements of an instance, trusted because the host
// reads them (cgroups), not the agent.
type Stats struct {
	MemoryBytes int64
	OOMKills    int64 // cumulative count of OOM kills in this instance
	Pids        int64
	CPUNanos    int64
	// MemoryCacheBytes is the page cache part of MemoryBytes where the
	// runtime can tell, else 0.
	MemoryCacheBytes int64
	// DiskUsedBytes is what the writable layer (the sandbox's own disk)
	// holds, as df would say: measured on the filesystem, never the
	// image file's size (sparse, and it does not shrink on delete).
	DiskUsedBytes int64
}

// Runtime is one isolation backend.
type Runtime interface {
	Name() string
	// Probe measures what the runtime can do here. It may be slow the first
	// time and should cache.
	Probe(ctx context.Context) Capabilities
	// Create allocates host resources for a new instance (directories,
	// writable disk, cgroup) without starting anything. On error it leaves
	// nothing behind.
	Create(ctx context.Context, spec Spec) (Instance, error)
	// Open re-attaches to an instance created earlier (for example by a
	// server that has since been restarted). Its processes may or may not
	// still be alive: Instance.Alive tells.
	Open(ctx context.Context, spec Spec) (Instance, error)
	// Sweep removes every host resource (processes, mounts, cgroups,
	// directories) of instances whose id keep rejects. It returns the ids it
	// removed. Reconcile calls it on start and periodically.
	Sweep(ctx context.Context, keep func(id string) bool) ([]string, error)
}

// Instance is one sandbox's isolation unit.
type Instance interface {
	ID() string
	// Start boots the sandbox's init/agent. It returns once the agent's
	// stream can be dialled (the caller then waits for agent health).
	Start(ctx context.Context) error
	// Alive reports whether the sandbox's processes are running (or paused).
	Alive() bool
	// DialAgent opens the byte stream to the in-sandbox agent.
	DialAgent(ctx context.Context) (net.Conn, error)
	// Stop kills every process of the sandbox and releases CPU and memory,
	// keeping the writable disk. Idempotent.
	Stop(ctx context.Context) error
	// Destroy stops and removes every host resource. Idempotent.
	Destroy(ctx context.Context) error
	Stats(ctx context.Context) (Stats, error)
	// Exited returns a channel closed when the sandbox's init dies on its own
	// (crash, agent killed from inside, OOM of init). Nil if not running.
	Exited() <-chan struct{}
}

// OOMCounter is implemented by instances that can read their count of OOM
// kills (Stats.OOMKills) on its own, without a whole Stats sample: the
// manager reads it around every synchronous exec to tell an OOM kill from
// any other SIGKILL, so it must be cheap (a counter file, no process, no
// round trip into the sandbox).
type OOMCounter interface {
	OOMKills() (int64, error)
}

// Foregrounder is implemented by instances that can leave the background
// CPU weight a Spec.Background create gave them: the manager calls it when
// a pool member becomes someone's sandbox.
type Foregrounder interface {
	Foreground() error
}

// ExitReasoner is implemented by instances that can say why their init
// ended on its own (a guest kernel panic, a hung guest killed by the
// runtime's watchdog), with the evidence (a console tail). The manager puts
// it in the sandbox's error. Empty while running or when unknown.
type ExitReasoner interface {
	ExitReason() string
}

// NICProvider is implemented by instances that have one virtual NIC whose
// far end is the network gateway (internal/gateway). The sandbox side of the
// link is configured as hostnet describes (address, gateway, resolver).
type NICProvider interface {
	// NIC returns a descriptor that carries the sandbox's Ethernet frames,
	// one frame per read and per write (a TAP device, or a datagram
	// socket). The caller owns it. Valid after Start or Restore while the
	// instance runs; calling it again (for a restarted gateway) returns a
	// new descriptor of the same link.
	NIC(ctx context.Context) (*os.File, error)
}

// SocketOwner is implemented by instances whose host can see, without
// trusting anything inside the sandbox, which executable holds one of its
// sockets (native: the host reads the sandbox's socket table and its
// processes' descriptors under /proc). Runtimes where only the sandbox's
// own kernel knows (gvisor, microvm) do not implement it: the field stays
// empty rather than be filled from anything the sandbox says.
type SocketOwner interface {
	// SocketOwner returns the executable (as its path reads in the
	// sandbox's filesystem) of a process of the sandbox that holds the
	// socket of protocol proto ("tcp") from local to remote, both as the
	// sandbox sees them; an error wrapping errdefs.ErrNotFound if none.
	SocketOwner(proto string, local, remote netip.AddrPort) (string, error)
}

// Pauser is implemented by instances that can stay resident without CPU.
type Pauser interface {
	Pause(ctx context.Context) error
	Resume(ctx context.Context) error
}

// Suspender is implemented by instances that can save their whole state —
// processes, memory, open files — to disk and then hold no host process or
// memory at all, and later continue exactly where they were.
type Suspender interface {
	// Suspend saves the running (or paused) instance into its own
	// directory and stops it. On error the instance keeps running as it
	// was: a failed checkpoint never costs the sandbox.
	Suspend(ctx context.Context) error
	// Restore continues a suspended instance from its saved image, also on
	// an instance from Runtime.Open after a server restart. It returns once
	// the agent's stream can be dialled; the image is removed afterwards.
	Restore(ctx context.Context) error
	// Suspended reports whether a saved image is waiting to be restored.
	Suspended() bool
}

// Forker is implemented by instances that can be cloned while running.
type Forker interface {
	// Fork checkpoints the running instance (which keeps running) and
	// creates and starts one new instance per spec from that checkpoint,
	// each with its own copy of the writable layer. On error no child is
	// left behind. The caller then tells each child's agent it was forked
	// (agentproto.PathRestored) so it reseeds entropy and its identity.
	Fork(ctx context.Context, children []Spec) ([]Instance, error)
}

// TemplatePreparer is implemented by runtimes that derive their own format
// from a template tree (a uid-shifted copy, a disk image). The template
// service (internal/templatesvc) calls PrepareTemplate when a template is
// imported, pulled or built, so that creating a
// sandbox never copies the template, and ForgetTemplate when garbage
// collection removes the tree. Both are idempotent; Create still derives on
// demand if PrepareTemplate was never called.
type TemplatePreparer interface {
	PrepareTemplate(ctx context.Context, treeDigest, rootfs string) error
	ForgetTemplate(ctx context.Context, treeDigest string) error
}

// Changes are a stopped instance's filesystem changes as an overlayfs upper
// directory readable by the host.
type Changes struct {
	// Dir is the upper directory: new and changed entries, whiteouts as 0/0
	// character devices, opaque directories marked by OpaqueXattr = "y".
	Dir         string
	OpaqueXattr string // "user.overlay.opaque" or "trusted.overlay.opaque"
	// IDBase is the host id of the sandbox's uid/gid 0; owners in Dir are
	// shifted by it (0 when they are not).
	IDBase uint32
	// Release unmounts whatever was mounted to expose Dir. Idempotent.
	Release func() error
}

// ChangeExporter is implemented by instances whose writable layer the host
// can read; template builds use it to capture what a RUN step changed. The
// instance must be stopped.
type ChangeExporter interface {
	Changes(ctx context.Context) (Changes, error)
}

// Check validates the configuration a factory got and returns the logger
// the runtime named name logs with (the configured one, or slog's default,
// tagged with the runtime's name).
func (c Config) Check(name string) (*slog.Logger, error) {
	if c.DataDir == "" || !filepath.IsAbs(c.DataDir) {
		return nil, fmt.Errorf("%s runtime needs an absolute DataDir, got %q: %w", name, c.DataDir, errdefs.ErrInvalidArgument)
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	return log.With("runtime", name), nil
}

// Factory builds a runtime from the server's configuration.
type Factory func(cfg Config) (Runtime, error)

var (
	mu        sync.Mutex
	factories = map[string]Factory{}
)

// Register makes a runtime available by name. Called from a backend's init.
func Register(name string, f Factory) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := factories[name]; dup {
		panic("runtime: duplicate registration of " + name)
	}
	factories[name] = f
}

// Names lists the registered runtimes, sorted.
func Names() []string {
	mu.Lock()
	defer mu.Unlock()
	var out []string
	for n := range factories {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// New builds the named runtime.
func New(name string, cfg Config) (Runtime, error) {
	mu.Lock()
	f, ok := factories[name]
	mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("unknown runtime %q (registered: %v): %w", name, Names(), errdefs.ErrInvalidArgument)
	}
	return f(cfg)
}

// Auto is the name of the pseudo-runtime that picks the strongest available one.
const Auto = "auto"

// PickAuto returns the strongest available runtime among rts.
func PickAuto(ctx context.Context, rts map[string]Runtime) (Runtime, error) {
	var best Runtime
	bestStrength := -1
	names := make([]string, 0, len(rts))
	for n := range rts {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c := rts[n].Probe(ctx)
		if c.Available && c.Strength > bestStrength {
			best, bestStrength = rts[n], c.Strength
		}
	}
	if best == nil {
		return nil, errors.New("no runtime is available on this host")
	}
	return best, nil
}

// NotSupported builds the error for a verb a runtime cannot do honestly,
// e.g. "runtime native cannot suspend: CRIU is not usable on this host".
func NotSupported(runtime, verb, why string) error {
	return fmt.Errorf("runtime %s cannot %s: %s: %w", runtime, verb, why, errdefs.ErrNotSupported)
}

// Mover is implemented by runtimes whose suspended instances can continue
// on another host: Export copies a suspended instance's whole state into a
// directory (shared storage), and Import, on another host with the same
// template, makes a suspended instance of the same id from it, which
// Restore continues like any other.
type Mover interface {
	// Export copies suspended inst (disk, image, the files its restore
	// needs) into dir, which must not exist yet; it is written beside dir
	// and renamed, so dir is complete or absent.
	Export(ctx context.Context, inst Instance, dir string) error
	// Import makes spec's instance from dir as Export wrote it; the
	// instance is suspended (its Suspended reports true).
	Import(ctx context.Context, spec Spec, dir string) (Instance, error)
}
