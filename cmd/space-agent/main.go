// Command space-agent is the small static program inside every sandbox. It
// runs processes, serves files and reaps zombies; see internal/agent.
//
// What it is to do is said by its first argument, never guessed from its
// environment:
//
//	space-agent [flags]               the agent (internal/agent); flags
//	                                  start with "-", so no role word is
//	                                  ever taken for one
//	space-agent init-native           the native runtime's sandbox init
//	                                  (nsinit.Setup): builds the sandbox
//	                                  around itself (mounts, pivot_root,
//	                                  package confine's policy) and execs
//	                                  the agent; the runtime prefers the
//	                                  smaller cmd/space-nsinit when it is
//	                                  installed next to this binary
//	space-agent probe-native          the native runtime's probe (nsinit)
//	space-agent init-gvisor [flags]   a gvisor sandbox's container init
//	                                  (ginit.Main): starts `confine` in a
//	                                  user namespace of its own and waits
//	space-agent confine [flags]       the agent of a sandbox with a kernel
//	                                  of its own, started by init-gvisor or
//	                                  init-microvm in its namespaces: it
//	                                  confines itself (confine.Self), then
//	                                  serves
//	/init init-microvm                a microvm guest's init (vminit.Main),
//	                                  PID 1 only: the host's kernel command
//	                                  line ends with "-- init-microvm",
//	                                  which the kernel passes to init as
//	                                  its arguments
//	space-agent hold-userns           host side: holds a user namespace
//	                                  open for id-mapped mounts until its
//	                                  stdin closes (hostfs.OpenUserns)
//
// The host-side QEMU jailer is another binary, space-jail: nothing that
// runs as host root ships inside the sandbox.
package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/gvisor/ginit"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/microvm/vminit"
	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

func main() {
	args := os.Args[1:]
	role := ""
	if len(args) > 0 {
		role = args[0]
	}
	switch role {
	case nsinit.RoleSetup:
		fail("sandbox setup", nsinit.Setup())
	case nsinit.RoleProbe:
		fail("native probe", nsinit.Probe())
	case ginit.Role:
		ginit.Main(args[1:])
	case vminit.Role:
		args = vminit.Main()
	case confine.Role:
		var err error
		if args, err = confine.Self(args[1:]); err != nil {
			fail("confine", err)
		}
	case hostfs.HoldArg:
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	default:
		if role != "" && !strings.HasPrefix(role, "-") {
			fmt.Fprintf(os.Stderr, "space-agent: unknown role %q (see the command's package doc)\n", role)
			os.Exit(2)
		}
	}
	if err := agent.Main(args); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent:", err)
		os.Exit(1)
	}
}

// fail ends a stage that returns only on failure.
func fail(stage string, err error) {
	if err == nil {
		err = fmt.Errorf("returned without starting the agent")
	}
	fmt.Fprintf(os.Stderr, "space-agent: %s: %v\n", stage, err)
	os.Exit(125)
}
