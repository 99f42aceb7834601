package cli

import (
	"errors"
	"io"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/spf13/cobra"

	"github.com/spacehq/space/internal/mcpserver"
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
			c, err := a.Client()
			if err != nil {
				return err
			}
			srv := mcpserver.New(c, mcpserver.Options{})
			err = srv.Run(a.ctx, &mcp.IOTransport{Reader: io.NopCloser(a.in), Writer: nopWriteCloser{a.out}})
			// The client closing stdin is how a stdio session ends.
			if errors.Is(err, io.EOF) || errors.Is(err, mcp.ErrConnectionClosed) || a.ctx.Err() != nil {
				return nil
			}
			return err
		},
	}
}

type nopWriteCloser struct{ io.Writer }

func (nopWriteCloser) Close() error { return nil }
