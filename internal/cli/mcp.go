package cli

import (
	"github.com/spf13/cobra"
)

func newMCPCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "mcp",
		Short: "Serve space's tools to an MCP client over stdio",
		Long: "mcp is a Model Context Protocol server on stdin/stdout for MCP clients (Claude Desktop, IDEs, agent\n" +
			"frameworks) that start their servers as commands. Its tools create sandboxes, run commands, move files,\n" +
			"expose ports and drive the lifecycle, through the server this CLI is configured for (--url, --api-key,\n" +
			"SPACE_URL, SPACE_API_KEY, the key file). Nothing but the protocol is written to stdout. The server also\n" +
			"serves the same tools over HTTP at /mcp. See docs/mcp.md.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// The MCP protocol and JSON-schema packages are linked only
			// into space-server (host.go): a long-lived stdio server does
			// not need the client's start-up.
			if a.host == nil || a.host.MCP == nil {
				return a.handOff()
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			return a.host.MCP(a.ctx, c, a.in, a.out)
		},
	}
}
