// Command space-server is the whole space CLI, host-side commands included:
// `space-server server` runs the API server. The space client binary hands
// its host-side commands (`space server`, `space template build-base
// --local`, `space policy test`, `space mcp`) to this binary installed
// beside it, so `space server` keeps working while the client links none
// of the server's packages.
package main

import (
	"context"
	"os"

	"github.com/spacehq/space/internal/cli/hostcli"
)

func main() {
	os.Exit(hostcli.Main(context.Background()))
}
