package cli

import (
	"encoding/json"
	"fmt"
	"net"
	"sort"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/spacehq/space/api"
)

// netFlags are the egress policy flags of `run`, `sandbox create` and
// `net set`.
type netFlags struct {
	internet     bool
	allowOut     []string
	denyOut      []string
	allowPrivate []string
	egressProxy  string
}

func (f *netFlags) register(fl *pflag.FlagSet) {
	fl.BoolVar(&f.internet, "internet", false, "allow every public destination (--deny-out still applies)")
	fl.StringArrayVar(&f.allowOut, "allow-out", nil, `allow a destination: domain, "*.suffix", IP or CIDR, optionally ":port" (repeatable)`)
	fl.StringArrayVar(&f.denyOut, "deny-out", nil, `deny an IP or CIDR, optionally ":port" (repeatable; wins over allows)`)
	fl.StringArrayVar(&f.allowPrivate, "allow-private", nil, `let allowed names lead into this loopback/private/link-local IP or CIDR (repeatable; only inside the server's --egress-allow-private)`)
	fl.StringVar(&f.egressProxy, "egress-proxy", "", "re-originate every allowed connection through this SOCKS5 proxy (socks5://host:port)")
}

// given reports whether any policy flag was set.
func (f *netFlags) given() bool {
	return f.internet || len(f.allowOut) > 0 || len(f.denyOut) > 0 || len(f.allowPrivate) > 0 || f.egressProxy != ""
}

// policy builds the policy the flags describe. Entries are checked by the
// server (which names the offending one); only what cannot be an entry at
// all is refused here.
func (f *netFlags) policy() (api.NetworkPolicy, error) {
	p := api.NetworkPolicy{Internet: f.internet, EgressProxy: f.egressProxy}
	for _, l := range []struct {
		flag string
		in   []string
		out  *[]string
	}{{"allow-out", f.allowOut, &p.AllowOut}, {"deny-out", f.denyOut, &p.DenyOut}, {"allow-private", f.allowPrivate, &p.AllowPrivate}} {
		for _, e := range l.in {
			for _, part := range strings.Split(e, ",") {
				part = strings.TrimSpace(part)
				if part == "" {
					return p, usagef("--%s %q: empty entry", l.flag, e)
				}
				*l.out = append(*l.out, part)
			}
		}
	}
	if f.egressProxy != "" && !strings.HasPrefix(f.egressProxy, "socks5://") {
		return p, usagef("--egress-proxy %q: want socks5://host:port", f.egressProxy)
	}
	return p, nil
}

func newNetCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "net", Aliases: []string{"network"}, Short: "Show and change sandboxes' network policies and events"}
	cmd.AddCommand(newNetGetCmd(a), newNetSetCmd(a), newNetLogCmd(a))
	return cmd
}

func newNetGetCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "get ID",
		Short: "Show a sandbox's network policy, link and counters",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			info, err := c.SandboxNetwork(a.ctx, args[0])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, info)
			}
			return printNetwork(a, info)
		},
	}
}

func newNetSetCmd(a *app) *cobra.Command {
	var f netFlags
	var none bool
	cmd := &cobra.Command{
		Use:   "set ID [--internet] [--allow-out P]... [--deny-out CIDR]... [--allow-private CIDR]... [--egress-proxy URL] | --none",
		Short: "Replace a sandbox's whole network policy (a running sandbox's link applies it at once)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if none == f.given() {
				return usagef("give the new policy (--internet, --allow-out, --deny-out, --allow-private, --egress-proxy) or --none, not both")
			}
			p, err := f.policy()
			if err != nil {
				return err
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			info, err := c.SetSandboxNetwork(a.ctx, args[0], p)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, info)
			}
			return printNetwork(a, info)
		},
	}
	f.register(cmd.Flags())
	cmd.Flags().BoolVar(&none, "none", false, "no egress at all")
	return cmd
}

func newNetLogCmd(a *app) *cobra.Command {
	var follow bool
	var after uint64
	cmd := &cobra.Command{
		Use:   "log ID",
		Short: "Show a sandbox's network events (DNS queries and connections, with the verdict)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			return c.NetworkEvents(a.ctx, args[0], after, follow, func(ev api.NetworkEvent) error {
				if a.json {
					b, err := json.Marshal(ev)
					if err != nil {
						return err
					}
					_, err = fmt.Fprintf(a.out, "%s\n", b)
					return err
				}
				_, err := fmt.Fprintln(a.out, formatNetEvent(ev))
				return err
			})
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing new events until interrupted")
	cmd.Flags().Uint64Var(&after, "after", 0, "only events with a larger sequence number")
	return cmd
}

