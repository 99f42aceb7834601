package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/microvm/jail"
)

// The sandbox's NIC.
//
// A virtio-net device (MAC hostnet.SandboxMAC) whose QEMU backend is
// -netdev dgram over two unix datagram sockets in the sandbox's vm/
// directory: QEMU binds vm/net.sock and sends every frame the guest
// transmits, one datagram per frame, to the path vm/gw.sock; what arrives
// on its own socket it hands to the guest. NIC binds a fresh socket at
// vm/gw.sock, connects it to vm/net.sock and returns it: a SOCK_DGRAM
// descriptor that reads and writes exactly one Ethernet frame per call.
//
// Why paths and not a socketpair whose other end QEMU inherits: the host's
// end of a pair must stay open in some process for as long as the VM runs,
// and across a gateway restart and a server restart (QEMU outlives both);
// nothing else on the host does. With paths nobody has to keep anything:
// QEMU looks its peer up by name for every frame, so whichever socket is
// bound there now gets the frames — NIC after a gateway restart reaches the
// same guest NIC. While nothing is bound there (no gateway yet, or between
// two), QEMU's sendto fails and the frame is dropped: the guest sees a
// link with nobody on it, as with an unattached TAP.
//
// One descriptor at a time: a live socket bound at vm/gw.sock answers a
// connect, and NIC refuses (errdefs.ErrConflict); a stale one (its
// descriptor closed everywhere) refuses connections and is replaced. The
// host's socket is connected to QEMU's, so it receives datagrams from
// QEMU's socket alone (the kernel drops anything another sender tries).
// Each QEMU (boot, restore, fork child, warm clone) binds its own
// net.sock: vmm.stop removes both files, so a descriptor of an earlier
// QEMU can neither block nor reach a later one, and the caller asks NIC
// again after every start or restore.
//
// vm/ is QEMU's to write, and QEMU runs a guest that may own it: the host
// never follows a link there. gw.sock is bound through the directory's
// descriptor (bind never follows the last component; it fails on
// anything already there, which is unlinked first) and handed to QEMU's
// uid (lchown) so that QEMU may send to it; net.sock is connected through
// an O_PATH descriptor opened without following (openSocket). Both sockets
// live in the jail's mount namespace at the same path as on the host (vm/
// is bound there), and only root and QEMU's uid can name them.

// NIC implements runtime.NICProvider.
func (i *instance) NIC(ctx context.Context) (*os.File, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if !i.Alive() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", i.spec.ID, errdefs.ErrConflict)
	}
	vm, err := i.files.readVM()
	if err != nil {
		return nil, err
	}
	if vm.NetSocket == "" {
		// Booted by a version of the runtime that gave VMs no NIC; it
		// gets one at its next boot.
		return nil, fmt.Errorf("sandbox %s: its VM has no network device (booted before NICs existed; stop and start it): %w", i.spec.ID, errdefs.ErrNotSupported)
	}
	f, err := openNIC(vm.NetSocket, vm.NetPeer, jail.UID(i.spec.ID))
	if err != nil {
		return nil, fmt.Errorf("sandbox %s NIC: %w", i.spec.ID, err)
	}
	return f, nil
}

// openNIC binds a new unix datagram socket at peer (owned by uid, which
// must be able to send to it), connects it to QEMU's socket at qemuSock
// and returns it, non-blocking. It fails with ErrConflict while a socket
// bound at peer is still open.
func openNIC(qemuSock, peer string, uid uint32) (_ *os.File, err error) {
	dir, name := filepath.Split(peer)
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dfd)
	inDir := "/proc/self/fd/" + strconv.Itoa(dfd) + "/" + name

	var st unix.Stat_t
	switch err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
	case err != nil:
		return nil, err
	default:
		if st.Mode&unix.S_IFMT == unix.S_IFSOCK {
			live, err := socketLive(dfd, name)
			if err != nil {
				return nil, err
			}
			if live {
				return nil, fmt.Errorf("a descriptor of the NIC is still open: %w", errdefs.ErrConflict)
			}
		}
		// A stale socket, or whatever else QEMU put there.
		if err := unix.Unlinkat(dfd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return nil, err
		}
	}

	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: inDir}); err != nil {
		if errors.Is(err, unix.EADDRINUSE) {
			// Someone bound it between the check and here.
			return nil, fmt.Errorf("binding %s: %w: %w", peer, err, errdefs.ErrConflict)
		}
		return nil, fmt.Errorf("binding %s: %w", peer, err)
	}
	defer func() {
		if err != nil {
			_ = unix.Unlinkat(dfd, name, 0)
		}
	}()
	if err := unix.Fchownat(dfd, name, int(uid), int(uid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, fmt.Errorf("giving %s to QEMU: %w", peer, err)
	}
	qfd, err := openSocket(qemuSock)
	if err != nil {
		return nil, fmt.Errorf("QEMU's end of the NIC: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer unix.Close(qfd)
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: "/proc/self/fd/" + strconv.Itoa(qfd)}); err != nil {
		return nil, fmt.Errorf("connecting to QEMU's end of the NIC: %w: %w", err, errdefs.ErrUnavailable)
	}
	return os.NewFile(uintptr(fd), "microvm-nic"), nil
}

// socketLive reports whether the socket file name in dfd has a socket
// bound to it (a connect succeeds) rather than being left over.
func socketLive(dfd int, name string) (bool, error) {
	pfd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, err
	}
	defer unix.Close(pfd)
	probe, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer unix.Close(probe)
	// A live socket connected to another (the host's end, connected to
	// QEMU's) refuses the probe with EPERM; one nobody has open, with
	// ECONNREFUSED.
	switch err := unix.Connect(probe, &unix.SockaddrUnix{Name: "/proc/self/fd/" + strconv.Itoa(pfd)}); {
	case err == nil, errors.Is(err, unix.EPERM):
		return true, nil
	case errors.Is(err, unix.ECONNREFUSED), errors.Is(err, unix.ENOENT):
		return false, nil
	default:
		return false, err
	}
}
