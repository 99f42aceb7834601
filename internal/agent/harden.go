package agent

import (
	"fmt"
	"os"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The agent is the one process of its sandbox that speaks for the host:
// what a command printed and how it exited reach the host (and the audit
// log) only through it. Code in the sandbox, even its root, must not read
// its memory or environment, take or follow its descriptors, or trace it.
//
// Non-dumpable does that on every kernel the agent runs on: the kernel then
// requires CAP_SYS_PTRACE in the agent's user namespace (which no sandbox
// process holds, see package confine) for ptrace, process_vm_readv,
// pidfd_getfd and the /proc/<agent>/ entries that expose the process
// (mem, maps, environ, auxv, fd/*, root, cwd, …), instead of merely the
// same uid. The processes the agent starts are dumpable again: execve
// resets the flag.

// EnvAgentFD names the agent's listening descriptor when --fd is not given
// (Main reads it before scrubbing it).
const EnvAgentFD = EnvPrefix + "AGENT_FD"

// EnvPrefix starts the names of the variables the runtimes used to pass to
// the agent; none may be visible in any process of the sandbox.
const EnvPrefix = "SPACE_"

// harden makes the calling process non-dumpable and scrubs its environment
// (see above). It runs before anything else in Main.
func harden() error {
	if err := setNonDumpable(); err != nil {
		return err
	}
	scrubEnv(EnvPrefix)
	return nil
}

// setNonDumpable clears the process's dumpable flag. The kernel sets it
// back to fs.suid_dumpable on every credential change (runAs switches a
// thread's), so runAs calls it again after switching back.
func setNonDumpable() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE, 0): %w", err)
	}
	return nil
}

// scrubEnv removes every variable starting with prefix from the process's
// environment: from Go's copy (os.Unsetenv) and from the bytes the kernel
// shows in /proc/<pid>/environ, the original area at the top of the stack,
// which unsetting does not touch. Go's environment strings point into that
// area, so each is overwritten in place with NULs before it is unset (a
// string that Setenv put on the heap is simply unset). Nothing reads those
// bytes afterwards: Go's os package forgets the variable, and the
// runtime's own copy is only consulted for GODEBUG-style settings.
func scrubEnv(prefix string) {
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, prefix) {
			continue
		}
		name, _, _ := strings.Cut(kv, "=")
		_ = os.Unsetenv(name)
		if onStack(kv) {
			b := unsafe.Slice(unsafe.StringData(kv), len(kv))
			clear(b)
		}
	}
}

// onStack reports whether s lies in the process's initial environment
// area (env_start…env_end of /proc/self/stat), the only memory scrubEnv
// may write through a string.
func onStack(s string) bool {
	start, end, ok := envArea()
	p := uintptr(unsafe.Pointer(unsafe.StringData(s)))
	return ok && p >= start && p+uintptr(len(s)) <= end
}

// envArea returns the bounds of the environment area the kernel shows in
// /proc/self/environ: fields 50 and 51 of /proc/self/stat (Linux 3.5+).
func envArea() (start, end uintptr, ok bool) {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0, 0, false
	}
	// Fields after the command name, which is parenthesised and may hold
	// spaces: field 3 is the first after the last ')'.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	const envStart, envEnd = 50 - 3, 51 - 3
	if len(f) <= envEnd {
		return 0, 0, false
	}
	var s, e uint64
	if _, err := fmt.Sscan(f[envStart], &s); err != nil {
		return 0, 0, false
	}
	if _, err := fmt.Sscan(f[envEnd], &e); err != nil {
		return 0, 0, false
	}
	return uintptr(s), uintptr(e), s != 0 && e > s
}
