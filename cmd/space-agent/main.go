// Command space-agent is the small static program inside every sandbox. It
// runs processes, serves files and reaps zombies; see internal/agent.
//
// When a runtime starts it as a sandbox's init (internal/runtime/native),
// nsinit.Enter first finishes building the sandbox around it (mounts,
// pivot_root, seccomp, Landlock) and only then does the agent start serving.
// Under the gvisor runtime, ginit.Enter first moves it into a user
// namespace of its own inside gVisor. As the init of a microvm guest,
// vminit.Enter first mounts the kernel filesystems, loads the guest's
// modules and finds the virtio-serial port the agent serves on. Started by
// the microvm runtime's jailer (package jail), it is not the agent at all:
// jail.Enter builds QEMU's jail and execs QEMU.
package main

import (
	"fmt"
	"os"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
	"github.com/spacehq/space/internal/runtime/microvm/vminit"
	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

func main() {
	jail.Enter()
	args := os.Args[1:]
	if vmArgs := vminit.Enter(); vmArgs != nil {
		args = vmArgs
	}
	if err := ginit.Enter(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: gvisor init:", err)
		os.Exit(125)
	}
	if err := nsinit.Enter(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent: sandbox setup:", err)
		os.Exit(125)
	}
	if err := agent.Main(args); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent:", err)
		os.Exit(1)
	}
}
