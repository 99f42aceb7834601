package store

import (
	"reflect"
	"sync"

	"github.com/spacehq/space/api"
)

// recordCache keeps the sandbox records read or written through this DB,
// so that GetSandbox — which every exec, files call and status read makes,
// some twice — is a map lookup and a copy instead of a SQL query and a
// JSON decode. It is write-through: PutSandbox and DeleteSandbox update it
// while they still hold writeMu, so writes reach it in commit order. A read
// that misses fills it only if no write happened since the read began
// (gen), so a slow reader never puts back a record older than the last
// write. What it holds is the record decoded from the stored JSON (so a hit
// equals what a read from SQLite returns, times' locations included), and
// each caller gets a deep copy of it (maps, slices and pointers included).
//
// It relies on this DB being the only writer of the sandboxes table: the
// server is the only process that writes it, and it opens one DB.
type recordCache struct {
	mu   sync.Mutex
	gen  uint64
	recs map[string]*api.Sandbox
}

func newRecordCache() *recordCache { return &recordCache{recs: map[string]*api.Sandbox{}} }

// get returns a copy of the cached record of id, or ok=false and the
// generation a fill after the read must present.
func (c *recordCache) get(id string) (sb api.Sandbox, gen uint64, ok bool) {
	c.mu.Lock()
	rec, ok := c.recs[id]
	gen = c.gen
	c.mu.Unlock()
	if ok {
		// rec is never changed once cached: copying outside the lock
		// is safe.
		sb = deepCopy(*rec)
	}
	return sb, gen, ok
}

// fill stores what a read found, unless a write came in between. The
// cache keeps its own copy.
func (c *recordCache) fill(id string, sb api.Sandbox, gen uint64) {
	rec := deepCopy(sb)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen == gen {
		c.recs[id] = &rec
	}
}

// put records a committed write of id; rec nil = the record is gone or
// unknown (a failed or uncertain write): read it again next time.
func (c *recordCache) put(id string, rec *api.Sandbox) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	if rec == nil {
		delete(c.recs, id)
		return
	}
	c.recs[id] = rec
}

// deepCopy copies v so that no map, slice or pointer reachable through its
// exported fields is shared with v. Unexported fields are copied by value
// (time.Time's location pointer: immutable).
func deepCopy[T any](v T) T {
	var out T
	copyValue(reflect.ValueOf(&out).Elem(), reflect.ValueOf(v))
	return out
}

func copyValue(dst, src reflect.Value) {
	switch src.Kind() {
	case reflect.Pointer:
		if src.IsNil() {
			return
		}
		p := reflect.New(src.Type().Elem())
		copyValue(p.Elem(), src.Elem())
		dst.Set(p)
	case reflect.Map:
		if src.IsNil() {
			return
		}
		m := reflect.MakeMapWithSize(src.Type(), src.Len())
		it := src.MapRange()
		for it.Next() {
			v := reflect.New(src.Type().Elem()).Elem()
			copyValue(v, it.Value())
			m.SetMapIndex(it.Key(), v)
		}
		dst.Set(m)
	case reflect.Slice:
		if src.IsNil() {
			return
		}
		s := reflect.MakeSlice(src.Type(), src.Len(), src.Len())
		for i := 0; i < src.Len(); i++ {
			copyValue(s.Index(i), src.Index(i))
		}
		dst.Set(s)
	case reflect.Array:
		for i := 0; i < src.Len(); i++ {
			copyValue(dst.Index(i), src.Index(i))
		}
	case reflect.Interface:
		if src.IsNil() {
			return
		}
		v := reflect.New(src.Elem().Type()).Elem()
		copyValue(v, src.Elem())
		dst.Set(v)
	case reflect.Struct:
		dst.Set(src)
		t := src.Type()
		for i := 0; i < t.NumField(); i++ {
			if t.Field(i).IsExported() {
				copyValue(dst.Field(i), src.Field(i))
			}
		}
	default:
		dst.Set(src)
	}
}
