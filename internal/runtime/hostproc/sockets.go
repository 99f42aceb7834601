package hostproc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// SocketOwner finds which of pids holds the socket of proto ("tcp") from
// local to remote in the network namespace of process netPid, and returns
// that process's executable. Everything it reads is the kernel's view
// (sock_diag in netPid's network namespace, /proc/<pid>/fd,
// /proc/<pid>/exe), never a
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

// socketInode asks the kernel, over sock_diag in the namespace of netPid,
// for the inode of the TCP socket local→remote: an exact lookup in the
// socket hash (reading /proc/<pid>/net/tcp walks every socket of the host,
// ~10 ms on a busy one). A v4 pair is also tried as the v4-mapped pair of
// a dual-stack v6 socket.
func socketInode(netPid int, local, remote netip.AddrPort) (uint64, error) {
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", netPid))
	if err != nil {
		return 0, fmt.Errorf("socket owner: %w", err)
	}
	defer ns.Close()
	fd, err := diagSocketIn(ns)
	if err != nil {
		return 0, fmt.Errorf("socket owner: sock_diag socket in the namespace: %w", err)
	}
	defer unix.Close(fd)
	l, r := local.Addr().Unmap(), remote.Addr().Unmap()
	type try struct {
		family uint8
		l, r   netip.Addr
	}
	tries := []try{{unix.AF_INET6, l, r}}
	if l.Is4() && r.Is4() {
		tries = []try{{unix.AF_INET, l, r}, {unix.AF_INET6, netip.AddrFrom16(l.As16()), netip.AddrFrom16(r.As16())}}
	}
	for _, tr := range tries {
		ino, err := diagLookup(fd, tr.family, netip.AddrPortFrom(tr.l, local.Port()), netip.AddrPortFrom(tr.r, remote.Port()))
		if err == nil && ino != 0 {
			return ino, nil
		}
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("socket owner: sock_diag: %w", err)
		}
	}
	return 0, fmt.Errorf("socket owner: no socket %s→%s: %w", local, remote, errdefs.ErrNotFound)
}

// diagSocketIn opens a NETLINK_SOCK_DIAG socket in the network namespace
// ns (a socket answers for the namespace it was created in). The thread
// that enters ns is its own goroutine's, locked: should it fail to come
// back, it exits with the goroutine instead of serving anything else.
func diagSocketIn(ns *os.File) (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{-1, err}
			return
		}
		defer self.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{-1, err}
			return
		}
		fd, serr := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			if serr == nil {
				unix.Close(fd)
			}
			ch <- result{-1, fmt.Errorf("returning to the host's namespace: %w", err)} // the thread stays locked and goes
			return
		}
		runtime.UnlockOSThread()
		ch <- result{fd, serr}
	}()
	r := <-ch
	return r.fd, r.err
}

// diagLookup sends one exact inet_diag_req_v2 (family, TCP, every state,
// the socket id local→remote) and returns the inode of the answer.
func diagLookup(fd int, family uint8, local, remote netip.AddrPort) (uint64, error) {
	const hdr, reqLen = unix.SizeofNlMsghdr, 56
	b := make([]byte, hdr+reqLen)
	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST)
	binary.NativeEndian.PutUint32(b[8:], 1) // seq
	q := b[hdr:]
	q[0], q[1] = family, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(q[4:], 0xffffffff) // every state
	id := q[8:]
	binary.BigEndian.PutUint16(id[0:], local.Port())
	binary.BigEndian.PutUint16(id[2:], remote.Port())
	putAddr(id[4:20], local.Addr())
	putAddr(id[20:36], remote.Addr())
	binary.NativeEndian.PutUint32(id[40:], 0xffffffff) // INET_DIAG_NOCOOKIE
	binary.NativeEndian.PutUint32(id[44:], 0xffffffff)
	if err := unix.Sendto(fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return 0, err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return 0, err
		}
		for _, m := range msgs {
			if m.Header.Seq != 1 {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_ERROR:
				if len(m.Data) < 4 {
					return 0, errors.New("short netlink error")
				}
				if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
					return 0, unix.Errno(-e)
				}
				return 0, unix.ENOENT
			case unix.SOCK_DIAG_BY_FAMILY:
				// inet_diag_msg: family, state, timer, retrans, the id
				// (48), expires, rqueue, wqueue, uid, inode.
				if len(m.Data) < 72 {
					return 0, errors.New("short inet_diag_msg")
				}
				return uint64(binary.NativeEndian.Uint32(m.Data[68:])), nil
			}
		}
	}
}

// putAddr writes a as inet_diag_sockid writes an address: 4 bytes for v4,
// 16 for v6, network order, the rest zero.
func putAddr(dst []byte, a netip.Addr) {
	if a.Is4() {
		v := a.As4()
		copy(dst, v[:])
		return
	}
	v := a.As16()
	copy(dst, v[:])
}
