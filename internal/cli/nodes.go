package cli

import (
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
)

// `space nodes`: a cluster's nodes as a replica sees them, and draining
// one for maintenance (no new sandboxes; its own keep running).

func newNodesCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "nodes", Short: "List a cluster's nodes (through a replica), drain and undrain them", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			nodes, err := c.Nodes(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, nodes)
			}
			t := newTable(a.out, "NODE", "STATE", "SANDBOXES", "CPUS", "MEM FREE", "HEARTBEAT", "ADDRESS", "REASON")
			now := time.Now()
			for _, n := range nodes {
				t.row(n.ID, n.State, strconv.Itoa(n.Sandboxes), strconv.Itoa(n.CPUs), humanBytes(n.MemFree), ago(now, n.HeartbeatAt), n.Address, orDash(n.StateReason))
			}
			return t.flush()
		},
	}
	var reason string
	drain := &cobra.Command{Use: "drain NODE", Short: "Place no new sandboxes on NODE (its sandboxes keep running and answering)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			n, err := c.DrainNode(a.ctx, args[0], reason)
			return a.printNode(n, err)
		},
	}
	drain.Flags().StringVar(&reason, "reason", "", "why (shown as the node's reason)")
	undrain := &cobra.Command{Use: "undrain NODE", Short: "Let placement use NODE again", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			n, err := c.UndrainNode(a.ctx, args[0])
			return a.printNode(n, err)
		},
	}
	cmd.AddCommand(drain, undrain)
	return cmd
}

func (a *app) printNode(n *api.ClusterNode, err error) error {
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.out, n)
	}
	_, err = a.out.Write([]byte(n.ID + " " + n.State + "\n"))
	return err
}
