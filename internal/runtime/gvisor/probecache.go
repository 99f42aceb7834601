package gvisor

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime"
)

// The probe really starts (and checkpoints) a sandbox, which costs a second
// or more, and every server start probes. A successful result is kept in
// DataDir for the rest of the boot, as long as nothing it depends on
// changed: the kernel's boot id, and the runsc binary, the agent binary and
// the running program (which holds the probe's own code), each by path,
// size, inode and modification time. A failed probe is never kept, so a
// fixed host is seen at the next start.

const probeCacheFile = "probe.json"

type probeRecord struct {
	Key  string               `json:"key"`
	Caps runtime.Capabilities `json:"caps"`
}

// probeKey digests everything a probe result depends on.
func (r *Runtime) probeKey() (string, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	rs, err := r.runsc()
	if err != nil {
		return "", err
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "boot=%s\nuid=%d\ncgroup2=%v\nstrength=%d\nrunsc_pinned=%s\n",
		strings.TrimSpace(string(boot)), os.Geteuid(), cgroupV2(), strength, RunscVersion)
	for _, p := range []string{rs.bin, r.cfg.AgentBinary, self} {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s %d %d %d %d.%d\n", p, st.Dev, st.Ino, st.Size, st.Mtim.Sec, st.Mtim.Nsec)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func (r *Runtime) probeCachePath() string { return filepath.Join(r.cfg.DataDir, probeCacheFile) }

// loadProbe returns the kept result for key, marked as such.
func (r *Runtime) loadProbe(key string) (runtime.Capabilities, bool) {
	data, err := os.ReadFile(r.probeCachePath())
	if err != nil {
		return runtime.Capabilities{}, false
	}
	var rec probeRecord
	if json.Unmarshal(data, &rec) != nil || rec.Key != key || !rec.Caps.Available {
		return runtime.Capabilities{}, false
	}
	c := rec.Caps
	if c.Details == nil {
		c.Details = map[string]string{}
	}
	c.Details["probe_cached"] = "true"
	return c, true
}

// storeProbe keeps a successful result (atomically; errors only cost the
// next start a probe).
func (r *Runtime) storeProbe(key string, c runtime.Capabilities) {
	if !c.Available {
		return
	}
	data, err := json.Marshal(probeRecord{Key: key, Caps: c})
	if err != nil {
		return
	}
	tmp := r.probeCachePath() + ".tmp" + strconv.Itoa(os.Getpid())
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return
	}
	if err := os.Rename(tmp, r.probeCachePath()); err != nil {
		_ = os.Remove(tmp)
	}
}
