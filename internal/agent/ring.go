package agent

// ring is a fixed-capacity replay buffer over an unbounded byte stream.
// Bytes are addressed by absolute offset from the start of the stream; once
// more than size bytes have been written the oldest are overwritten. Writes
// never block: a slow reader loses bytes and learns which ones (see read).
// Memory grows with the output up to size, so a thousand quiet processes
// do not cost a thousand full buffers. A ring is not safe for concurrent
// use; its owner locks.
type ring struct {
	size int
	buf  []byte // len(buf) < size: holds exactly [0, end); else byte o is at o % size
	end  int64  // absolute offset one past the newest byte
}

func newRing(size int) *ring { return &ring{size: size} }

// start is the absolute offset of the oldest byte still held.
func (r *ring) start() int64 { return max(0, r.end-int64(r.size)) }

func (r *ring) write(p []byte) {
	if len(r.buf) < r.size {
		if len(r.buf)+len(p) < r.size {
			r.buf = append(r.buf, p...)
			r.end += int64(len(p))
			return
		}
		// Full from now on: positions stay o % size (o < size so far).
		full := make([]byte, r.size)
		copy(full, r.buf)
		r.buf = full
	}
	if len(p) > r.size {
		r.end += int64(len(p) - r.size)
		p = p[len(p)-r.size:]
	}
	pos := int(r.end % int64(r.size))
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
	n = int(min(r.end-from, int64(len(dst))))
	if n == 0 {
		return 0, from, lost
	}
	pos := int(from % int64(r.size))
	c := copy(dst[:n], r.buf[pos:])
	copy(dst[c:n], r.buf)
	return n, from, lost
}
