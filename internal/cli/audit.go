package cli

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit/chain"
	"github.com/spacehq/space/sdk"
)

// `space audit`: list, follow and export the server's tamper-evident audit
// log, and verify an export offline (internal/audit/chain.Verify: a pure
// function over the file, no server needed unless --server fetches the
// key, and no storage linked).

func newAuditCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "audit", Short: "List, export and verify the tamper-evident audit log"}
	cmd.AddCommand(newAuditLsCmd(a), newAuditExportCmd(a), newAuditVerifyCmd(a), newAuditKeyCmd(a), newAuditHeadsCmd(a))
	return cmd
}

func newAuditLsCmd(a *app) *cobra.Command {
	var f sdk.AuditFilter
	var follow bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List audit records (API calls, lifecycle, commands, files, network verdicts, …), oldest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if follow {
				return c.FollowAudit(a.ctx, f, func(r api.AuditRecord) error {
					if a.json {
						b, err := json.Marshal(r)
						if err != nil {
							return err
						}
						_, err = fmt.Fprintf(a.out, "%s\n", b)
						return err
					}
					_, err := fmt.Fprintln(a.out, formatAuditLine(r))
					return err
				})
			}
			recs, err := c.AuditRecords(a.ctx, f)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, recs)
			}
			t := newTable(a.out, "SEQ", "TIME", "KIND", "ACTION", "SANDBOX", "TARGET", "RESULT", "KEY")
			for _, r := range recs {
				t.row(strconv.FormatUint(r.Seq, 10), r.Time.Local().Format("2006-01-02 15:04:05"), r.Kind, r.Action,
					orDash(r.Sandbox), orDash(r.Target), orDash(r.Result), orDash(r.KeyID))
			}
			return t.flush()
		},
	}
	cmd.Flags().StringVar(&f.Sandbox, "sandbox", "", "only this sandbox's records")
	cmd.Flags().StringVar(&f.Kind, "kind", "", "only records of this kind (api, lifecycle, command, files, network, secret, policy, approval, key, checkpoint, audit)")
	cmd.Flags().Uint64Var(&f.After, "after", 0, "only records with a larger sequence number")
	cmd.Flags().IntVar(&f.Limit, "limit", 0, "at most this many records (default 1000)")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing new records until interrupted")
	cmd.Flags().StringVar(&f.Node, "node", "", "through a cluster replica: the node whose log to list")
	return cmd
}

// formatAuditLine is one record on one line (ls -f).
func formatAuditLine(r api.AuditRecord) string {
	return fmt.Sprintf("%d  %s  %-9s  %s  %s  %s  %s  key=%s", r.Seq, r.Time.Local().Format("2006-01-02 15:04:05.000"), r.Kind,
		r.Action, orDash(r.Sandbox), orDash(r.Target), orDash(r.Result), orDash(r.KeyID))
}

