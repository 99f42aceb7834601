package agent

import (
	"bytes"
	"math/rand/v2"
	"testing"
)

// TestRingMatchesModel writes random chunks and checks every read against
// the tail of the full stream.
func TestRingMatchesModel(t *testing.T) {
	for _, size := range []int{1, 7, 64, 4096} {
		r := newRing(size)
		var all []byte
		rng := rand.New(rand.NewPCG(1, uint64(size)))
		for i := 0; i < 2000; i++ {
			chunk := make([]byte, rng.IntN(3*size+2))
			for j := range chunk {
				chunk[j] = byte(rng.Uint32())
			}
			r.write(chunk)
			all = append(all, chunk...)
			if r.end != int64(len(all)) {
				t.Fatalf("end %d, want %d", r.end, len(all))
			}
			off := int64(rng.IntN(len(all) + 2))
			dst := make([]byte, rng.IntN(size+1)+1)
			n, from, lost := r.read(off, dst)
			oldest := max(0, int64(len(all)-size))
			wantFrom := min(max(off, oldest), int64(len(all)))
			if from != wantFrom || lost != (off < oldest) {
				t.Fatalf("size %d: read(%d) from=%d lost=%v, want from=%d lost=%v", size, off, from, lost, wantFrom, off < oldest)
			}
			want := all[from:min(int64(len(all)), from+int64(len(dst)))]
			if !bytes.Equal(dst[:n], want) {
				t.Fatalf("size %d: read(%d) returned wrong bytes", size, off)
			}
		}
		if len(r.buf) > size {
			t.Fatalf("ring grew to %d > %d", len(r.buf), size)
		}
	}
}
