package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// statsParallel bounds the stats requests one round has in flight.
const statsParallel = 8

func newStatsCmd(a *app) *cobra.Command {
	var noStream bool
	var interval time.Duration
	cmd := &cobra.Command{
		Use:   "stats [flags] [ID...]",
		Short: "Show sandboxes' resource use (CPU, memory, processes, disk, network), refreshed like docker stats",
		Long: "Shows CPU (percent of the cores the sandbox may use), memory used and its limit, processes, the writable\n" +
			"disk's use and its size, and network bytes in and out through the sandbox's current link, for the given\n" +
			"sandboxes or, without IDs, every running one. On a terminal the table refreshes every --interval; otherwise\n" +
			"(a pipe, a file) a table is printed per interval, with no terminal codes. --no-stream prints one sample.\n" +
			"--json prints one JSON object per sample and line. A stopped or suspended sandbox is not woken: it shows zeros.",
		RunE: func(cmd *cobra.Command, args []string) error {
			if interval < 250*time.Millisecond || interval > time.Minute {
				return usagef("--interval %v: want 250ms to 1m", interval)
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			return a.stats(c, args, noStream, interval)
		},
	}
	cmd.Flags().BoolVar(&noStream, "no-stream", false, "print one sample and exit")
	cmd.Flags().DurationVar(&interval, "interval", time.Second, "time between samples")
	return cmd
}

// statsRow is one sandbox's sample, or why there is none.
type statsRow struct {
	id  string
	st  api.SandboxStats
	err error
}

func (a *app) stats(c *sdk.Client, ids []string, noStream bool, interval time.Duration) error {
	f, isFile := a.out.(*os.File)
	refresh := !noStream && !a.json && isFile && term.IsTerminal(int(f.Fd()))
	t := time.NewTicker(interval)
	defer t.Stop()
	for round := 0; ; round++ {
		list := ids
		if len(ids) == 0 {
			sbs, err := c.ListSandboxes(a.ctx, sdk.ListOptions{State: api.StateRunning})
			if err != nil {
				return err
			}
			list = make([]string, len(sbs))
			for i, sb := range sbs {
				list[i] = sb.ID
			}
		}
		rows := sampleStats(a.ctx, c, list)
		if err := a.ctx.Err(); err != nil {
			return nil
		}
		// The sandboxes named on the command line must exist: say so at
		// once rather than print a row of nothing forever.
		if round == 0 && len(ids) > 0 {
			for _, r := range rows {
				if r.err != nil {
					return fmt.Errorf("sandbox %s: %w", r.id, r.err)
				}
			}
		}
		if err := a.printStats(rows, len(ids) == 0, refresh); err != nil {
			return err
		}
		if noStream {
			return nil
		}
		select {
		case <-a.ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// sampleStats asks for every sandbox's sample at once (each may take up
// to the server's first-sample window).
func sampleStats(ctx context.Context, c *sdk.Client, ids []string) []statsRow {
	rows := make([]statsRow, len(ids))
	sem := make(chan struct{}, statsParallel)
	var wg sync.WaitGroup
	for i, id := range ids {
		rows[i].id = id
		wg.Add(1)
		go func(r *statsRow) {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			r.st, r.err = c.Stats(ctx, r.id)
		}(&rows[i])
	}
	wg.Wait()
	return rows
}

// printStats prints one round: JSON lines, or a table (after clearing the
// screen when refreshing a terminal). With dropGone, a sandbox that went
// away meanwhile is left out (the list of running ones changed).
func (a *app) printStats(rows []statsRow, dropGone, refresh bool) error {
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].id < rows[j].id })
	if a.json {
		enc := json.NewEncoder(a.out)
		for _, r := range rows {
			if r.err != nil {
				if !dropGone {
					fmt.Fprintf(a.errOut, "space: sandbox %s: %v\n", r.id, r.err)
				}
				continue
			}
			if err := enc.Encode(r.st); err != nil {
				return err
			}
		}
		return nil
	}
	var w io.Writer = a.out
	if refresh {
		// Home and clear to the end, as docker stats: no flicker of a
		// whole-screen clear.
		fmt.Fprint(w, "\x1b[H\x1b[J")
	}
	t := newTable(w, "ID", "STATE", "CPU %", "MEM USAGE / LIMIT", "MEM %", "PIDS", "DISK USED / SIZE", "NET RX / TX")
	for _, r := range rows {
		if r.err != nil {
			if dropGone && errors.Is(r.err, sdk.ErrNotFound) {
				continue
			}
			t.row(r.id, "error: "+r.err.Error(), "-", "-", "-", "-", "-", "-")
			continue
		}
		s := r.st
		memPct := "-"
		if s.MemTotalBytes > 0 {
			memPct = fmt.Sprintf("%.1f%%", float64(s.MemUsedBytes)/float64(s.MemTotalBytes)*100)
		}
		pids := fmt.Sprint(s.Pids)
		if s.PidsMax > 0 {
			pids += " / " + fmt.Sprint(s.PidsMax)
		}
		disk := humanBytes(s.DiskUsedBytes) + " / "
		if s.DiskTotalBytes > 0 {
			disk += humanBytes(s.DiskTotalBytes)
		} else {
			disk += "unbounded"
		}
		t.row(s.SandboxID, s.State,
			fmt.Sprintf("%.1f%% of %g", s.CPUUsedPct, s.CPUCount),
			humanBytes(s.MemUsedBytes)+" / "+humanBytes(s.MemTotalBytes), memPct, pids, disk,
			humanBytes(s.NetRxBytes)+" / "+humanBytes(s.NetTxBytes))
	}
	return t.flush()
}
