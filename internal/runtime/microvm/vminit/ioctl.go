package vminit

import (
	"encoding/binary"
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
