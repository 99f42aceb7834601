package hostproc

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/spacehq/space/internal/errdefs"
)

// SocketOwner finds which of pids holds the socket of proto ("tcp") from
// local to remote in the network namespace of process netPid, and returns
// that process's executable. Everything it reads is the kernel's view
// (/proc/<netPid>/net/tcp{,6}, /proc/<pid>/fd, /proc/<pid>/exe), never a
// process's own word; the caller (the host's root) must be able to read
// the processes' descriptors. Newer pids are tried first (the process that
// just connected is most often one of the newest). An error wrapping
// errdefs.ErrNotFound if no socket or no holder matches.
func SocketOwner(netPid int, pids []int, proto string, local, remote netip.AddrPort) (string, error) {
	if proto != "tcp" {
		return "", fmt.Errorf("socket owner: protocol %q: %w", proto, errdefs.ErrInvalidArgument)
	}
	ino, err := socketInode(netPid, local, remote)
	if err != nil {
		return "", err
	}
	link := "socket:[" + strconv.FormatUint(ino, 10) + "]"
	pids = slices.Clone(pids)
	slices.Sort(pids)
	slices.Reverse(pids)
	for _, pid := range pids {
		dir := fmt.Sprintf("/proc/%d/fd", pid)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue // gone, or a kernel thread
		}
		for _, e := range ents {
			if t, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && t == link {
				exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
				if err != nil {
					return "", fmt.Errorf("socket owner: pid %d holds the socket, its executable: %w", pid, err)
				}
				return exe, nil
			}
		}
	}
	return "", fmt.Errorf("socket owner: no process holds %s %s→%s: %w", proto, local, remote, errdefs.ErrNotFound)
}

// socketInode looks local→remote up in the namespace's TCP tables.
func socketInode(netPid int, local, remote netip.AddrPort) (uint64, error) {
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	remote = netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port())
	for _, table := range []string{"tcp", "tcp6"} {
		f, err := os.Open(fmt.Sprintf("/proc/%d/net/%s", netPid, table))
		if err != nil {
			if table == "tcp6" {
				continue // IPv6 compiled out or disabled
			}
			return 0, fmt.Errorf("socket owner: %w", err)
		}
		ino, found, err := findInode(f, local, remote)
		f.Close()
		if err != nil {
			return 0, err
		}
		if found {
			return ino, nil
		}
	}
	return 0, fmt.Errorf("socket owner: no socket %s→%s: %w", local, remote, errdefs.ErrNotFound)
}

// findInode scans one /proc/net/tcp{,6} table for the socket local→remote
// (addresses unmapped) and returns its inode (0 belongs to no process: a
// connection in TIME_WAIT; skipped).
func findInode(f *os.File, local, remote netip.AddrPort) (uint64, bool, error) {
	sc := bufio.NewScanner(f)
	sc.Scan() // the header
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 10 {
			continue
		}
		l, err1 := parseProcAddr(fs[1])
		r, err2 := parseProcAddr(fs[2])
		if err1 != nil || err2 != nil || l != local || r != remote {
			continue
		}
		ino, err := strconv.ParseUint(fs[9], 10, 64)
		if err != nil || ino == 0 {
			continue
		}
		return ino, true, nil
	}
	return 0, false, sc.Err()
}

// parseProcAddr parses an address of /proc/net/tcp{,6}: hex 32-bit words
// each in the host's byte order (little-endian on every architecture this
// runs on), ":" and the hex port. A v4-mapped v6 address comes back as v4.
func parseProcAddr(s string) (netip.AddrPort, error) {
	h, p, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("bad address %q", s)
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, err
	}
	raw, err := hex.DecodeString(h)
	if err != nil || (len(raw) != 4 && len(raw) != 16) {
		return netip.AddrPort{}, fmt.Errorf("bad address %q", s)
	}
	b := make([]byte, len(raw))
	for i := 0; i < len(raw); i += 4 {
		binary.BigEndian.PutUint32(b[i:], binary.LittleEndian.Uint32(raw[i:]))
	}
	a, _ := netip.AddrFromSlice(b)
	return netip.AddrPortFrom(a.Unmap(), uint16(port)), nil
}
