// Command space is the space CLI and, as `space server`, the API server.
package main

import (
	"context"
	"os"

	"github.com/spacehq/space/internal/cli"
)

func main() {
	// Signals are handled per command: the server shuts down gracefully,
	// run and exec forward them to the process in the sandbox.
	os.Exit(cli.Execute(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
