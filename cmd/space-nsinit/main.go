// Command space-nsinit is the native runtime's sandbox init, the first
// stage of every native sandbox: started by the host in the sandbox's new
// namespaces, it builds the sandbox around itself (nsinit.Setup: mounts,
// pivot_root, package confine's policy) and execs space-agent, which the
// host passed as a descriptor (nsinit.FDAgentExe).
//
// It is the same code as `space-agent init-native`, in a binary of a
// third of the size with a fifth of the package initialisers, because the
// time until it runs is on the path of every create: the agent must be
// exec'd after setup anyway (Landlock ABI ≤ 7 restricts only the calling
// thread), so the first Go start-up might as well be a small one. The
// runtime uses it when it lies next to space-agent and falls back to
// `space-agent init-native` otherwise.
package main

import (
	"fmt"
	"os"

	"github.com/spacehq/space/internal/runtime/native/nsinit"
)

func main() {
	if len(os.Args) != 2 || os.Args[1] != nsinit.RoleSetup {
		fmt.Fprintf(os.Stderr, "space-nsinit: only the native runtime runs this, as `space-nsinit %s`\n", nsinit.RoleSetup)
		os.Exit(2)
	}
	err := nsinit.Setup()
	if err == nil {
		err = fmt.Errorf("returned without starting the agent")
	}
	fmt.Fprintf(os.Stderr, "space-nsinit: sandbox setup: %v\n", err)
	os.Exit(125)
}
