package cli

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// Temporal policy rule sets and approvals: `space policy get|set|rm|ls|test`,
// `space approvals ls [-f]`, `space approve ID`, `space deny ID`.

func newPolicyCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "policy", Short: "Show, attach and test temporal policy rule sets (CEL)",
		Long: "Rule sets attach to a scope: server, tenant:NAME, template:REF or sandbox:ID. A rule set file is YAML or JSON:\n" +
			"  rules:\n  - name: curl-needs-approval\n    match: action.kind == \"exec\" && action.argv[0].matches(\"(^|/)(curl|wget)$\")\n" +
			"    verdict: ask\n    reason: network tools need a human\nSee docs/policy.md."}
	cmd.AddCommand(newPolicyLsCmd(a), newPolicyGetCmd(a), newPolicySetCmd(a), newPolicyRmCmd(a), newPolicyTestCmd(a))
	return cmd
}

func newPolicyLsCmd(a *app) *cobra.Command {
	return &cobra.Command{Use: "ls", Short: "List the attached rule sets", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			sets, err := c.PolicyRules(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, sets)
			}
			t := newTable(a.out, "SCOPE", "RULES", "UPDATED")
			for _, rs := range sets {
				upd := "-"
				if rs.UpdatedAt != nil {
					upd = ago(time.Now(), *rs.UpdatedAt)
				}
				t.row(rs.Scope, fmt.Sprint(len(rs.Rules)), upd)
			}
			return t.flush()
		}}
}

func newPolicyGetCmd(a *app) *cobra.Command {
	return &cobra.Command{Use: "get SCOPE", Short: "Print the rule set of a scope (YAML; --json for JSON)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			rs, err := c.PolicyRuleSet(a.ctx, args[0])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, rs)
			}
			out, err := yaml.Marshal(rs)
			if err != nil {
				return err
			}
			_, err = a.out.Write(out)
			return err
		}}
}

// readRuleSet reads a rule set file (YAML or JSON), refusing unknown
// fields so a misspelt key is not silently dropped.
func readRuleSet(path string) (api.PolicyRuleSet, error) {
	var rs api.PolicyRuleSet
	data, err := os.ReadFile(path)
	if err != nil {
		return rs, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&rs); err != nil {
		return rs, usagef("%s: %v", path, err)
	}
	return rs, nil
}

func newPolicySetCmd(a *app) *cobra.Command {
	return &cobra.Command{Use: "set SCOPE FILE", Short: "Attach a rule set file to a scope (replacing its rules)", Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			rs, err := readRuleSet(args[1])
			if err != nil {
				return err
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			out, err := c.SetPolicyRuleSet(a.ctx, args[0], rs)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, out)
			}
			fmt.Fprintf(a.out, "%s: %d rules\n", out.Scope, len(out.Rules))
			return nil
		}}
}

func newPolicyRmCmd(a *app) *cobra.Command {
	return &cobra.Command{Use: "rm SCOPE", Short: "Detach the rule set of a scope", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			return c.DeletePolicyRuleSet(a.ctx, args[0])
		}}
}

func newPolicyTestCmd(a *app) *cobra.Command {
	var history, action string
	cmd := &cobra.Command{Use: "test FILE --history H.jsonl [--action A.json]",
		Short: "Evaluate a rule set offline over a recorded history",
		Long: "Each line of the history file is an action (JSON: kind, time, argv, path, name, method, …). For each line\n" +
			"the verdict the rule set gives it, with the lines before it as history, is printed; with --action, also the\n" +
			"verdict of that action given the whole history (line 0). No server is involved.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if history == "" {
				return usagef("--history is required")
			}
			if a.host == nil || a.host.PolicyTest == nil {
				return a.handOff() // the policy engine is host-side (host.go)
			}
			rs, err := readRuleSet(args[0])
			if err != nil {
				return err
			}
			res, err := a.host.PolicyTest(rs, history, action)
			if err != nil {
				return err
			}
			if a.json {
				for _, r := range res {
					if err := printJSON(a.out, r); err != nil {
						return err
					}
				}
				return nil
			}
			t := newTable(a.out, "LINE", "KIND", "ACTION", "VERDICT", "RULE", "REASON")
			for _, r := range res {
				t.row(fmt.Sprint(r.Line), r.Action.Kind, actionSubject(r.Action), r.Verdict, orDash(r.Rule), orDash(r.Reason))
			}
			return t.flush()
		}}
	cmd.Flags().StringVar(&history, "history", "", "JSON Lines file of past actions, oldest first")
	cmd.Flags().StringVar(&action, "action", "", "JSON file of one more action to decide given the whole history")
	return cmd
}

