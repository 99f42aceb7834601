package cli

import (
	"fmt"
	"sort"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
)

func newInfoCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "info",
		Short: "Show the server's runtimes, their isolation and supported verbs",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			info, err := c.Info(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, info)
			}
			return printInfo(a, info)
		},
	}
}

func printInfo(a *app, info *api.Info) error {
	fmt.Fprintf(a.out, "Version:       %s\nAuto runtime:  %s\n\n", orDash(info.Version), orDash(info.AutoRuntime))
	t := newTable(a.out, "RUNTIME", "AVAILABLE", "ISOLATION", "VERBS", "REASON")
	for _, rt := range info.Runtimes {
		avail := "yes"
		if !rt.Available {
			avail = "no"
		}
		t.row(rt.Name, avail, orDash(rt.Isolation), orDash(verbList(rt.Verbs)), orDash(rt.Reason))
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, rt := range info.Runtimes {
		if len(rt.VerbReasons) == 0 && len(rt.Details) == 0 {
			continue
		}
		fmt.Fprintf(a.out, "\n%s:\n", rt.Name)
		t := newTable(a.out)
		for _, k := range sortedKeys(rt.VerbReasons) {
			t.row("  "+k+":", "unsupported: "+rt.VerbReasons[k])
		}
		for _, k := range sortedKeys(rt.Details) {
			t.row("  "+k+":", rt.Details[k])
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	return nil
}

// verbList renders the supported verbs, sorted.
func verbList(m map[string]bool) string {
	var out []string
	for v, ok := range m {
		if ok {
			out = append(out, v)
		}
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
