package cli

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
)

func init() {
	extraCommands = append(extraCommands, newKeyCmd, newTenantCmd)
}

func newKeyCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "key", Aliases: []string{"keys"}, Short: "Create, list and revoke API keys (admin)"}
	var name, tenant string
	var scopes []string
	create := &cobra.Command{
		Use:   "create --name NAME --scope S[,S…] [--tenant T]",
		Short: "Create an API key; it is printed once and never shown again",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if name == "" {
				return usagef("--name is required")
			}
			if len(scopes) == 0 {
				return usagef("--scope is required (e.g. sandbox:write,exec:write,files:read; admin for everything)")
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			k, err := c.CreateKey(a.ctx, api.CreateKeyRequest{Name: name, Tenant: tenant, Scopes: scopes})
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, k)
			}
			fmt.Fprintln(a.out, k.Key)
			fmt.Fprintf(a.errOut, "space: key %s (%s) for tenant %s with %s — store it now, it is not shown again\n",
				k.ID, k.Name, k.Tenant, strings.Join(k.Scopes, ","))
			return nil
		},
	}
	create.Flags().StringVar(&name, "name", "", "a name for the key")
	create.Flags().StringVar(&tenant, "tenant", "", `the tenant it acts for (default "default")`)
	create.Flags().StringSliceVar(&scopes, "scope", nil, "scopes, comma-separated or repeated")

	var lsTenant string
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List API keys (never their secrets)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			keys, err := c.ListKeys(a.ctx, lsTenant)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, keys)
			}
			now := time.Now()
			t := newTable(a.out, "ID", "NAME", "TENANT", "SCOPES", "PREFIX", "CREATED", "LAST USED", "STATUS")
			for _, k := range keys {
				used, status := "-", "active"
				if k.LastUsedAt != nil {
					used = ago(now, *k.LastUsedAt)
				}
				if k.RevokedAt != nil {
					status = "revoked " + ago(now, *k.RevokedAt)
				}
				t.row(k.ID, k.Name, k.Tenant, strings.Join(k.Scopes, ","), k.Prefix+"…", ago(now, k.CreatedAt), used, status)
			}
			return t.flush()
		},
	}
	ls.Flags().StringVar(&lsTenant, "tenant", "", "only this tenant's keys")

	revoke := &cobra.Command{
		Use:   "revoke ID",
		Short: "Revoke an API key; it stops working at once",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			k, err := c.RevokeKey(a.ctx, args[0])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, k)
			}
			fmt.Fprintln(a.out, k.ID)
			return nil
		},
	}
	cmd.AddCommand(create, ls, revoke)
	return cmd
}

func newTenantCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "tenant", Aliases: []string{"tenants"}, Short: "Show and set tenants' quotas and network boundaries"}
	get := &cobra.Command{
		Use:   "get NAME",
		Short: "Show a tenant's quotas, boundary and usage",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := c.Tenant(a.ctx, args[0])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, t)
			}
			return printTenants(a, []api.Tenant{*t})
		},
	}
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List tenants (admin)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			ts, err := c.ListTenants(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, ts)
			}
			return printTenants(a, ts)
		},
	}
	var q api.Quotas
	var memory, disk string
	var boundaryFile string
	var noBoundary bool
	set := &cobra.Command{
		Use:   "set NAME [--sandboxes N] [--cpus N] [--memory 8G] [--disk 100G] [--boundary FILE.json | --no-boundary]",
		Short: "Set a tenant's quotas (0 = unlimited) and network boundary (admin); unset flags keep their value",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := c.Tenant(a.ctx, args[0])
			if err != nil {
				return err
			}
			fl := cmd.Flags()
			if fl.Changed("sandboxes") {
				t.Quotas.Sandboxes = q.Sandboxes
			}
			if fl.Changed("cpus") {
				t.Quotas.CPUs = q.CPUs
			}
			for _, m := range []struct {
				flag, v string
				dst     *int64
			}{{"memory", memory, &t.Quotas.MemoryMiB}, {"disk", disk, &t.Quotas.DiskMiB}} {
				if !fl.Changed(m.flag) {
					continue
				}
				n, err := parseMiB(m.v)
				if err != nil {
					return usagef("--%s %q: %v", m.flag, m.v, err)
				}
				*m.dst = n
			}
			switch {
			case noBoundary:
				t.Boundary = nil
			case boundaryFile != "":
				b, err := os.ReadFile(boundaryFile)
				if err != nil {
					return err
				}
				var p api.NetworkPolicy
				dec := json.NewDecoder(strings.NewReader(string(b)))
				dec.DisallowUnknownFields()
				if err := dec.Decode(&p); err != nil {
					return usagef("--boundary %s: not a network policy (JSON: allow_out, deny_out, internet, allow_private, rules, egress_proxy): %v", boundaryFile, err)
				}
				t.Boundary = &p
			}
			t.Usage, t.UpdatedAt = nil, nil
			t, err = c.SetTenant(a.ctx, *t)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, t)
			}
			return printTenants(a, []api.Tenant{*t})
		},
	}
	set.Flags().IntVar(&q.Sandboxes, "sandboxes", 0, "most sandboxes at once")
	set.Flags().Float64Var(&q.CPUs, "cpus", 0, "most CPU cores of all its sandboxes' limits together")
	set.Flags().StringVar(&memory, "memory", "", "most memory of all its sandboxes' limits together (e.g. 8G, 512M)")
	set.Flags().StringVar(&disk, "disk", "", "most disk of all its sandboxes' limits together")
	set.Flags().StringVar(&boundaryFile, "boundary", "", "a JSON network policy: the widest any of its sandboxes may have")
	set.Flags().BoolVar(&noBoundary, "no-boundary", false, "remove the boundary")
	cmd.AddCommand(get, ls, set)
	return cmd
}

func printTenants(a *app, ts []api.Tenant) error {
	quota := func(used, max string, unlimited bool) string {
		if unlimited {
			return used + " (no quota)"
		}
		return used + " / " + max
	}
	t := newTable(a.out, "TENANT", "SANDBOXES", "CPUS", "MEMORY MiB", "DISK MiB", "BOUNDARY")
	for _, tn := range ts {
		u := api.Usage{}
		if tn.Usage != nil {
			u = *tn.Usage
		}
		q := tn.Quotas
		b := "none"
		if tn.Boundary != nil {
			b = policySummary(*tn.Boundary)
		}
		t.row(tn.Name,
			quota(strconv.Itoa(u.Sandboxes), strconv.Itoa(q.Sandboxes), q.Sandboxes == 0),
			quota(strconv.FormatFloat(u.CPUs, 'g', -1, 64), strconv.FormatFloat(q.CPUs, 'g', -1, 64), q.CPUs == 0),
			quota(strconv.FormatInt(u.MemoryMiB, 10), strconv.FormatInt(q.MemoryMiB, 10), q.MemoryMiB == 0),
			quota(strconv.FormatInt(u.DiskMiB, 10), strconv.FormatInt(q.DiskMiB, 10), q.DiskMiB == 0),
			b)
	}
	return t.flush()
}
