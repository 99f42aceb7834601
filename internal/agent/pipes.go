package agent

import (
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Pipes for child processes, made with as few system calls as possible:
// every exec pays for them, and system calls are expensive in the nested
// VMs sandboxes often run in. os.Pipe would register both ends with the
// runtime poller, and File.Fd would then switch the child's end back to
// blocking mode (about a dozen calls per pipe instead of four or five).
// The child's end here is a raw blocking descriptor, the agent's end is
// non-blocking and in the poller (so closing it interrupts a pending read
// or write).

// outPipe returns a pipe for a child's output: the agent's read end and
// the child's write end.
func outPipe() (*os.File, int, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return nil, -1, err
	}
	if _, err := unix.FcntlInt(uintptr(p[0]), unix.F_SETFL, unix.O_NONBLOCK); err != nil {
		unix.Close(p[0])
		unix.Close(p[1])
		return nil, -1, err
	}
	return os.NewFile(uintptr(p[0]), "|0"), p[1], nil
}

// inPipe returns a pipe for a child's input: the child's read end and the
// agent's write end.
func inPipe() (int, *os.File, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return -1, nil, err
	}
	if _, err := unix.FcntlInt(uintptr(p[1]), unix.F_SETFL, unix.O_NONBLOCK); err != nil {
		unix.Close(p[0])
		unix.Close(p[1])
		return -1, nil, err
	}
	return p[0], os.NewFile(uintptr(p[1]), "|1"), nil
}

// preloadedStdin returns the read end of a pipe that already holds data
// and whose write end is closed, when data fits into the pipe at once (a
// new pipe holds 64 KiB unless the user's pipe quota is exhausted). ok is
// false if it did not fit; nothing is left open then.
func preloadedStdin(data []byte) (fd int, ok bool, err error) {
	var p [2]int
	flags := unix.O_CLOEXEC
	if len(data) > 0 {
		flags |= unix.O_NONBLOCK
	}
	if err := unix.Pipe2(p[:], flags); err != nil {
		return -1, false, err
	}
	defer unix.Close(p[1])
	for len(data) > 0 {
		n, err := unix.Write(p[1], data)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			unix.Close(p[0])
			if err == unix.EAGAIN {
				err = nil
			}
			return -1, false, err
		}
		data = data[n:]
		if len(data) == 0 {
			// The child expects a blocking descriptor.
			if _, err := unix.FcntlInt(uintptr(p[0]), unix.F_SETFL, 0); err != nil {
				unix.Close(p[0])
				return -1, false, err
			}
		}
	}
	return p[0], true, nil
}

// closeFDs closes raw descriptors, skipping -1.
func closeFDs(fds ...int) {
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// readBufs recycles the buffers output is read into, so a stream of short
// execs does not allocate 64 KiB each.
var readBufs = sync.Pool{New: func() any { return new([maxOutputFrame]byte) }}
