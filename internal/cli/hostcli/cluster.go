package hostcli

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/internal/cli"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/secrets"
)

// newClusterCmd is `space cluster`: the cluster CA and the certificates of
// its nodes and replicas (the mutual TLS between them, internal/clustertls).
// SecretsKeyFile is the cluster secrets key `space cluster ca` writes
// beside the CA (made once; an existing one is kept).
const SecretsKeyFile = "secrets.key"

func newClusterCmd(e cli.Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Make a cluster's CA and its nodes' and replicas' certificates",
	}
	var validity time.Duration
	ca := &cobra.Command{
		Use:   "ca DIR",
		Short: "Create the cluster CA in DIR (ca.crt, and ca.key mode 0600); an existing one is never overwritten",
		Args:  cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if err := clustertls.NewCA(args[0], validity); err != nil {
				return err
			}
			if _, err := secrets.LoadKey(filepath.Join(args[0], SecretsKeyFile)); err != nil {
				return err
			}
			fmt.Fprintf(e.Out, "cluster CA: %s/%s (give it to every node and replica); keep %s/%s offline\n", args[0], clustertls.CACertFile, args[0], clustertls.CAKeyFile)
			fmt.Fprintf(e.Out, "cluster secrets key: %s/%s (mode 0600; give it to every node and replica as --cluster-secrets-key)\n", args[0], SecretsKeyFile)
			return nil
		},
	}
	ca.Flags().DurationVar(&validity, "validity", 10*365*24*time.Hour, "how long the CA is valid")
	var caDir, role, out string
	var hosts []string
	var certValidity time.Duration
	cert := &cobra.Command{
		Use:   "cert NAME",
		Short: "Issue a node's or a replica's certificate (OUT.crt, OUT.key) from the cluster CA",
		Long: "Issue a certificate naming space://<role>/NAME. A node's NAME is its --node-id and its --host " +
			"values the addresses in its --advertise URL; a replica needs no host.",
		Args: cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if caDir == "" || role == "" {
				return usagef("--ca-dir and --role are required")
			}
			if out == "" {
				out = args[0]
			}
			if err := clustertls.Issue(caDir, role, args[0], hosts, out, certValidity); err != nil {
				return cli.UsageError(err)
			}
			fmt.Fprintf(e.Out, "%s %s: %s.crt %s.key\n", role, args[0], out, out)
			return nil
		},
	}
	cert.Flags().StringVar(&caDir, "ca-dir", "", "the cluster CA's directory (space cluster ca)")
	cert.Flags().StringVar(&role, "role", "", "node or replica")
	cert.Flags().StringSliceVar(&hosts, "host", nil, "an IP address or DNS name the node is reached at (repeatable)")
	cert.Flags().StringVar(&out, "out", "", "output path without extension (default NAME)")
	cert.Flags().DurationVar(&certValidity, "validity", 365*24*time.Hour, "how long the certificate is valid")
	cmd.AddCommand(ca, cert)
	return cmd
}
