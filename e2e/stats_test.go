package e2e

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// TestSandboxStats measures real load in a sandbox of each runtime and
// checks GET …/stats sees it: 64 MiB held by a process, a busy loop, 20 MiB
// written to disk, a request through the gateway; then that a stopped
// sandbox answers zeros without waking, and the followed stream.
func TestSandboxStats(t *testing.T) {
	e := setup(t)
	for _, rt := range []string{"native", "gvisor", "microvm"} {
		t.Run(rt, func(t *testing.T) {
			if rt == "microvm" {
				requireMicroVM(t, e)
			}
			testSandboxStats(t, e, rt)
		})
	}
}

func testSandboxStats(t *testing.T, e *env, rt string) {
	ctx := ctxT(t, 10*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: rt, Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	stats := func() api.SandboxStats {
		t.Helper()
		st, err := e.client.Stats(ctx, sb.ID)
		if err != nil {
			t.Fatalf("stats: %v", err)
		}
		return st
	}
	// poll samples about once a second (the rate's window) until ok.
	poll := func(what string, ok func(api.SandboxStats) bool) api.SandboxStats {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			st := stats()
			if ok(st) {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: never seen; last sample %+v", what, st)
			}
			time.Sleep(time.Second)
		}
	}
	base := stats()
	t.Logf("%s idle: %+v", rt, base)
	if base.SandboxID != sb.ID || base.State != api.StateRunning || base.CPUCount != 1 || base.MemTotalBytes != 512<<20 ||
		base.PidsMax != 512 || base.DiskTotalBytes != 2048<<20 || base.Timestamp.IsZero() {
		t.Fatalf("limits and identity: %+v", base)
	}
	if base.MemUsedBytes <= 0 || base.MemUsedBytes > base.MemTotalBytes || base.Pids < 1 || base.CPUSeconds <= 0 ||
		base.DiskUsedBytes <= 0 || base.DiskUsedBytes > 256<<20 || base.CPUUsedPct < 0 || base.CPUUsedPct > 100 {
		t.Fatalf("idle sample is not sane: %+v", base)
	}
	kill := func(cid string) {
		if err := e.client.SignalCommand(ctx, sb.ID, cid, "KILL"); err != nil {
			t.Errorf("kill %s: %v", cid, err)
		}
	}
	detached := func(script string) string {
		t.Helper()
		c, err := e.client.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{Detached: true, ExecRequest: api.ExecRequest{Cmd: []string{"sh", "-c", script}}})
		if err != nil {
			t.Fatalf("start %q: %v", script, err)
		}
		return c.ID
	}

	// Memory: 64 MiB written (so resident) and held.
	hog := detached(`exec python3 -c "import time; b = bytearray(b'x' * (64 << 20)); time.sleep(600)"`)
	st := poll("mem_used ≥ 50 MiB above idle", func(s api.SandboxStats) bool { return s.MemUsedBytes-base.MemUsedBytes >= 50<<20 })
	t.Logf("%s holding 64 MiB: mem %d MiB (idle %d MiB), cache %d MiB, pids %d", rt, st.MemUsedBytes>>20, base.MemUsedBytes>>20, st.MemCacheBytes>>20, st.Pids)
	if st.Pids <= base.Pids {
		t.Errorf("pids did not count the python process: %d (idle %d)", st.Pids, base.Pids)
	}
	kill(hog)

	// CPU: a busy loop on the sandbox's one core.
	spin := detached("while :; do :; done")
	st = poll("cpu_used_pct > 20", func(s api.SandboxStats) bool { return s.CPUUsedPct > 20 })
	t.Logf("%s busy: cpu %.1f%% of %g, %.2f s", rt, st.CPUUsedPct, st.CPUCount, st.CPUSeconds)
	if st.CPUUsedPct > 110 || st.CPUSeconds <= base.CPUSeconds {
		t.Errorf("busy sample: %+v (idle %+v)", st, base)
	}
	kill(spin)
	// Idle again: the rate falls back.
	poll("cpu_used_pct < 20 after the loop ended", func(s api.SandboxStats) bool { return s.CPUUsedPct < 20 })

	// Disk: 20 MiB into the writable layer.
	if out, code := sh(t, e, sb.ID, "head -c 20M /dev/urandom > /root/blob && sync && ls -l /root/blob"); code != 0 {
		t.Fatalf("write 20 MiB: %d %s", code, out)
	}
	st = poll("disk_used grows by ≥ 15 MiB", func(s api.SandboxStats) bool { return s.DiskUsedBytes-base.DiskUsedBytes >= 15<<20 })
	t.Logf("%s disk: %d MiB (idle %d MiB)", rt, st.DiskUsedBytes>>20, base.DiskUsedBytes>>20)

	// Network: a request through the gateway moves both counters.
	before := stats()
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://allowed.test:%d/", e.internet.httpPort)); code != 0 {
		t.Fatalf("curl: %d %s", code, out)
	}
	st = poll("net bytes rise", func(s api.SandboxStats) bool {
		return s.NetRxBytes > before.NetRxBytes && s.NetTxBytes > before.NetTxBytes
	})
	t.Logf("%s net: rx %d tx %d (before %d %d)", rt, st.NetRxBytes, st.NetTxBytes, before.NetRxBytes, before.NetTxBytes)

	// Followed: samples at the interval, in order, until the caller stops.
	var got []api.SandboxStats
	fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	errEnough := errors.New("enough")
	err := e.client.FollowStats(fctx, sb.ID, 300*time.Millisecond, func(s api.SandboxStats) error {
		got = append(got, s)
		if len(got) == 3 {
			return errEnough
		}
		return nil
	})
	cancel()
	if !errors.Is(err, errEnough) || len(got) != 3 {
		t.Fatalf("follow: %v, %d samples", err, len(got))
	}
	for i := 1; i < 3; i++ {
		if d := got[i].Timestamp.Sub(got[i-1].Timestamp); d < 200*time.Millisecond || d > 5*time.Second || got[i].SandboxID != sb.ID {
			t.Fatalf("followed samples %d→%d %v apart: %+v", i-1, i, d, got)
		}
	}

	// Stopped: its state and zeros, and asking does not wake it.
	op, err := e.client.Stop(ctx, sb.ID)
	if err == nil {
		_, err = e.client.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatalf("stop: %v", err)
	}
	st = stats()
	if st.State != api.StateStopped || st.MemUsedBytes != 0 || st.CPUUsedPct != 0 || st.Pids != 0 || st.DiskUsedBytes != 0 ||
		st.NetRxBytes != 0 || st.MemTotalBytes != 512<<20 {
		t.Fatalf("stopped sandbox: %+v", st)
	}
	if again, err := e.client.GetSandbox(ctx, sb.ID); err != nil || again.State != api.StateStopped {
		t.Fatalf("stats woke the sandbox: %v %+v", err, again)
	}
}
