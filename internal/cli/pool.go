package cli

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
)

func init() { extraCommands = append(extraCommands, newPoolCmd) }

// newPoolCmd is `space pool`: warm pools of ready sandboxes (admin).
func newPoolCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "pool", Aliases: []string{"pools"}, Short: "Keep sandboxes ready ahead of demand (warm pools; admin)"}
	var (
		spec         api.PoolSpec
		memory, disk string
	)
	set := &cobra.Command{
		Use:   "set TEMPLATE [--runtime R] [--cpus N --memory 512M --disk 2G] --min N --max M",
		Short: "Create or update the pool of TEMPLATE on a runtime with a shape (--min 0 --max 0 drains it)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec.Template = args[0]
			for _, m := range []struct {
				flag, v string
				dst     *int64
			}{{"memory", memory, &spec.Limits.MemoryMiB}, {"disk", disk, &spec.Limits.DiskMiB}} {
				if m.v == "" {
					continue
				}
				n, err := parseMiB(m.v)
				if err != nil {
					return usagef("--%s %q: %v", m.flag, m.v, err)
				}
				*m.dst = n
			}
			if !cmd.Flags().Changed("max") {
				spec.Max = max(spec.Min, spec.Max)
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			p, err := c.SetPool(a.ctx, spec)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, p)
			}
			return printPools(a, []api.Pool{*p})
		},
	}
	fl := set.Flags()
	fl.StringVar(&spec.Runtime, "runtime", "auto", "runtime of the members (auto: the strongest available)")
	fl.Float64Var(&spec.Limits.CPUs, "cpus", 0, "CPU limit of the members (default: the server's)")
	fl.StringVar(&memory, "memory", "", "memory limit of the members, e.g. 512m (default: the server's)")
	fl.StringVar(&disk, "disk", "", "disk limit of the members, e.g. 2g (default: the server's)")
	fl.Int64Var(&spec.Limits.Pids, "pids", 0, "task limit of the members (default: the server's)")
	fl.StringVar(&spec.IdleMode, "idle", "", "how members wait: running or paused (default: the runtime's choice)")
	fl.IntVar(&spec.Min, "min", 1, "members kept ready at least")
	fl.IntVar(&spec.Max, "max", 0, "members kept ready at most when misses raise the target (default: --min)")
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List pools: ready members, hits, misses, refill time",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			ps, err := c.ListPools(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, ps)
			}
			return printPools(a, ps)
		},
	}
	rm := &cobra.Command{
		Use:   "rm ID",
		Short: "Delete a pool and destroy its members",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			return c.DeletePool(a.ctx, args[0])
		},
	}
	cmd.AddCommand(set, ls, rm)
	return cmd
}

// printPools prints one row per pool; through a cluster replica, whose
// counts are the nodes' sums, a NODES column gives each node's ready
// members.
func printPools(a *app, ps []api.Pool) error {
	cols := []string{"ID", "TEMPLATE", "RUNTIME", "SHAPE", "READY", "TARGET", "MIN-MAX", "HITS", "MISSES", "REFILL", "IDLE", "ERROR"}
	cluster := slices.ContainsFunc(ps, func(p api.Pool) bool { return len(p.Nodes) > 0 })
	if cluster {
		cols = append(cols, "NODES")
	}
	t := newTable(a.out, cols...)
	for _, p := range ps {
		l := p.Spec.Limits
		row := []string{p.ID, p.Spec.Template, p.Runtime, fmt.Sprintf("cpus=%g mem=%dMiB disk=%dMiB", l.CPUs, l.MemoryMiB, l.DiskMiB),
			strconv.Itoa(p.Ready) + "+" + strconv.Itoa(p.Filling), strconv.Itoa(p.Target), fmt.Sprintf("%d-%d", p.Spec.Min, p.Spec.Max),
			strconv.FormatInt(p.Hits, 10), strconv.FormatInt(p.Misses, 10), fmt.Sprintf("%.0fms", p.LastRefillMS), p.IdleMode, p.LastError}
		if cluster {
			var on []string
			for _, n := range p.Nodes {
				on = append(on, n.Node+":"+strconv.Itoa(n.Ready))
			}
			row = append(row, strings.Join(on, " "))
		}
		t.row(row...)
	}
	return t.flush()
}
