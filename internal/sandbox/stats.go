package sandbox

import (
	"context"
	"errors"
	goruntime "runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// CPU use is a rate, so it needs two samples. The manager keeps the last
// one per sandbox (cpuMeter, in its entry): a caller that asks about once a
// second (space stats, an E2B getMetrics poll) gets the rate since its last
// call. Without a usable earlier sample — the first call, one older than
// cpuSampleMaxAge, a counter that went back (a restart) — Stats samples
// twice, cpuFirstWindow apart. A sample younger than cpuSampleMinAge (a
// second client polling at the same time) is not a window worth dividing
// by: that caller gets the rate the previous call measured.
const (
	cpuFirstWindow  = 200 * time.Millisecond
	cpuSampleMinAge = 250 * time.Millisecond
	cpuSampleMaxAge = 10 * time.Second
)

// cpuMeter keeps the last CPU sample of one sandbox.
type cpuMeter struct {
	mu   sync.Mutex
	last cpuSample
}

// cpuSample is the CPU time of a sandbox at one moment.
type cpuSample struct {
	at    time.Time
	nanos int64
	pct   float64 // the rate measured when this sample was taken
}

func (c *cpuMeter) get() cpuSample {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

// put keeps s unless a concurrent caller stored a newer sample meanwhile.
func (c *cpuMeter) put(s cpuSample) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.at.After(c.last.at) {
		c.last = s
	}
}

// hostCPUs and hostMemory are the host's, for sandboxes without a limit
// below them.
func hostCPUs() float64 { return float64(goruntime.NumCPU()) }

func hostMemory() int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return 0
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// Stats samples a sandbox's resource use. Usage is measured by the host
// (cgroups, the disk's filesystem, the gateway's counters), except where
// the runtime's Stats says otherwise (a microVM's memory, processes and
// disk come from its guest kernel). A sandbox that is not running or
// paused is not woken: it answers its state, its limits and zeros.
func (m *Manager) Stats(ctx context.Context, id string) (api.SandboxStats, error) {
	sb, err := m.Get(ctx, id)
	if err != nil {
		return api.SandboxStats{}, err
	}
	out := api.SandboxStats{
		SandboxID:      id,
		State:          sb.State,
		Timestamp:      time.Now().UTC(),
		CPUCount:       hostCPUs(),
		MemTotalBytes:  hostMemory(),
		PidsMax:        sb.Limits.Pids,
		DiskTotalBytes: sb.Limits.DiskMiB << 20,
	}
	if c := sb.Limits.CPUs; c > 0 && c < out.CPUCount {
		out.CPUCount = c
	}
	if l := sb.Limits.MemoryMiB << 20; l > 0 && (out.MemTotalBytes == 0 || l < out.MemTotalBytes) {
		out.MemTotalBytes = l
	}
	if sb.State != api.StateRunning && sb.State != api.StatePaused {
		return out, nil
	}
	e := m.peek(id)
	if e == nil {
		return out, nil
	}
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	if inst == nil {
		return out, nil
	}
	st, err := inst.Stats(ctx)
	if err != nil {
		return api.SandboxStats{}, err
	}
	now := time.Now()
	prev := e.cpu.get()
	fresh := prev.at.IsZero() || now.Sub(prev.at) > cpuSampleMaxAge || st.CPUNanos < prev.nanos
	if fresh {
		prev = cpuSample{at: now, nanos: st.CPUNanos}
		t := time.NewTimer(cpuFirstWindow)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return api.SandboxStats{}, ctx.Err()
		}
		if st, err = inst.Stats(ctx); err != nil {
			return api.SandboxStats{}, err
		}
		now = time.Now()
	}
	pct := prev.pct
	if win := now.Sub(prev.at); fresh || win >= cpuSampleMinAge {
		pct = max(float64(st.CPUNanos-prev.nanos)/float64(win.Nanoseconds())/out.CPUCount*100, 0)
		e.cpu.put(cpuSample{at: now, nanos: st.CPUNanos, pct: pct})
	}
	out.Timestamp = now.UTC()
	out.CPUUsedPct = pct
	out.CPUSeconds = float64(st.CPUNanos) / 1e9
	out.MemUsedBytes = st.MemoryBytes
	out.MemCacheBytes = min(st.MemoryCacheBytes, st.MemoryBytes)
	out.Pids = st.Pids
	out.DiskUsedBytes = st.DiskUsedBytes
	if out.DiskTotalBytes > 0 {
		// A microVM's guest reports its disk's use; it cannot be more
		// than the disk.
		out.DiskUsedBytes = min(out.DiskUsedBytes, out.DiskTotalBytes)
	}
	if m.cfg.Network != nil {
		gi, err := m.cfg.Network.Info(ctx, id)
		switch {
		case err == nil:
			out.NetRxBytes, out.NetTxBytes = gi.Stats.BytesIn, gi.Stats.BytesOut
		case errors.Is(err, errdefs.ErrNotFound), errors.Is(err, errdefs.ErrUnavailable):
			// No link (none yet, or the gateway is restarting): no bytes.
		default:
			return api.SandboxStats{}, err
		}
	}
	return out, nil
}
