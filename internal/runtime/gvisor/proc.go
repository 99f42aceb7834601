package gvisor

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// pidRecord names the sandbox process (runsc's sentry) across server
// restarts: a pid alone could be reused by an unrelated process.
type pidRecord struct {
	Pid       int
	StartTime uint64
}

// procStartTime is field 22 of /proc/<pid>/stat, in clock ticks since boot.
func procStartTime(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// comm may contain spaces and parentheses: fields start after the last ')'.
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

func writePidFile(path string, rec pidRecord) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(fmt.Sprintf("%d %d\n", rec.Pid, rec.StartTime)), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func readPidFile(path string) (pidRecord, error) {
	var rec pidRecord
	data, err := os.ReadFile(path)
	if err != nil {
		return rec, err
	}
	if _, err := fmt.Sscanf(string(data), "%d %d", &rec.Pid, &rec.StartTime); err != nil {
		return rec, fmt.Errorf("pid file %s: %v", path, err)
	}
	return rec, nil
}

// liveProcess opens a pidfd for rec if that very process still runs.
func liveProcess(rec pidRecord) (int, bool) {
	if rec.Pid <= 0 {
		return -1, false
	}
	pidfd, err := unix.PidfdOpen(rec.Pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return -1, false
	}
	// Checked after opening the pidfd, so the pidfd names the process whose
	// start time matched.
	if st, err := procStartTime(rec.Pid); err != nil || st != rec.StartTime {
		unix.Close(pidfd)
		return -1, false
	}
	return pidfd, true
}

// watchExit returns a channel closed when the process behind pidfd exits.
// It takes ownership of pidfd.
func watchExit(pidfd int) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		defer unix.Close(pidfd)
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		for {
			_, err := unix.Poll(fds, -1)
			if err == nil || err != unix.EINTR {
				return
			}
		}
	}()
	return ch
}
