// Command space-gateway is the far end of every sandbox's virtual NIC
// (package gateway): one process per server, started, re-adopted and
// restarted by the server (gwctl.Supervisor) as an unprivileged user, that
// confines itself (no filesystem, seccomp) before serving. It is not meant
// to be run by hand.
package main

import (
	"fmt"
	"os"

	"github.com/spacehq/space/internal/gateway/gwctl"
)

func main() {
	if err := gwctl.Main(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "space-gateway:", err)
		os.Exit(1)
	}
}
