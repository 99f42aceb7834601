// Command space is the space CLI: a client of the API server over the SDK.
// The host-side commands, `space server` first, are handed to the
// space-server binary installed beside it (internal/cli, host.go), so this
// binary initialises no server package when it starts.
package main

import (
	"context"
	"os"

	"github.com/spacehq/space/internal/cli"
)

func main() {
	// Signals are handled per command: run and exec forward them to the
	// process in the sandbox; the server (in space-server) shuts down
	// gracefully.
	os.Exit(cli.Main(context.Background()))
}
