package jail

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// Jail uids and gids come from [UIDBase, UIDBase+UIDRange): far above the
// sandboxes' own mapped ranges (100000000 + 65536 per runtime) and every
// uid a distribution allocates.
const (
	UIDBase  = 200000000
	UIDRange = 1 << 24
)

// UID is the jail uid (and gid) of sandbox id: UIDBase plus the first 8
// bytes of sha256(id) modulo UIDRange. Deterministic, so a restarted server
// finds a running QEMU's uid again without storing it.
//
// Two ids can share a uid (a birthday collision: ~3% among 1000 sandboxes).
// That gives neither QEMU a way to the other: each sees only its own pid
// namespace (it cannot name the other to signal or ptrace it) and only its
// own files (its mount namespace); the uid is a second wall, not the only one.
func UID(id string) uint32 {
	sum := sha256.Sum256([]byte(id))
	return UIDBase + uint32(binary.BigEndian.Uint64(sum[:8])%UIDRange)
}

// DefaultPids bounds the jail's tasks when Limits.Pids is 0. QEMU runs one
// thread per vCPU plus its main loop, RCU, and a block thread pool of up to
// 64 workers: 128 leaves room for all of them and stops a fork bomb.
const DefaultPids = 128

// MinPids is the lowest pids limit a jail takes: until it execs QEMU, the
// jail stage is a Go program with a handful of threads, all counted, and
// one it cannot create kills it.
const MinPids = 16

// Limits are the host cgroup's limits for one QEMU.
type Limits struct {
	// MemoryBytes bounds QEMU's whole footprint: the guest's RAM plus
	// QEMU's own overhead (TCG's translation cache, device state); the
	// caller adds the overhead. Required.
	MemoryBytes int64
	// Pids bounds QEMU's threads; 0 means DefaultPids, else at least
	// MinPids.
	Pids int64
	// CPUs is the CPU quota in cores (vCPUs, or less). Required.
	CPUs float64
	// CPUWeight is the cgroup's CPU weight (v2 scale, 1..10000); 0 is the
	// default. A warm pool's member starts at the lowest.
	CPUWeight int
}

// Spec describes one jailed QEMU.
type Spec struct {
	// ID names the sandbox: the cgroup's name and the uid's seed.
	ID string
	// UID and GID the process runs as; 0 means UID(ID) (for both).
	UID, GID uint32
	// Argv is QEMU's command line; Argv[0] is an absolute path under one
	// of ReadOnly. It runs with an empty environment and cwd "/".
	Argv []string
	// ReadOnly paths are bound read-only (nosuid, nodev) at the same
	// absolute path inside the jail: QEMU's binary and libraries (see
	// QEMUPaths), the kernel, the initramfs, the root image. A path that
	// is a symlink on the host (/lib64 → usr/lib64 on merged-usr hosts) is
	// recreated as the same symlink; its target must be listed too. Each
	// must be readable by UID/GID.
	ReadOnly []string
	// Writable paths are bound read-write (nosuid, nodev, noexec) and
	// chowned, recursively, to UID:GID by Start: the sandbox's own
	// directory (disk, sockets, console log). Everything in a writable
	// directory is QEMU's to change: keep what the server must trust
	// (its records, pid files) elsewhere.
	Writable []string
	// Devices are character devices made (mknod, mode 0600, owned by
	// UID:GID) at the same path in the jail's /dev besides the ones
	// every QEMU gets: null, zero, urandom (0666). Typically /dev/kvm
	// when the accelerator is KVM.
	Devices []string
	// ExtraFiles become QEMU's descriptors 3, 4, … unchanged (an
	// -incoming fd:3 migration stream).
	ExtraFiles []*os.File
	// Limits of the host cgroup.
	Limits Limits
	// Stdout and Stderr receive QEMU's; nil discards. Pass an *os.File
	// (a log file) for a QEMU that must outlive the server: with any
	// other writer os/exec copies through a pipe that dies with it.
	Stdout, Stderr io.Writer
}

