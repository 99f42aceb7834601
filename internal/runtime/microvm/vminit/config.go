package vminit

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
)

// config is what the host put on the kernel command line.
type config struct {
	hostname  string // "" leaves the kernel's and the template's
	memoryMiB int64  // 0: no memory.max
	pids      int64  // 0: no pids.max
}

// hostnameRE is one RFC 1123 label, as the host checks it (qemu.go).
var hostnameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// Bounds of the limits: a guest has at most a few TiB of memory, and the
// kernel's pid space is 4M.
const (
	maxMemoryMiB = 1 << 22
	maxPids      = 1 << 22
)

func configFromEnv() (config, error) {
	var c config
	c.hostname = os.Getenv(EnvHostname)
	if c.hostname != "" && !hostnameRE.MatchString(c.hostname) {
		return c, fmt.Errorf("%s=%q is not a hostname", EnvHostname, c.hostname)
	}
	var err error
	if c.memoryMiB, err = positive(EnvMemoryMiB, maxMemoryMiB); err != nil {
		return c, err
	}
	if c.pids, err = positive(EnvPids, maxPids); err != nil {
		return c, err
	}
	return c, nil
}

// positive parses the variable k as an integer in 1..limit; unset is 0.
func positive(k string, limit int64) (int64, error) {
	v := os.Getenv(k)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 || n > limit {
		return 0, fmt.Errorf("%s=%q is not a number in 1..%d", k, v, limit)
	}
	return n, nil
}