// formatNetEvent is one human line: time, verdict, protocol, name,
// ip:port, reason, bytes out/in.
func formatNetEvent(ev api.NetworkEvent) string {
	dest := "-"
	switch {
	case ev.IP != "" && ev.Port != 0:
		dest = net.JoinHostPort(ev.IP, strconv.Itoa(ev.Port))
	case ev.IP != "":
		dest = ev.IP
	}
	ts := "-"
	if !ev.Time.IsZero() {
		ts = ev.Time.Local().Format("2006-01-02 15:04:05.000")
	}
	return fmt.Sprintf("%s  %-5s  %-4s  %s  %s  %s  out=%s in=%s", ts, ev.Verdict, ev.Protocol, orDash(ev.Name), dest,
		orDash(ev.Reason), fmtBytes(ev.BytesOut), fmtBytes(ev.BytesIn))
}

func fmtBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1fGiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1fKiB", float64(n)/(1<<10))
	}
	return strconv.FormatInt(n, 10) + "B"
}

// policySummary is a policy on one line.
func policySummary(p api.NetworkPolicy) string {
	var parts []string
	if p.Internet {
		parts = append(parts, "internet")
	}
	if len(p.AllowOut) > 0 {
		parts = append(parts, "allow "+strings.Join(p.AllowOut, ","))
	}
	if len(p.DenyOut) > 0 {
		parts = append(parts, "deny "+strings.Join(p.DenyOut, ","))
	}
	if len(p.AllowPrivate) > 0 {
		parts = append(parts, "private "+strings.Join(p.AllowPrivate, ","))
	}
	if p.EgressProxy != "" {
		parts = append(parts, "via "+p.EgressProxy)
	}
	if len(p.Rules) > 0 {
		parts = append(parts, fmt.Sprintf("%d header rules", len(p.Rules)))
	}
	if len(parts) == 0 {
		return "none (no egress)"
	}
	return strings.Join(parts, "; ")
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func printNetwork(a *app, info *api.NetworkInfo) error {
	t := newTable(a.out)
	p := info.Policy
	t.row("Internet:", yesNo(p.Internet))
	t.row("Allow out:", orDash(strings.Join(p.AllowOut, ", ")))
	t.row("Deny out:", orDash(strings.Join(p.DenyOut, ", ")))
	if len(p.AllowPrivate) > 0 {
		t.row("Allow private:", strings.Join(p.AllowPrivate, ", "))
	}
	t.row("Egress proxy:", orDash(p.EgressProxy))
	for _, r := range p.Rules {
		// Header names only: values may be credentials.
		set := make([]string, 0, len(r.SetHeaders))
		for k := range r.SetHeaders {
			set = append(set, k)
		}
		sort.Strings(set)
		t.row("Header rule:", fmt.Sprintf("%s: set [%s] remove [%s]", r.Domain, strings.Join(set, " "), strings.Join(r.RemoveHeaders, " ")))
	}
	t.row("Attached:", yesNo(info.Attached))
	if info.Address != "" {
		t.row("Address:", info.Address+" (gateway and resolver "+info.Gateway+")")
	}
	if info.Attached {
		s := info.Stats
		t.row("Traffic:", "out "+fmtBytes(s.BytesOut)+", in "+fmtBytes(s.BytesIn))
		t.row("Connections:", strconv.FormatInt(s.Connections, 10)+" open")
		t.row("DNS queries:", strconv.FormatInt(s.DNSQueries, 10))
		if len(s.Verdicts) > 0 {
			keys := make([]string, 0, len(s.Verdicts))
			for k := range s.Verdicts {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			var vs []string
			for _, k := range keys {
				vs = append(vs, k+"="+strconv.FormatInt(s.Verdicts[k], 10))
			}
			t.row("Verdicts:", strings.Join(vs, " "))
		}
		if s.EventsDropped > 0 {
			t.row("Events dropped:", strconv.FormatInt(s.EventsDropped, 10))
		}
	}
	return t.flush()
}
