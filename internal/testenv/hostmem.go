package testenv

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Rollup returns the Rss and Pss (KiB) of pid from /proc/PID/smaps_rollup,
// or zeros if the process is gone. Benchmarks use it to report host memory
// per sandbox.
func Rollup(pid int) (rss, pss int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 2 {
			continue
		}
		v, _ := strconv.ParseInt(fs[1], 10, 64)
		switch fs[0] {
		case "Rss:":
			rss = v
		case "Pss:":
			pss = v
		}
	}
	return rss, pss
}

// MemInfo returns a /proc/meminfo field (e.g. "MemAvailable") in KiB, or -1.
func MemInfo(key string) int64 {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && k == key {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				return -1
			}
			return n
		}
	}
	return -1
}

// ProcsNaming maps the pid of every host process (but this one) whose
// command line contains s to that command line, NULs shown as spaces: the
// runsc, QEMU or gateway processes of a sandbox or data directory.
func ProcsNaming(s string) map[int]string {
	out := map[int]string{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && strings.Contains(string(b), s) {
			out[pid] = strings.ReplaceAll(string(b), "\x00", " ")
		}
	}
	return out
}