func newAuditExportCmd(a *app) *cobra.Command {
	var since, format, out, node string
	cmd := &cobra.Command{
		Use:   "export",
		Short: "Export the audit log as JSON Lines (verifiable with `space audit verify`), or OCSF",
		Long: "Writes the log from the signed checkpoint at or before --since through a checkpoint signed now, one record\n" +
			"per line, to stdout or -o FILE. --format ocsf writes OCSF 1.1-shaped events for SIEMs instead.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if format != "jsonl" && format != "ocsf" {
				return usagef("--format %q: want jsonl or ocsf", format)
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			w := a.out
			if out != "" && out != "-" {
				f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
				if err != nil {
					return err
				}
				defer f.Close()
				w = f
			}
			if _, err := c.ExportNodeAudit(a.ctx, node, since, format, w); err != nil {
				return err
			}
			if f, ok := w.(*os.File); ok && w != a.out {
				return f.Close()
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&since, "since", "", "start at the checkpoint before this time (RFC 3339) or this long ago (e.g. 24h)")
	cmd.Flags().StringVar(&format, "format", "jsonl", "jsonl (the chain's records) or ocsf")
	cmd.Flags().StringVarP(&out, "output", "o", "", "write to this file (mode 0600) instead of stdout")
	cmd.Flags().StringVar(&node, "node", "", "through a cluster replica: the node whose log to export")
	return cmd
}

func newAuditVerifyCmd(a *app) *cobra.Command {
	var keys, anchors []string
	var node string
	var fromServer, chainOnly, allowTail bool
	cmd := &cobra.Command{
		Use:   "verify FILE",
		Short: "Verify an audit export offline: hashes, links, order, gaps and checkpoint signatures",
		Long: "Checks every record of FILE (\"-\" for stdin) against its hash and the one before it, the sequence numbers for\n" +
			"gaps, duplicates and reordering, and each checkpoint's ed25519 signature with the log's public key (--key, from\n" +
			"`space audit key`, or --server to fetch it). Each problem names the record's seq and line; the exit status is 1\n" +
			"when there is any. --chain-only skips signatures (it detects damage, not forgery). --anchor SEQ:HASH (a node's\n" +
			"head from `space audit heads`) must be in the file unchanged; with --server --node NAME, a cluster replica gives\n" +
			"that node's key and anchored head.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			o := chain.VerifyOptions{ChainOnly: chainOnly, AllowUnsignedTail: allowTail}
			for _, k := range keys {
				pk, err := chain.ParsePublicKey(k)
				if err != nil {
					return usagef("--key: %v", err)
				}
				o.Keys = append(o.Keys, pk)
			}
			for _, an := range anchors {
				seq, hash, ok := strings.Cut(an, ":")
				n, err := strconv.ParseUint(seq, 10, 63)
				if !ok || err != nil || n == 0 || len(hash) != 64 {
					return usagef("--anchor %q: want SEQ:HASH (a sequence number and a 64-digit hex hash, as `space audit heads` shows)", an)
				}
				o.Anchors = append(o.Anchors, chain.Anchor{Seq: n, Hash: hash})
			}
			if node != "" && !fromServer {
				return usagef("--node needs --server (the cluster replica that knows the node's key and head)")
			}
			if fromServer {
				pks, err := a.serverAuditKeys(a.ctx, node)
				if err != nil {
					return err
				}
				o.Keys = append(o.Keys, pks...)
				if node != "" {
					head, err := a.anchoredHead(a.ctx, node)
					if err != nil {
						return err
					}
					o.Anchors = append(o.Anchors, head)
				}
			}
			if len(o.Keys) == 0 && !chainOnly {
				return usagef("verify needs the log's public key: --key BASE64 (see `space audit key`), or --server to fetch it; --chain-only checks the hash chain alone")
			}
			var in io.Reader = a.in
			if args[0] != "-" {
				f, err := os.Open(args[0])
				if err != nil {
					return err
				}
				defer f.Close()
				in = f
			}
			rep, err := chain.Verify(in, o)
			if err != nil {
				return err
			}
			if a.json {
				if err := printJSON(a.out, rep); err != nil {
					return err
				}
			} else {
				for _, p := range rep.Problems {
					fmt.Fprintln(a.out, p.String())
				}
			}
			if !rep.OK() {
				return fmt.Errorf("verification failed: %d problem(s) in %d records", len(rep.Problems), rep.Records)
			}
			if !a.json {
				what := "signed checkpoints"
				if chainOnly {
					what = "checkpoints (signatures not checked)"
				}
				fmt.Fprintf(a.out, "ok: %d records, seq %d–%d, %d %s\n", rep.Records, rep.First, rep.Last, rep.Checkpoints, what)
				if rep.Anchored > 0 {
					fmt.Fprintf(a.out, "anchored: %d of %d heads found unchanged\n", rep.Anchored, len(o.Anchors))
				}
				for _, u := range rep.Unchecked {
					fmt.Fprintf(a.out, "not checked: the anchored head at seq %d is before the file's first record (seq %d)\n", u.Seq, rep.First)
				}
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&keys, "key", nil, "trusted public key, base64 (repeatable)")
	cmd.Flags().BoolVar(&fromServer, "server", false, "fetch the public key from the server (GET /v1/audit/key)")
	cmd.Flags().BoolVar(&chainOnly, "chain-only", false, "check hashes and links only, no signatures")
	cmd.Flags().BoolVar(&allowTail, "allow-unsigned-tail", false, "accept records after the last checkpoint (a followed listing)")
	cmd.Flags().StringArrayVar(&anchors, "anchor", nil, "SEQ:HASH of a head the file must hold unchanged (repeatable)")
	cmd.Flags().StringVar(&node, "node", "", "with --server on a cluster replica: the node whose key and anchored head to use")
	return cmd
}

// anchoredHead is node's head as a cluster replica anchors it.
func (a *app) anchoredHead(ctx context.Context, node string) (chain.Anchor, error) {
	c, err := a.Client()
	if err != nil {
		return chain.Anchor{}, err
	}
	heads, err := c.AuditHeads(ctx)
	if err != nil {
		return chain.Anchor{}, err
	}
	for _, h := range heads {
		if h.Node == node {
			if h.Problem != "" {
				fmt.Fprintf(a.errOut, "warning: node %s reported an audit problem: %s\n", node, h.Problem)
			}
			return chain.Anchor{Seq: h.Seq, Hash: h.Hash}, nil
		}
	}
	return chain.Anchor{}, fmt.Errorf("the cluster has no audit head for node %q (yet)", node)
}

func (a *app) serverAuditKeys(ctx context.Context, node string) ([]ed25519.PublicKey, error) {
	c, err := a.Client()
	if err != nil {
		return nil, err
	}
	ks, err := c.NodeAuditKeys(ctx, node)
	if err != nil {
		return nil, err
	}
	var out []ed25519.PublicKey
	for _, k := range ks {
		pk, err := chain.ParsePublicKey(k.PublicKey)
		if err != nil {
			return nil, fmt.Errorf("server key %s: %w", k.ID, err)
		}
		out = append(out, pk)
	}
	return out, nil
}

func newAuditKeyCmd(a *app) *cobra.Command {
	var node string
	cmd := &cobra.Command{
		Use:   "key",
		Short: "Show the public key the audit log's checkpoints are signed with",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			ks, err := c.NodeAuditKeys(a.ctx, node)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, ks)
			}
			for _, k := range ks {
				fmt.Fprintf(a.out, "%s  %s  %s\n", k.ID, k.Algorithm, k.PublicKey)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&node, "node", "", "through a cluster replica: the node whose key to show")
	return cmd
}

func newAuditHeadsCmd(a *app) *cobra.Command {
	var forget string
	cmd := &cobra.Command{
		Use:   "heads",
		Short: "Show each cluster node's audit chain head as anchored in PostgreSQL (cluster replicas; admin)",
		Long: "Each node publishes its newest signed checkpoint to the cluster and checks, before the next, that its log still\n" +
			"holds it. PROBLEM is what a node found when its log no longer did (rolled back, cut, rewritten, another key); the\n" +
			"head then stays frozen as evidence. --forget NODE drops a node's head after you have looked into it.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if forget != "" {
				return c.ForgetAuditHead(a.ctx, forget)
			}
			heads, err := c.AuditHeads(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, heads)
			}
			t := newTable(a.out, "NODE", "SEQ", "HASH", "KEY", "SIGNED", "PROBLEM")
			for _, h := range heads {
				t.row(h.Node, strconv.FormatUint(h.Seq, 10), h.Hash, h.KeyID, h.SignedAt.Local().Format("2006-01-02 15:04:05"), orDash(h.Problem))
			}
			return t.flush()
		},
	}
	cmd.Flags().StringVar(&forget, "forget", "", "drop this node's anchored head (and its problem)")
	return cmd
}
