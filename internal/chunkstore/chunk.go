package chunkstore

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/klauspost/compress/zstd"
	"github.com/restic/chunker"
)

// polynomial is the Rabin polynomial every Store cuts with: fixed, so equal
// content is cut into equal chunks by every server, for every sandbox and
// across versions. It is irreducible (chunk_test.go checks); the one
// restic's chunker documents and tests with. Changing it, or the bounds in
// chunker (MinSize 512 KiB, MaxSize 8 MiB, about 1 MiB on average), stays
// correct but loses deduplication against everything stored before.
const polynomial = chunker.Pol(0x3DA3358B4DC173)

// chunking is where Put cuts: chunks of min to max bytes, a cut where the
// fingerprint's low avgBits bits are zero (2^avgBits bytes on average).
type chunking struct {
	min, max uint
	avgBits  int
}

// defaultChunking is chunker's: 512 KiB to 8 MiB, about 1 MiB on average:
// few enough objects for an object store, small enough that a change
// rewrites about a megabyte. Tests use smaller chunks to keep data small.
var defaultChunking = chunking{min: chunker.MinSize, max: chunker.MaxSize, avgBits: 20}

// MaxChunk bounds a chunk's length.
const MaxChunk = chunker.MaxSize

// ID names a chunk: the SHA-256 of its content.
type ID [sha256.Size]byte

func (id ID) String() string { return hex.EncodeToString(id[:]) }

func (id ID) MarshalText() ([]byte, error) { return []byte(id.String()), nil }

func (id *ID) UnmarshalText(b []byte) error {
	p, err := ParseID(string(b))
	if err != nil {
		return err
	}
	*id = p
	return nil
}

// ParseID parses 64 lowercase hex digits.
func ParseID(s string) (ID, error) {
	var id ID
	if len(s) != 2*len(id) || s != string(bytes.ToLower([]byte(s))) {
		return id, fmt.Errorf("chunk id %q: not 64 lowercase hex digits", s)
	}
	if _, err := hex.Decode(id[:], []byte(s)); err != nil {
		return id, fmt.Errorf("chunk id %q: %v", s, err)
	}
	return id, nil
}

const chunkPrefix = "chunks/"

// key is where the chunk is stored: chunks/ab/abcdef….
func (id ID) key() string {
	h := id.String()
	return chunkPrefix + h[:2] + "/" + h
}

// idFromKey is the inverse of key; ok is false for any other key.
func idFromKey(key string) (ID, bool) {
	if len(key) != len(chunkPrefix)+3+64 || key[:len(chunkPrefix)] != chunkPrefix {
		return ID{}, false
	}
	id, err := ParseID(key[len(chunkPrefix)+3:])
	if err != nil || id.key() != key {
		return ID{}, false
	}
	return id, true
}

// A stored chunk is one format byte and the payload.
const (
	formatRaw  byte = 0
	formatZstd byte = 1
)

var codec = sync.OnceValues(func() (*zstd.Encoder, *zstd.Decoder) {
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
	if err != nil {
		panic(err)
	}
	dec, err := zstd.NewReader(nil, zstd.WithDecoderMaxMemory(MaxChunk),
		zstd.WithDecodeAllCapLimit(true), zstd.WithDecoderConcurrency(0))
	if err != nil {
		panic(err)
	}
	return enc, dec
})

// maxBlob bounds a stored chunk: a format byte, and a chunk that did not
// compress (zstd's raw blocks add 3 bytes per 128 KiB and a frame header).
const maxBlob = 1 + MaxChunk + MaxChunk/1024 + 256

// encode appends to dst[:0] the blob to store for data: zstd when compress
// is set and that is smaller, else the bytes as they are.
func encode(dst, data []byte, compress bool) []byte {
	out := append(dst[:0], formatZstd)
	if compress {
		enc, _ := codec()
		out = enc.EncodeAll(data, out)
		if len(out) < 1+len(data) {
			return out
		}
	}
	out[0] = formatRaw
	return append(out[:1], data...)
}

// decode returns the content of a stored blob and checks it is size bytes
// hashing to id; a failure wraps ErrCorrupt.
func decode(blob []byte, id ID, size int) ([]byte, error) {
	if len(blob) == 0 {
		return nil, fmt.Errorf("%w: empty blob", ErrCorrupt)
	}
	var data []byte
	switch blob[0] {
	case formatRaw:
		data = blob[1:]
	case formatZstd:
		_, dec := codec()
		var err error
		// DecodeAll stops at the capacity: no frame can make it allocate more.
		data, err = dec.DecodeAll(blob[1:], make([]byte, 0, size))
		if err != nil {
			return nil, fmt.Errorf("%w: zstd: %v", ErrCorrupt, err)
		}
	default:
		return nil, fmt.Errorf("%w: unknown format byte %d", ErrCorrupt, blob[0])
	}
	if len(data) != size {
		return nil, fmt.Errorf("%w: %d bytes, the manifest says %d", ErrCorrupt, len(data), size)
	}
	if got := ID(sha256.Sum256(data)); got != id {
		return nil, fmt.Errorf("%w: the content hashes to %s", ErrCorrupt, got)
	}
	return data, nil
}
