package cli

// Host-side commands. Every other file of this package is a client of a
// server through the SDK (and the types of package api) only; the two
// actions here run this machine's own packages instead, because they are
// what a host administrator does on the host itself:
//
//   - `space server` runs the server (internal/server);
//   - `space template build-base --local` builds the cached base root
//     filesystem with debootstrap (internal/template), without a server —
//     what scripts/setup.sh does on a fresh machine.
//
// TestClientCommandsUseOnlySDK keeps it that way.

import (
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/sdk"
)

func init() { extraCommands = append(extraCommands, newServerCmd) }

// buildBaseLocal builds only the cached base root filesystem in cacheDir,
// with the same progress display as a build through a server.
func (a *app) buildBaseLocal(cacheDir string) error {
	var rootfs string
	_, err := a.buildBase(func(progress func(sdk.BuildProgress)) (*api.Template, error) {
		var err error
		rootfs, err = template.BuildBase(a.ctx, cacheDir, func(p template.Progress) {
			progress(sdk.BuildProgress{Phase: p.Phase, Done: int64(p.Done), Total: int64(p.Total), Message: p.Message})
		})
		return nil, err
	})
	if err != nil {
		return err
	}
	fmt.Fprintln(a.out, "base root filesystem ready:", rootfs)
	return nil
}

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
