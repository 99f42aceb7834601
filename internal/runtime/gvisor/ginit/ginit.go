// Package ginit runs inside space-agent when the gvisor runtime starts it as
// a sandbox's init (`space-agent init-gvisor`, Role). It puts the agent in a
// user namespace of its own inside gVisor, as native does on the host:
// sandbox root is then uid confine.IDBase of the sentry's root namespace,
// its capabilities are confined to that namespace, and /proc/self/uid_map
// says so.
//
// Main is the container's init (root of the sentry's root user
// namespace). It starts its own binary again as `space-agent confine` in a
// new user and pid namespace with ids 0..65535 mapped to confine.IDBase…,
// then waits for it and exits with its status, so the sandbox ends when the
// agent does. Meanwhile it is the sandbox's OOM killer when the runtime set
// EnvMemoryLimit (oom.go): gVisor enforces no memory limit inside. The
// confine stage (confine.Self) confines itself by package confine's policy
// and serves as the agent.
//
// The host maps the template (an id-mapped mount) and the writable layer to
// confine.IDBase, so files are owned by root inside.
package ginit

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
)

// Role is the first argument of space-agent that makes it a gvisor
// sandbox's init. Main starts the agent as confine.Role.
const Role = "init-gvisor"

// envPrefix starts the names of this package's variables (the memory
// guard's settings), which the agent does not get.
const envPrefix = "SPACE_GINIT_"

// Main is Role: it runs the agent with agentArgs confined in its own
// namespaces, and exits with its status.
func Main(agentArgs []string) {
	os.Exit(outer(agentArgs))
}

func outer(agentArgs []string) int {
	// The agent handles termination signals itself; this process only
	// waits, so it ignores them (as PID 1 it gets only those it handles).
	signal.Ignore(unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE)
	var guard *memoryGuard
	if limit, _ := strconv.ParseUint(os.Getenv(EnvMemoryLimit), 10, 64); limit > 0 {
		guard = newMemoryGuard(limit, os.Getenv(EnvOOMDir))
	}
	// The agent's pid namespace cannot see this process; it is opaque all
	// the same (non-dumpable, its SPACE_GINIT_* settings scrubbed), as the
	// agent is.
	if err := confine.Opaque(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: gvisor init:", err)
		return 125
	}
	cmd := exec.Command("/proc/self/exe", append([]string{confine.Role}, agentArgs...)...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = withoutGuard(os.Environ())
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// A mount namespace of its own, so that it can mount the /proc of
		// its pid namespace.
		Cloneflags:                 unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNS,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: confine.IDBase, Size: confine.IDSize}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: confine.IDBase, Size: confine.IDSize}},
		GidMappingsEnableSetgroups: true,
		Credential:                 &syscall.Credential{Uid: 0, Gid: 0},
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: gvisor init: starting the agent in its user namespace:", err)
		return 125
	}
	if guard != nil {
		guard.start(cmd.Process.Pid)
	}
	err := cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	if err != nil {
		return 125
	}
	return 0
}

// withoutGuard drops this package's variables (the memory guard's
// settings) from env.
func withoutGuard(env []string) []string {
	out := env[:0:0]
	for _, e := range env {
		if strings.HasPrefix(e, envPrefix) {
			continue
		}
		out = append(out, e)
	}
	return out
}
