package runtime

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// ProbeCache memoizes a runtime's Probe for the life of the process and,
// optionally, keeps a successful result on disk for the rest of the host's
// boot, so a server start (or a test's runtime) does not pay for a probe
// that boots a sandbox every time. Its zero value is ready to use.
type ProbeCache struct {
	mu   sync.Mutex
	done bool
	caps Capabilities
}

// ProbeDisk says where a successful probe result is kept across
// processes. Its zero value keeps nothing on disk.
type ProbeDisk struct {
	// Key digests everything a result depends on (see ProbeKey). A
	// kept result is used only under the same key; when Key fails,
	// nothing is read or written.
	Key func() (string, error)
	// Files are where the result for key is kept: it is read from the
	// first that holds it and written to each (atomically; a directory
	// missing is created, 0700).
	Files func(key string) []string
}

// probeRecord is a kept result.
type probeRecord struct {
	Key  string       `json:"key"`
	Caps Capabilities `json:"caps"`
}

// Get returns the memoized result; else a result kept on disk under the
// current key, marked with Details["probe_cached"] = "true"; else it
// measures. A measured result is memoized unless measure says it is not
// final (a probe cut short by its caller, say), and kept on disk only if
// Available: a failed probe is measured again by the next process. Calls
// are serialized: a concurrent caller waits for the probe under way.
func (p *ProbeCache) Get(ctx context.Context, disk ProbeDisk, measure func(context.Context) (c Capabilities, final bool)) Capabilities {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return p.caps
	}
	key, kerr := "", fmt.Errorf("no disk copy")
	if disk.Key != nil && disk.Files != nil {
		key, kerr = disk.Key()
	}
	if kerr == nil {
		if c, ok := loadProbe(disk.Files(key), key); ok {
			p.caps, p.done = c, true
			return c
		}
	}
	c, final := measure(ctx)
	if !final {
		return c
	}
	p.caps, p.done = c, true
	if kerr == nil {
		storeProbe(disk.Files(key), key, c)
	}
	return c
}

func loadProbe(files []string, key string) (Capabilities, bool) {
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var rec probeRecord
		if json.Unmarshal(data, &rec) != nil || rec.Key != key || !rec.Caps.Available {
			continue
		}
		c := rec.Caps
		if c.Details == nil {
			c.Details = map[string]string{}
		}
		c.Details["probe_cached"] = "true"
		return c, true
	}
	return Capabilities{}, false
}

// storeProbe keeps a successful result; errors only cost the next process
// a probe.
func storeProbe(files []string, key string, c Capabilities) {
	if !c.Available {
		return
	}
	data, err := json.Marshal(probeRecord{Key: key, Caps: c})
	if err != nil {
		return
	}
	for _, f := range files {
		_ = os.MkdirAll(filepath.Dir(f), 0o700)
		tmp := f + ".tmp" + strconv.Itoa(os.Getpid())
		if err := os.WriteFile(tmp, data, 0o600); err != nil {
			continue
		}
		if err := os.Rename(tmp, f); err != nil {
			_ = os.Remove(tmp)
		}
	}
}

// ProbeKey digests what a probe result depends on: the kernel's boot id
// (a result is kept for one host boot at most), the effective uid, params
// (the runtime's own settings, one "name=value\n" each), and each of files
// and the running program (which holds the probe's own code) by path,
// device, inode, size and modification time.
func ProbeKey(params string, files ...string) (string, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "boot=%s\nuid=%d\n%s", strings.TrimSpace(string(boot)), os.Geteuid(), params)
	for _, p := range append(files[:len(files):len(files)], self) {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return "", fmt.Errorf("probe key: %w", &os.PathError{Op: "stat", Path: p, Err: err})
		}
		fmt.Fprintf(h, "%s %d %d %d %d.%d\n", p, st.Dev, st.Ino, st.Size, st.Mtim.Sec, st.Mtim.Nsec)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
