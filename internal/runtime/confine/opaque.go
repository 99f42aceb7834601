package confine

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// EnvPrefix starts the names of the variables the host uses to configure a
// sandbox's init stages (SPACE_GINIT_*, microvm's kernel command line);
// no process of the sandbox may see them in another's environment.
const EnvPrefix = "SPACE_"

// Opaque makes the calling process non-dumpable and scrubs EnvPrefix
// variables from its environment: the sandbox's init stages and the agent
// call it first thing. Non-dumpable, the kernel (and gVisor's sentry)
// requires CAP_SYS_PTRACE in the process's user namespace, which no
// sandbox process has, for ptrace, process_vm_readv, pidfd_getfd and the
// /proc/<pid>/ entries that expose a process (mem, maps, environ, fd/*,
// root, cwd), not just the same uid. execve makes a process dumpable
// again, so what it starts is not affected.
func Opaque() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE, 0): %w", err)
	}
	return ScrubEnv(EnvPrefix)
}

// ScrubEnv removes every variable starting with prefix from the process's
// environment: from Go's copy (os.Unsetenv) and from the bytes the kernel
// shows in /proc/<pid>/environ, the original area at the top of the stack,
// which unsetting does not touch (Go copies the environment at start, so
// nothing in Go points there). Those entries are overwritten with NULs
// through /proc/self/mem.
func ScrubEnv(prefix string) error {
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, prefix) {
			_ = os.Unsetenv(name)
		}
	}
	start, end, ok := envArea()
	if !ok {
		return nil // nothing the kernel shows
	}
	mem, err := os.OpenFile("/proc/self/mem", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("scrub environment: %w", err)
	}
	defer mem.Close()
	buf := make([]byte, end-start)
	if _, err := mem.ReadAt(buf, int64(start)); err != nil {
		return fmt.Errorf("scrub environment: read: %w", err)
	}
	changed := false
	for off := 0; off < len(buf); {
		n := bytes.IndexByte(buf[off:], 0)
		if n < 0 {
			n = len(buf) - off
		}
		if bytes.HasPrefix(buf[off:off+n], []byte(prefix)) {
			clear(buf[off : off+n])
			changed = true
		}
		off += n + 1
	}
	if !changed {
		return nil
	}
	if _, err := mem.WriteAt(buf, int64(start)); err != nil {
		return fmt.Errorf("scrub environment: write: %w", err)
	}
	return nil
}

// envArea returns the bounds of the environment area the kernel shows in
// /proc/self/environ: fields 50 and 51 of /proc/self/stat (Linux 3.5+).
func envArea() (start, end uint64, ok bool) {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0, 0, false
	}
	// Fields after the command name, which is parenthesised and may hold
	// spaces: field 3 is the first after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	const envStart, envEnd = 50 - 3, 51 - 3
	if len(f) <= envEnd {
		return 0, 0, false
	}
	s, err1 := strconv.ParseUint(f[envStart], 10, 64)
	e, err2 := strconv.ParseUint(f[envEnd], 10, 64)
	if err1 != nil || err2 != nil || s == 0 || e <= s || e-s > 1<<24 {
		return 0, 0, false
	}
	return s, e, true
}
