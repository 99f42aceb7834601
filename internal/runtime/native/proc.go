package native

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

// mountsUnder lists mount points at or below dir, deepest first, from
// /proc/self/mountinfo.
func mountsUnder(dir string) ([]string, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	dir = filepath.Clean(dir)
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMount(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	// Deeper paths first so nested mounts go before their parents.
	for i := 0; i < len(out); i++ {
		for j := i + 1; j < len(out); j++ {
			if len(out[j]) > len(out[i]) {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out, nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for space, …).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// isMountPoint reports whether dir is the root of a mount. statx answers
// in O(1); the mount table, which grows with every running sandbox, is
// only read on kernels without STATX_ATTR_MOUNT_ROOT.
func isMountPoint(dir string) bool {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx); err != nil {
		return false
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
	}
	m, err := mountsUnder(dir)
	if err != nil {
		return false
	}
	for _, p := range m {
		if p == filepath.Clean(dir) {
			return true
		}
	}
	return false
}
