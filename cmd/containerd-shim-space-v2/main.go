// Command containerd-shim-space-v2 is containerd's runtime v2 shim for
// space (runtime type io.containerd.space.v2): see internal/shim.
package main

import (
	"fmt"
	"os"

	"github.com/spacehq/space/internal/shim"
)

func main() {
	if err := shim.Main(os.Args[1:], os.Stdin, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "containerd-shim-space-v2:", err)
		os.Exit(1)
	}
}
