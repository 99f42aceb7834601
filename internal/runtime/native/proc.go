package native

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// procStartTime returns field 22 of /proc/<pid>/stat (start time in clock
// ticks since boot). Together with the pid it names one process for the
// lifetime of the host, which is what makes re-adoption after a server
// restart safe against pid reuse.
func procStartTime(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// comm (field 2) may contain spaces and parentheses: split after the last ')'.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	fields := strings.Fields(string(data[i+1:]))
	// fields[0] is field 3 (state); field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	if fields[0] == "Z" || fields[0] == "X" {
		return 0, fmt.Errorf("process %d is dead: %w", pid, os.ErrNotExist)
	}
	return strconv.ParseUint(fields[19], 10, 64)
}

// pidRecord is the content of sandboxes/<id>/init.pid.
type pidRecord struct {
	Pid       int
	StartTime uint64
}

func writePidFile(path string, rec pidRecord) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d %d\n", rec.Pid, rec.StartTime), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func readPidFile(path string) (pidRecord, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return pidRecord{}, err
	}
	var rec pidRecord
	if _, err := fmt.Sscanf(string(data), "%d %d", &rec.Pid, &rec.StartTime); err != nil || rec.Pid <= 1 {
		return pidRecord{}, fmt.Errorf("malformed pid file %s", path)
	}
	return rec, nil
}

// liveProcess opens a pidfd for rec if, and only if, that exact process is
// still running.
func liveProcess(rec pidRecord) (int, bool) {
	fd, err := unix.PidfdOpen(rec.Pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return -1, false
	}
	// Check the start time after opening the pidfd: if it still matches,
	// the pidfd refers to the right process even if it dies right after.
	st, err := procStartTime(rec.Pid)
	if err != nil || st != rec.StartTime {
		unix.Close(fd)
		return -1, false
	}
	return fd, true
}

// watchExit returns a channel closed when the process behind pidfd exits.
// The pidfd is non-blocking, so the wait parks in Go's netpoller rather than
// holding an OS thread per sandbox. It takes ownership of pidfd.
func watchExit(pidfd int) <-chan struct{} {
	ch := make(chan struct{})
	f := os.NewFile(uintptr(pidfd), "pidfd")
	go func() {
		defer close(ch)
		defer f.Close()
		rc, err := f.SyscallConn()
		if err != nil {
			return
		}
		_ = rc.Read(func(fd uintptr) bool {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(pfd, 0)
			return (n > 0 && pfd[0].Revents != 0) || (err != nil && !errors.Is(err, unix.EINTR))
		})
	}()
	return ch
}
