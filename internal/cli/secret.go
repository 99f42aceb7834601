package cli

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
)

// maxSecretInput bounds a secret value read from a file or stdin (the
// server's limit is 64 KiB; one byte more tells a too-large input apart).
const maxSecretInput = 64<<10 + 1

func init() { extraCommands = append(extraCommands, newSecretCmd) }

func newSecretCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "secret", Aliases: []string{"secrets"}, Short: "Manage secrets brokered to sandboxes (a sandbox only ever sees a placeholder)"}
	cmd.AddCommand(newSecretSetCmd(a), newSecretLsCmd(a), newSecretRmCmd(a), newSecretGrantCmd(a), newSecretRevokeCmd(a))
	return cmd
}

// secretInput is where `secret set` reads the value from.
type secretInput struct {
	fromFile, fromEnv string
}

// read returns the value: a file's bytes as they are, an env var's value,
// or stdin without one trailing newline (what `echo v | …` adds).
func (in secretInput) read(stdin io.Reader) ([]byte, error) {
	switch {
	case in.fromFile != "" && in.fromEnv != "":
		return nil, usagef("--from-file and --from-env: give one (or neither, to read stdin)")
	case in.fromFile != "":
		f, err := os.Open(in.fromFile)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return io.ReadAll(io.LimitReader(f, maxSecretInput))
	case in.fromEnv != "":
		v, ok := os.LookupEnv(in.fromEnv)
		if !ok || v == "" {
			return nil, usagef("--from-env %s: the variable is not set or empty", in.fromEnv)
		}
		return []byte(v), nil
	default:
		b, err := io.ReadAll(io.LimitReader(stdin, maxSecretInput))
		if err != nil {
			return nil, err
		}
		b = bytes.TrimSuffix(b, []byte("\n"))
		return bytes.TrimSuffix(b, []byte("\r")), nil
	}
}

func newSecretSetCmd(a *app) *cobra.Command {
	var in secretInput
	var hosts []string
	var header string
	cmd := &cobra.Command{
		Use:   "set NAME [--from-file F | --from-env VAR] [--hosts a.example.com,*.example.org] [--header 'Authorization: Bearer {}']",
		Short: "Create or rotate a secret (the value is read from a file, an env var or stdin, never from an argument)",
		Long: "Create or rotate a secret. Sandboxes granted it see only a placeholder in the env var NAME; the network\n" +
			"gateway replaces it with the value only on requests to --hosts (or sets --header there, {} standing for\n" +
			"the value). The sandbox's network policy must also allow those hosts. Rotation reaches every sandbox\n" +
			"holding the secret from its next request on.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			val, err := in.read(a.in)
			if err != nil {
				return err
			}
			if len(val) == 0 {
				return usagef("the secret's value is empty")
			}
			req := api.SetSecretRequest{Header: header}
			for _, h := range hosts {
				for _, p := range strings.Split(h, ",") {
					if p = strings.TrimSpace(p); p != "" {
						req.Hosts = append(req.Hosts, p)
					}
				}
			}
			if utf8.Valid(val) {
				s := string(val)
				req.Value = &s
			} else {
				s := base64.StdEncoding.EncodeToString(val)
				req.ValueBase64 = &s
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			sec, err := c.SetSecret(a.ctx, args[0], req)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, sec)
			}
			fmt.Fprintf(a.out, "%s version %d\n", sec.Name, sec.Version)
			return nil
		},
	}
	cmd.Flags().StringVar(&in.fromFile, "from-file", "", "read the value from this file (as is)")
	cmd.Flags().StringVar(&in.fromEnv, "from-env", "", "read the value from this environment variable")
	cmd.Flags().StringArrayVar(&hosts, "hosts", nil, `names and "*.suffix" patterns the value may be sent to (comma-separated, repeatable)`)
	cmd.Flags().StringVar(&header, "header", "", `header set on requests to the hosts, {} standing for the value, e.g. 'Authorization: Bearer {}'`)
	return cmd
}

func newSecretLsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls [ID]",
		Aliases: []string{"list"},
		Short:   "List your secrets (never their values), or the secrets granted to sandbox ID",
		Args:    cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if len(args) == 1 {
				gs, err := c.SandboxSecrets(a.ctx, args[0])
				if err != nil {
					return err
				}
				if a.json {
					return printJSON(a.out, gs)
				}
				t := newTable(a.out, "NAME", "PLACEHOLDER", "GRANTED")
				for _, g := range gs {
					t.row(g.Name, g.Placeholder, ago(time.Now(), g.CreatedAt))
				}
				return t.flush()
			}
			list, err := c.ListSecrets(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, list)
			}
			t := newTable(a.out, "NAME", "VERSION", "HOSTS", "HEADER", "UPDATED")
			for _, s := range list {
				hdr := s.Header
				if name, _, ok := strings.Cut(hdr, ":"); ok {
					hdr = name // the template is the operator's; the name says enough here
				}
				t.row(s.Name, fmt.Sprint(s.Version), orDash(strings.Join(s.Hosts, ",")), orDash(hdr), ago(time.Now(), s.UpdatedAt))
			}
			return t.flush()
		},
	}
}

func newSecretRmCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME...",
		Aliases: []string{"delete"},
		Short:   "Delete secrets (and every grant of them)",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			for _, n := range args {
				if err := c.DeleteSecret(a.ctx, n); err != nil {
					return err
				}
				fmt.Fprintln(a.out, n)
			}
			return nil
		},
	}
}

func newSecretGrantCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "grant ID NAME...",
		Short: "Grant secrets to a sandbox: its env var NAME holds a placeholder from its next command on",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			var out []*api.SecretGrant
			for _, n := range args[1:] {
				g, err := c.GrantSecret(a.ctx, args[0], n)
				if err != nil {
					return err
				}
				out = append(out, g)
			}
			if a.json {
				return printJSON(a.out, out)
			}
			for _, g := range out {
				fmt.Fprintf(a.out, "%s=%s\n", g.Name, g.Placeholder)
			}
			return nil
		},
	}
}

func newSecretRevokeCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID NAME...",
		Short: "Revoke secrets from a sandbox (the gateway stops substituting them from the next request on)",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			for _, n := range args[1:] {
				if err := c.RevokeSecret(a.ctx, args[0], n); err != nil {
					return err
				}
			}
			return nil
		},
	}
}
