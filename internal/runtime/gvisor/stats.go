package gvisor

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/cgroupfs"
	"github.com/spacehq/space/internal/runtime/hostfs"
)

// pidsTTL is how long a task count from the sentry is reused.
const pidsTTL = time.Second

// meter owns the measurements of one sandbox that Stats and OOMKills
// return: the host cgroup's counters, the memory guard's kills, the
// sentry's task count and memory and the disk's use. The sentry's count
// comes through a runsc process, which costs tens of milliseconds, and the
// manager reads Stats around every exec, so it is reused for pidsTTL; the
// host cgroup's OOM counter is found once (finding it walks the cgroup
// mounts) and closed when the sandbox stops.
type meter struct {
	rs    *runsc
	id    string
	files layout

	pidsMu   sync.Mutex
	pidsAt   time.Time
	pidsLast int64
	memLast  int64 // the sentry's memory accounting, read with pidsLast

	oomOnce sync.Once
	oom     *cgroupfs.OOMCounter
}

// oomCounter is the host cgroup's OOM counter.
func (m *meter) oomCounter() *cgroupfs.OOMCounter {
	m.oomOnce.Do(func() { m.oom = sandboxCgroup(m.id).OOMCounter() })
	return m.oom
}

// oomKills is the host cgroup's OOM kills plus the memory guard's.
func (m *meter) oomKills() (int64, error) {
	n, err := m.oomCounter().Read()
	if err != nil {
		return 0, err
	}
	return n + guardKills(m.files.agentDir()), nil
}

// stopped forgets the sentry's last count and closes the OOM counter: the
// sandbox's processes are gone.
func (m *meter) stopped() {
	m.pidsMu.Lock()
	m.pidsAt = time.Time{}
	m.pidsMu.Unlock()
	m.oomCounter().Close()
}

// stats is Stats of a running sandbox.
func (m *meter) stats(ctx context.Context) (runtime.Stats, error) {
	s, err := cgroupStats(m.id)
	if err != nil {
		return s, err
	}
	// The host cgroup counts the host's OOM kills (a backstop that kills
	// the whole sandbox); the memory guard inside counts its own.
	s.OOMKills += guardKills(m.files.agentDir())
	var mem int64
	s.Pids, mem, err = m.sentryCounts(ctx)
	if err == nil && mem > 0 {
		s.MemoryBytes = mem
	}
	// The host cgroup's page cache is the sentry's (its memory file is
	// file-backed), not the sandbox's, and runsc events leaves its cache
	// field empty: MemoryCacheBytes stays 0, "cannot tell".
	if err != nil {
		return s, err
	}
	// With --overlay2=none the sandbox's writes land in the host
	// overlay's upper on its ext4 disk, mounted at rwDir while it runs.
	s.DiskUsedBytes, err = hostfs.DiskUsed(m.files.rwDir())
	return s, err
}

// sentryCounts is the number of tasks in the sandbox and its memory usage
// as the sentry counts them, at most pidsTTL old.
func (m *meter) sentryCounts(ctx context.Context) (pids, mem int64, err error) {
	m.pidsMu.Lock()
	defer m.pidsMu.Unlock()
	if time.Since(m.pidsAt) < pidsTTL {
		return m.pidsLast, m.memLast, nil
	}
	out, err := m.rs.run(ctx, 10*time.Second, "events", "--stats", m.id)
	if err != nil {
		return 0, 0, err
	}
	var ev struct {
		Data struct {
			Pids struct {
				Current int64 `json:"current"`
			} `json:"pids"`
			Memory struct {
				Usage struct {
					Usage int64 `json:"usage"`
				} `json:"usage"`
			} `json:"memory"`
		} `json:"data"`
	}
	if err := json.Unmarshal(out, &ev); err != nil {
		return 0, 0, fmt.Errorf("runsc events --stats: %v", err)
	}
	m.pidsAt, m.pidsLast, m.memLast = time.Now(), ev.Data.Pids.Current, ev.Data.Memory.Usage.Usage
	return m.pidsLast, m.memLast, nil
}