// actionSubject is the short form of what an action is about.
func actionSubject(a api.PolicyAction) string {
	switch {
	case len(a.Argv) > 0:
		return strings.Join(a.Argv, " ")
	case a.Method != "":
		return a.Method + " " + a.Name + a.Path
	case a.Path != "":
		return a.Path
	case a.Name != "" && a.Port != 0:
		return fmt.Sprintf("%s:%d", a.Name, a.Port)
	case a.Name != "":
		return a.Name
	case a.Verb != "":
		return a.Verb
	case a.Port != 0:
		return fmt.Sprint(a.Port)
	}
	return a.Secret
}

func newApprovalsCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "approvals", Short: "Actions waiting for an approval, and destinations the network policy refused"}
	var follow bool
	var o sdk.ApprovalsOptions
	ls := &cobra.Command{Use: "ls", Short: "List approvals (pending first) and refused destinations (proposals)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if follow {
				return c.FollowApprovals(a.ctx, o, func(ap api.Approval) error {
					if a.json {
						return printJSON(a.out, ap)
					}
					t := newTable(a.out, "ID", "STATE", "SANDBOX", "KIND", "ACTION", "RULE", "REASON")
					approvalRow(t, ap)
					return t.flush()
				})
			}
			list, err := c.Approvals(a.ctx, o)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, list)
			}
			t := newTable(a.out, "ID", "STATE", "SANDBOX", "KIND", "ACTION", "RULE", "REASON")
			for _, ap := range list.Approvals {
				approvalRow(t, ap)
			}
			if err := t.flush(); err != nil {
				return err
			}
			if len(list.Proposals) > 0 {
				fmt.Fprintln(a.out, "\nRefused by the network policy (space approve ID adds the name to the sandbox's allow_out):")
				t := newTable(a.out, "ID", "SANDBOX", "NAME", "COUNT", "LAST")
				for _, p := range list.Proposals {
					t.row(p.ID, p.Sandbox, p.Name, fmt.Sprint(p.Count), ago(time.Now(), p.LastAt))
				}
				return t.flush()
			}
			return nil
		}}
	ls.Flags().BoolVarP(&follow, "follow", "f", false, "stream approvals as they are asked and answered")
	ls.Flags().StringVar(&o.State, "state", "", "only approvals in this state: pending, approved, denied, expired")
	ls.Flags().StringVar(&o.Sandbox, "sandbox", "", "only this sandbox's")
	cmd.AddCommand(ls)
	return cmd
}

func approvalRow(t *table, ap api.Approval) {
	t.row(ap.ID, ap.State, ap.Sandbox, ap.Action.Kind, actionSubject(ap.Action), ap.Rule, orDash(ap.Reason))
}

func newApproveCmd(a *app) *cobra.Command {
	var reason string
	cmd := &cobra.Command{Use: "approve ID", Short: "Approve a pending action, or a refused destination (prop:…)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			ap, err := c.Approve(a.ctx, args[0], reason)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, ap)
			}
			fmt.Fprintf(a.out, "%s %s\n", ap.ID, ap.State)
			return nil
		}}
	cmd.Flags().StringVar(&reason, "reason", "", "a note recorded with the answer")
	return cmd
}

func newDenyCmd(a *app) *cobra.Command {
	var reason string
	cmd := &cobra.Command{Use: "deny ID", Short: "Deny a pending action (the caller sees the reason)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			ap, err := c.Deny(a.ctx, args[0], reason)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, ap)
			}
			fmt.Fprintf(a.out, "%s %s\n", ap.ID, ap.State)
			return nil
		}}
	cmd.Flags().StringVar(&reason, "reason", "", "why (shown to the caller of the held action)")
	return cmd
}
