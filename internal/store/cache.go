package store

import "sync"

// recordCache keeps the encoded record (the data column's JSON) of the
// sandboxes read or written through this DB, so that GetSandbox — which
// every exec, files call and status read makes — is a map lookup and a
// decode instead of a SQL query. It is write-through: PutSandbox and
// DeleteSandbox update it while they still hold writeMu, so writes reach
// it in commit order. A read that misses fills it only if no write
// happened since the read began (gen), so a slow reader never puts back a
// record older than the last write. Decoding on every hit gives each
// caller its own copy (maps and pointers included), exactly as a read from
// SQLite did.
//
// It relies on this DB being the only writer of the sandboxes table: the
// server is the only process that writes it, and it opens one DB.
type recordCache struct {
	mu   sync.Mutex
	gen  uint64
	data map[string][]byte
}

func newRecordCache() *recordCache { return &recordCache{data: map[string][]byte{}} }

// get returns the cached record of id, or ok=false and the generation a
// fill after the read must present.
func (c *recordCache) get(id string) (data []byte, gen uint64, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	data, ok = c.data[id]
	return data, c.gen, ok
}

// fill stores what a read found, unless a write came in between.
func (c *recordCache) fill(id string, data []byte, gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen == gen {
		c.data[id] = data
	}
}

// put records a committed write of id; data nil = the record is gone or
// unknown (a failed or uncertain write), read it again next time.
func (c *recordCache) put(id string, data []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	if data == nil {
		delete(c.data, id)
		return
	}
	c.data[id] = data
}
