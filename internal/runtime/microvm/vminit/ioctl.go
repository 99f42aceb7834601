package vminit

import (
	"encoding/binary"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// putInt32 writes v in the guest's (and so the kernel ABI's) byte order:
// microvm guests are x86-64, little-endian.
func putInt32(b []byte, v int32) { binary.LittleEndian.PutUint32(b, uint32(v)) }

// ioctlPtr calls ioctl(f, req, &buf[0]).
func ioctlPtr(f *os.File, req uint, buf []byte) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&buf[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// loopbackUp brings up lo: the guest has no other interface, and nothing
// in the sandbox may configure the network (its namespace is guest
// root's), so without this 127.0.0.1 would not work.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo up: %w", err)
	}
	return nil
}
