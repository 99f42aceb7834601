// Package cgroupfs is the host runtimes' cgroup layer, v1 and v2 alike
// (Layout, Group: create with limits, add, freeze, kill, remove; see
// group.go), and the readers of the counters cgroup filesystems expose:
// single-value files (memory.current, pids.current) and flat-keyed ones
// (memory.events, cpu.stat, memory.oom_control). The microvm guest's init
// reads its sandbox's cgroup with the readers.
package cgroupfs

import (
	"os"
	"strconv"
	"strings"
)

// ReadInt reads a file holding one integer.
func ReadInt(path string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

// ReadKey finds "key value" in a flat-keyed file; 0 when no line has the
// key (kernels add keys over time).
func ReadKey(path, key string) (int64, error) {
	n, _, err := LookupKey(path, key)
	return n, err
}

// lookupKeyIn finds "key value" among the lines of b.
func lookupKeyIn(b []byte, key string) (value int64, found bool, err error) {
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if ok && k == key {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil, err
		}
	}
	return 0, false, nil
}

// LookupKey is ReadKey that also says whether the key was there.
func LookupKey(path, key string) (value int64, found bool, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false, err
	}
	return lookupKeyIn(b, key)
}
