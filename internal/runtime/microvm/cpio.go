package microvm

import (
	"fmt"
	"io"
	"strings"
)

// cpioWriter writes the "newc" cpio format the kernel unpacks as an
// initramfs (Documentation/driver-api/early-userspace/buffer-format.rst).
// Every header field is fixed except what the entry needs, so the same
// inputs give the same bytes (the initramfs cache key is its inputs).
type cpioWriter struct {
	w   io.Writer
	ino uint32
	off int64
	err error
}

// Mode type bits of a cpio entry (as in stat's st_mode).
const (
	cpioDir  = 0o040000
	cpioReg  = 0o100000
	cpioChar = 0o020000
)

func (c *cpioWriter) write(b []byte) {
	if c.err != nil {
		return
	}
	n, err := c.w.Write(b)
	c.off += int64(n)
	c.err = err
}

func (c *cpioWriter) pad() {
	if r := c.off % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// entry writes one header and name; the caller writes size bytes of data
// after it (regular files only) and then calls pad.
func (c *cpioWriter) entry(name string, mode uint32, size int64, rdevMajor, rdevMinor uint32) {
	if strings.ContainsRune(name, 0) || size > 0xffffffff {
		c.err = fmt.Errorf("cpio: cannot store %q (%d bytes)", name, size)
		return
	}
	c.ino++
	nlink := uint32(1)
	if mode&0o170000 == cpioDir {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, uint32(size), 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	c.write([]byte(hdr))
	c.write(append([]byte(name), 0))
	c.pad()
}

func (c *cpioWriter) dir(name string) { c.entry(name, cpioDir|0o755, 0, 0, 0) }

func (c *cpioWriter) charDev(name string, perm, major, minor uint32) {
	c.entry(name, cpioChar|perm, 0, major, minor)
}

func (c *cpioWriter) file(name string, perm uint32, size int64, data io.Reader) {
	c.entry(name, cpioReg|perm, size, 0, 0)
	if c.err != nil {
		return
	}
	n, err := io.Copy(writerFunc(func(b []byte) (int, error) { c.write(b); return len(b), c.err }), io.LimitReader(data, size))
	if err == nil && n != size {
		err = fmt.Errorf("cpio: %s: got %d of %d bytes", name, n, size)
	}
	if c.err == nil {
		c.err = err
	}
	c.pad()
}

// close writes the trailer entry.
func (c *cpioWriter) close() error {
	c.ino = 0
	c.entry("TRAILER!!!", 0, 0, 0, 0)
	return c.err
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