// baseDevices are the device nodes every jail has.
var baseDevices = []string{"/dev/null", "/dev/zero", "/dev/urandom"}

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$`)

// ValidID reports whether id can name a jail (a cgroup directory).
func ValidID(id string) bool { return idRE.MatchString(id) }

func invalid(format string, a ...any) error {
	return fmt.Errorf("jail: "+format+": %w", append(a, errdefs.ErrInvalidArgument)...)
}

// forbiddenRoots are host trees a bind must never expose: kernel
// interfaces with their own, wider, access rules.
var forbiddenRoots = []string{"/proc", "/sys", "/dev"}

func under(p, root string) bool {
	return p == root || strings.HasPrefix(p, root+"/")
}

// checkPath validates the form of one path of the spec.
func checkPath(kind, p string) error {
	switch {
	case p == "":
		return invalid("%s path is empty", kind)
	case !filepath.IsAbs(p):
		return invalid("%s path %q is relative", kind, p)
	case filepath.Clean(p) != p:
		return invalid("%s path %q is not clean", kind, p)
	case strings.ContainsRune(p, ','):
		// QEMU's option syntax splits on commas: a path QEMU names in
		// an option would be cut there.
		return invalid("%s path %q has a comma", kind, p)
	case strings.ContainsAny(p, "\x00\n"):
		return invalid("%s path %q has a NUL or newline", kind, p)
	case p == "/":
		return invalid("%s path is the host's root", kind)
	}
	if kind != "device" {
		for _, r := range forbiddenRoots {
			if under(p, r) {
				return invalid("%s path %q is under %s", kind, p, r)
			}
		}
	}
	return nil
}

// readableBy reports whether uid/gid may read (and, for a directory,
// search) a file with this stat.
func readableBy(st *unix.Stat_t, uid, gid uint32) bool {
	need := uint32(4)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		need = 5
	}
	perm := st.Mode & 0o7
	switch {
	case st.Uid == uid:
		perm = (st.Mode >> 6) & 0o7
	case st.Gid == gid:
		perm = (st.Mode >> 3) & 0o7
	}
	return perm&need == need
}

// normalize fills defaults and checks everything about s that can be
// checked on the host: forms, existence, types, permissions, limits.
func (s *Spec) normalize() error {
	if !ValidID(s.ID) {
		return invalid("id %q: want 1-100 of [A-Za-z0-9_.-], not starting with a punctuation mark", s.ID)
	}
	if s.UID == 0 {
		s.UID = UID(s.ID)
	}
	if s.GID == 0 {
		s.GID = s.UID
	}
	if s.Limits.MemoryBytes <= 0 {
		return invalid("memory limit %d: must be positive", s.Limits.MemoryBytes)
	}
	// 0.01 CPU is the smallest CFS quota (1 ms per 100 ms period).
	if !(s.Limits.CPUs >= 0.01) || s.Limits.CPUs > 1024 {
		return invalid("cpu limit %v: must be in [0.01, 1024]", s.Limits.CPUs)
	}
	if s.Limits.CPUWeight < 0 || s.Limits.CPUWeight > 10000 {
		return invalid("cpu weight %d: must be 0 (default) or in [1, 10000]", s.Limits.CPUWeight)
	}
	if s.Limits.Pids < 0 || (s.Limits.Pids > 0 && s.Limits.Pids < MinPids) {
		return invalid("pids limit %d: must be 0 (default %d) or at least %d", s.Limits.Pids, DefaultPids, MinPids)
	}
	if s.Limits.Pids == 0 {
		s.Limits.Pids = DefaultPids
	}
	if len(s.Argv) == 0 {
		return invalid("empty argv")
	}
	if err := checkPath("program", s.Argv[0]); err != nil {
		return err
	}
	seen := map[string]string{}
	for _, l := range []struct {
		kind  string
		paths []string
	}{{"read-only", s.ReadOnly}, {"writable", s.Writable}, {"device", s.Devices}} {
		for _, p := range l.paths {
			if err := checkPath(l.kind, p); err != nil {
				return err
			}
			if k, dup := seen[p]; dup {
				return invalid("path %q is both %s and %s", p, k, l.kind)
			}
			seen[p] = l.kind
			var st unix.Stat_t
			if err := unix.Lstat(p, &st); err != nil {
				return fmt.Errorf("jail: %s path %q: %w: %w", l.kind, p, err, errdefs.ErrNotFound)
			}
			isLink := st.Mode&unix.S_IFMT == unix.S_IFLNK
			switch l.kind {
			case "read-only":
				if isLink {
					continue // recreated as a link; its target is checked on its own
				}
				if t := st.Mode & unix.S_IFMT; t != unix.S_IFDIR && t != unix.S_IFREG {
					return invalid("read-only path %q is neither a directory nor a regular file", p)
				}
				if !readableBy(&st, s.UID, s.GID) {
					return fmt.Errorf("jail: read-only path %q (mode %o, owner %d:%d) is not readable by the jail's uid %d: %w",
						p, st.Mode&0o7777, st.Uid, st.Gid, s.UID, errdefs.ErrInvalidArgument)
				}
			case "writable":
				if isLink {
					return invalid("writable path %q is a symlink", p)
				}
				if t := st.Mode & unix.S_IFMT; t != unix.S_IFDIR && t != unix.S_IFREG {
					return invalid("writable path %q is neither a directory nor a regular file", p)
				}
			case "device":
				if !under(p, "/dev") || p == "/dev" {
					return invalid("device %q is not under /dev", p)
				}
				if st.Mode&unix.S_IFMT != unix.S_IFCHR {
					return invalid("device %q is not a character device", p)
				}
			}
		}
	}
	for _, d := range baseDevices {
		if seen[d] == "device" {
			return invalid("device %q is always there; do not list it", d)
		}
	}
	prog, err := filepath.EvalSymlinks(s.Argv[0])
	if err != nil {
		return fmt.Errorf("jail: program %q: %w: %w", s.Argv[0], err, errdefs.ErrNotFound)
	}
	if !coveredBy(prog, s.ReadOnly) {
		return invalid("program %q (%s) is under none of the read-only paths", s.Argv[0], prog)
	}
	return nil
}

// QEMUPaths lists the read-only paths a dynamically linked QEMU from a
// distribution package needs: /usr (binary, libraries, its modules under
// /usr/lib/<triplet>/qemu, firmware under /usr/share/qemu), the /lib,
// /lib64 and /lib32 links or directories that exist, /etc/ld.so.cache
// (faster library lookup), and the binary's own directory when it lives
// outside /usr. Measured with strace on Debian 12's QEMU 7.2: it opens
// nothing else it needs (it tries /sys/devices/system/node for NUMA and
// /proc/self for its own path and status, and works without them).
func QEMUPaths(qemu string) ([]string, error) {
	real, err := filepath.EvalSymlinks(qemu)
	if err != nil {
		return nil, fmt.Errorf("jail: qemu %q: %w: %w", qemu, err, errdefs.ErrNotFound)
	}
	out := []string{"/usr"}
	for _, p := range []string{"/lib", "/lib64", "/lib32", "/etc/ld.so.cache"} {
		if _, err := os.Lstat(p); err == nil {
			out = append(out, p)
		}
	}
	// A link's target outside the list (a /lib64 → /lib/x86_64… host)
	// must be bound too.
	for _, p := range []string{"/lib", "/lib64", "/lib32", filepath.Dir(real)} {
		if t, err := filepath.EvalSymlinks(p); err == nil && !coveredBy(t, out) {
			out = append(out, t)
		}
	}
	return out, nil
}

// coveredBy reports whether p is one of list or under one of them (as
// real paths).
func coveredBy(p string, list []string) bool {
	for _, l := range list {
		if r, err := filepath.EvalSymlinks(l); err == nil && under(p, r) {
			return true
		}
	}
	return false
}
