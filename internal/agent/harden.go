package agent

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
)

// The agent is the one process of its sandbox that speaks for the host:
// what a command printed and how it exited reach the host (and the audit
// log) only through it. Code in the sandbox, even its root, must not read
// its memory or environment, take or follow its descriptors, or trace it:
// harden makes it opaque (confine.Opaque: non-dumpable, no SPACE_*
// variables), and the runtimes keep its channel out of every path a
// sandbox process can reach (confine.HideChannel, native's inherited
// listener).

// EnvAgentFD names the agent's listening descriptor when --fd is not given
// (Main reads it before scrubbing it).
const EnvAgentFD = confine.EnvPrefix + "AGENT_FD"

// harden runs before anything else in Main.
func harden() error { return confine.Opaque() }

// setNonDumpable clears the process's dumpable flag again. The kernel sets
// it back to fs.suid_dumpable on every credential change (runAs switches a
// thread's); where a host sets that to 1, the agent would stay dumpable.
func setNonDumpable() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE, 0): %w", err)
	}
	return nil
}
