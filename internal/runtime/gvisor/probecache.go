package gvisor

import (
	"fmt"
	"path/filepath"

	"github.com/spacehq/space/internal/runtime"
)

// The probe really starts (and checkpoints) a sandbox, which costs a second
// or more, and every server start probes. A successful result is kept in
// DataDir for the rest of the boot (runtime.ProbeCache), as long as nothing
// it depends on changed: the kernel's boot id, and the runsc binary, the
// agent binary and the running program (which holds the probe's own code),
// each by path, size, inode and modification time. A failed probe is never
// kept, so a fixed host is seen at the next start.

const probeCacheFile = "probe.json"

// probeKey digests everything a probe result depends on.
func (r *Runtime) probeKey() (string, error) {
	rs, err := r.runsc()
	if err != nil {
		return "", err
	}
	params := fmt.Sprintf("cgroup2=%v\nstrength=%d\nrunsc_pinned=%s\n", cgroupV2(), strength, RunscVersion)
	return runtime.ProbeKey(params, rs.bin, r.cfg.AgentBinary)
}

func (r *Runtime) probeFiles(string) []string {
	return []string{filepath.Join(r.cfg.DataDir, probeCacheFile)}
}
