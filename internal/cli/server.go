package cli

import (
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/internal/server"
)

func init() { extraCommands = append(extraCommands, newServerCmd) }

func newServerCmd(a *app) *cobra.Command {
	cfg := server.Config{}
	cmd := &cobra.Command{
		Use:   "server",
		Short: "Run the space API server and node services",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.DataDir == "" || cfg.CacheDir == "" || cfg.Listen == "" {
				return usagef("--data, --cache and --listen must not be empty")
			}
			cfg.Logger = slog.New(slog.NewTextHandler(a.errOut, nil))
			ctx, stop := signal.NotifyContext(a.ctx, os.Interrupt, syscall.SIGTERM)
			defer stop()
			return server.Run(ctx, cfg)
		},
	}
	cacheDefault := defaultCacheDir()
	cmd.Flags().StringVar(&cfg.DataDir, "data", DataDir(), "data directory (env SPACE_DATA)")
	cmd.Flags().StringVar(&cfg.Listen, "listen", "127.0.0.1:7070", "listen address host:port or unix:/path")
	cmd.Flags().StringVar(&cfg.CacheDir, "cache", cacheDefault, "cache directory for templates and kernels (env SPACE_CACHE)")
	cmd.Flags().Int64Var(&cfg.MaxTemplateBytes, "max-template-bytes", 8<<30, "limit on one template import or build step (unpacked bytes, and each compressed OCI layer)")
	cmd.Flags().BoolVar(&cfg.AllowPrivateRegistries, "allow-private-registries", false, "let template pulls reach loopback, private and link-local registry addresses")
	return cmd
}
