package agent

// ring is a fixed-size replay buffer over an unbounded byte stream. Bytes
// are addressed by absolute offset from the start of the stream; once more
// than len(buf) bytes have been written the oldest are overwritten. Writes
// never block: a slow reader loses bytes and learns which ones (see read).
// A ring is not safe for concurrent use; its owner locks.
type ring struct {
	buf []byte
	end int64 // absolute offset one past the newest byte
}

func newRing(size int) *ring { return &ring{buf: make([]byte, size)} }

// start is the absolute offset of the oldest byte still held.
func (r *ring) start() int64 { return max(0, r.end-int64(len(r.buf))) }

func (r *ring) write(p []byte) {
	n := len(r.buf)
	if len(p) > n {
		r.end += int64(len(p) - n)
		p = p[len(p)-n:]
	}
	pos := int(r.end % int64(n))
	c := copy(r.buf[pos:], p)
	copy(r.buf, p[c:])
	r.end += int64(len(p))
}

// read copies bytes starting at off into dst. It returns how many it
// copied, the offset of the first copied byte (off, or the oldest retained
// offset if off was already overwritten), and whether [off, from) was lost.
// An off beyond the end is treated as the end.
func (r *ring) read(off int64, dst []byte) (n int, from int64, lost bool) {
	from = min(max(off, 0), r.end)
	if s := r.start(); from < s {
		from, lost = s, true
	}
	avail := r.end - from
	n = int(min(avail, int64(len(dst))))
	size := int64(len(r.buf))
	pos := int(from % size)
	c := copy(dst[:n], r.buf[pos:])
	copy(dst[c:n], r.buf)
	return n, from, lost
}
