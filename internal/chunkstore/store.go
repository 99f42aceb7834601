package chunkstore

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/restic/chunker"

	"github.com/spacehq/space/internal/errdefs"
)

// Options tune a Store; the zero value is the default.
type Options struct {
	// NoCompression stores chunks as they are. By default each chunk is
	// compressed with zstd (fastest level) when that makes it smaller.
	NoCompression bool
	// LeaseTTL is how long GC spares the chunks of a Put that has not been
	// committed yet (default 1 hour). A Commit after that still never
	// commits a missing chunk: it fails with ErrMissing instead.
	LeaseTTL time.Duration
	// Now is the clock for leases (default time.Now).
	Now func() time.Time
}

// Store is a content-addressed chunk store with named manifests on a
// Backend. Its methods are safe for concurrent use. See the package comment.
type Store struct {
	b        Backend
	cut      chunking
	compress bool
	leaseTTL time.Duration
	now      func() time.Time

	gcMu sync.Mutex // one GC at a time

	mu sync.Mutex
	// leases: chunks a Put used, spared by GC until the time given.
	leases map[ID]time.Time // +checklocks:mu
	// holds: chunks an unfinished Commit or an open Reader uses.
	holds map[ID]int // +checklocks:mu
	// deleting: chunks GC is deleting now; the channel closes when done.
	deleting map[ID]chan struct{} // +checklocks:mu
	// gcs: the GCs past their mark phase; Commit adds its chunks to each.
	gcs map[*gcRun]struct{} // +checklocks:mu
}

// New returns a Store on b.
func New(b Backend, o Options) *Store {
	s := &Store{
		b:        b,
		cut:      defaultChunking,
		compress: !o.NoCompression,
		leaseTTL: o.LeaseTTL,
		now:      o.Now,
		leases:   map[ID]time.Time{},
		holds:    map[ID]int{},
		deleting: map[ID]chan struct{}{},
		gcs:      map[*gcRun]struct{}{},
	}
	if s.leaseTTL <= 0 {
		s.leaseTTL = time.Hour
	}
	if s.now == nil {
		s.now = time.Now
	}
	return s
}

// PutStats says what a Put read and what it added to the store.
type PutStats struct {
	Logical    int64 // bytes read
	Chunks     int   // chunks in the object
	NewChunks  int   // chunks the store did not hold and Put wrote
	NewLogical int64 // their content's size
	Stored     int64 // the bytes written for them (after compression)
}

// Put reads r to its end, cuts it into chunks and writes those the store
// does not hold. The returned object (unnamed) is not referenced until a
// manifest naming it is committed; until then GC spares its chunks for
// Options.LeaseTTL.
func (s *Store) Put(ctx context.Context, r io.Reader) (Object, PutStats, error) {
	var (
		obj  Object
		st   PutStats
		seen = map[ID]bool{}
	)
	w := workspaces.Get().(*workspace)
	defer func() {
		w.chunker.Reset(nil, polynomial) // drop r
		workspaces.Put(w)
	}()
	ch := w.chunker
	ch.ResetWithBoundaries(r, polynomial, s.cut.min, s.cut.max)
	ch.SetAverageBits(s.cut.avgBits)
	for {
		if err := ctx.Err(); err != nil {
			return Object{}, st, err
		}
		c, err := ch.Next(w.chunk)
		if err == io.EOF {
			break
		}
		if err != nil {
			return Object{}, st, fmt.Errorf("chunkstore: read: %w", err)
		}
		id := ID(sha256.Sum256(c.Data))
		obj.Chunks = append(obj.Chunks, ChunkRef{ID: id, Size: len(c.Data)})
		obj.Size += int64(len(c.Data))
		st.Logical += int64(len(c.Data))
		st.Chunks++
		if seen[id] {
			continue
		}
		seen[id] = true
		stored, err := s.putChunk(ctx, id, c.Data, w)
		if err != nil {
			return Object{}, st, fmt.Errorf("chunkstore: store chunk %s: %w", id, err)
		}
		if stored > 0 {
			st.NewChunks++
			st.NewLogical += int64(len(c.Data))
			st.Stored += stored
		}
	}
	return obj, st, nil
}

// workspace is what one Put reuses for every chunk: the chunker (and its
// read buffer), the chunk, the encoded blob.
type workspace struct {
	chunker *chunker.Chunker
	chunk   []byte
	blob    []byte
}

var workspaces = sync.Pool{New: func() any {
	return &workspace{
		chunker: chunker.New(nil, polynomial), // for its buffer: Put resets it
		chunk:   make([]byte, MaxChunk),
		blob:    make([]byte, 0, maxBlob),
	}
}}

// putChunk leases id, then writes it unless present; it returns the bytes
// written. The lease comes first, so GC cannot delete the chunk between
// the check and a Commit within LeaseTTL.
func (s *Store) putChunk(ctx context.Context, id ID, data []byte, w *workspace) (int64, error) {
	s.mu.Lock()
	s.waitDeleting(id)
	s.leases[id] = s.now().Add(s.leaseTTL)
	s.mu.Unlock()

	key := id.key()
	if _, err := s.b.Stat(ctx, key); err == nil {
		return 0, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return 0, err
	}
	blob := encode(w.blob[:0], data, s.compress)
	w.blob = blob[:0]
	created, err := s.b.PutIfAbsent(ctx, key, blob)
	if err != nil || !created {
		return 0, err
	}
	return int64(len(blob)), nil
}

// waitDeleting returns once GC is not deleting id.
//
// +checklocks:s.mu
func (s *Store) waitDeleting(id ID) {
	for {
		done, ok := s.deleting[id]
		if !ok {
			return
		}
		s.mu.Unlock()
		<-done
		s.mu.Lock()
	}
}

// hold keeps GC off ids until the returned func is called.
func (s *Store) hold(ids []ID) (release func()) {
	s.mu.Lock()
	for _, id := range ids {
		s.waitDeleting(id)
		s.holds[id]++
	}
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			for _, id := range ids {
				if s.holds[id]--; s.holds[id] <= 0 {
					delete(s.holds, id)
				}
			}
		})
	}
}

// distinct returns the distinct chunk ids of objs.
func distinct(objs []Object) []ID {
	seen := map[ID]bool{}
	var ids []ID
	for _, o := range objs {
		for _, c := range o.Chunks {
			if !seen[c.ID] {
				seen[c.ID] = true
				ids = append(ids, c.ID)
			}
		}
	}
	return ids
}

// Commit writes m under name: the commit point. It checks m, holds its
// chunks against GC, checks each is present (a missing one fails with a
// *ChunkError wrapping ErrMissing and nothing is written), then writes the
// manifest in one step. A name already committed fails with
// errdefs.ErrConflict. Commit sets m's Name, Format and, when zero, Created.
func (s *Store) Commit(ctx context.Context, name string, m Manifest) error {
	m.Name, m.Format = name, manifestFormat
	if m.Created.IsZero() {
		m.Created = s.now().UTC()
	}
	if err := m.check(); err != nil {
		if errors.Is(err, errdefs.ErrInvalidArgument) {
			return fmt.Errorf("chunkstore: commit: %w", err)
		}
		return fmt.Errorf("chunkstore: commit %q: %w: %w", name, err, errdefs.ErrInvalidArgument)
	}
	data, err := json.Marshal(m)
	if err != nil {
		return fmt.Errorf("chunkstore: commit %q: %w", name, err)
	}
	ids := distinct(m.Objects)
	release := s.hold(ids)
	defer release()

	checked := make(map[ID]bool, len(ids))
	for _, o := range m.Objects {
		var off int64
		for i, c := range o.Chunks {
			if !checked[c.ID] {
				if err := ctx.Err(); err != nil {
					return err
				}
				if _, err := s.b.Stat(ctx, c.ID.key()); err != nil {
					if errors.Is(err, fs.ErrNotExist) {
						err = ErrMissing
					}
					return fmt.Errorf("chunkstore: commit: %w", &ChunkError{
						Manifest: name, Object: o.Name, Index: i, Offset: off, Chunk: c.ID, Err: err})
				}
				checked[c.ID] = true
			}
			off += int64(c.Size)
		}
	}

	created, err := s.b.PutIfAbsent(ctx, manifestKey(name), data)
	// A GC that listed the manifests before this one was written must still
	// spare its chunks once the holds go. This is done on an error too: an
	// object store may have written a manifest whose answer was lost.
	s.mu.Lock()
	for run := range s.gcs {
		for _, id := range ids {
			run.keep[id] = struct{}{}
		}
	}
	s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("chunkstore: commit %q: %w", name, err)
	}
	if !created {
		return fmt.Errorf("chunkstore: commit: manifest %q exists: %w", name, errdefs.ErrConflict)
	}
	return nil
}

// Open reads the manifest committed under name. A name never committed (or
// deleted) fails with errdefs.ErrNotFound; a manifest that does not parse or
// does not add up fails with ErrCorrupt.
func (s *Store) Open(ctx context.Context, name string) (Manifest, error) {
	if err := checkName(name); err != nil {
		return Manifest{}, fmt.Errorf("chunkstore: open: %w", err)
	}
	data, err := s.b.Get(ctx, manifestKey(name))
	if errors.Is(err, fs.ErrNotExist) {
		return Manifest{}, fmt.Errorf("chunkstore: manifest %q: %w", name, errdefs.ErrNotFound)
	} else if err != nil {
		return Manifest{}, fmt.Errorf("chunkstore: manifest %q: %w", name, err)
	}
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return Manifest{}, fmt.Errorf("chunkstore: manifest %q: %w: %v", name, ErrCorrupt, err)
	}
	if m.Format != manifestFormat {
		return Manifest{}, fmt.Errorf("chunkstore: manifest %q: format %d, this version reads %d: %w",
			name, m.Format, manifestFormat, ErrCorrupt)
	}
	if m.Name != name {
		return Manifest{}, fmt.Errorf("chunkstore: manifest %q: %w: it says its name is %q", name, ErrCorrupt, m.Name)
	}
	if err := m.check(); err != nil {
		return Manifest{}, fmt.Errorf("chunkstore: manifest %q: %w: %v", name, ErrCorrupt, err)
	}
	for i := range m.Objects {
		m.Objects[i].manifest = name
	}
	return m, nil
}

// List returns the names of the committed manifests, sorted.
func (s *Store) List(ctx context.Context) ([]string, error) {
	var names []string
	err := s.b.List(ctx, manifestPrefix, func(in Info) error {
		name, ok := strings.CutSuffix(strings.TrimPrefix(in.Key, manifestPrefix), ".json")
		if ok && checkName(name) == nil && manifestKey(name) == in.Key {
			names = append(names, name)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("chunkstore: list manifests: %w", err)
	}
	slices.Sort(names)
	return names, nil
}

// Delete removes the manifest committed under name (errdefs.ErrNotFound if
// there is none). Its chunks stay until a GC finds nothing else uses them.
func (s *Store) Delete(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return fmt.Errorf("chunkstore: delete: %w", err)
	}
	key := manifestKey(name)
	if _, err := s.b.Stat(ctx, key); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("chunkstore: manifest %q: %w", name, errdefs.ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("chunkstore: manifest %q: %w", name, err)
	}
	if err := s.b.Delete(ctx, key); err != nil {
		return fmt.Errorf("chunkstore: delete manifest %q: %w", name, err)
	}
	return nil
}

// Reader streams obj's content. Each chunk is checked as it is read: a
// missing or corrupt one fails the read with a *ChunkError naming the
// manifest (when obj came from Open), the object and the chunk, and no byte
// of that chunk is returned. GC spares obj's chunks until Close.
func (s *Store) Reader(ctx context.Context, obj Object) io.ReadCloser {
	return &objectReader{ctx: ctx, s: s, obj: obj, release: s.hold(distinct([]Object{obj}))}
}

type objectReader struct {
	ctx     context.Context
	s       *Store
	obj     Object
	release func()
	next    int   // the next chunk to load
	off     int64 // where that chunk starts
	buf     []byte
	err     error
}

// fill loads the next chunk into r.buf, or sets r.err.
func (r *objectReader) fill() {
	if r.next == len(r.obj.Chunks) {
		r.err = io.EOF
		return
	}
	c := r.obj.Chunks[r.next]
	data, err := r.s.readChunk(r.ctx, c)
	if err != nil {
		r.err = &ChunkError{Manifest: r.obj.manifest, Object: r.obj.Name, Index: r.next, Offset: r.off,
			Chunk: c.ID, Err: err}
		return
	}
	r.buf = data
	r.next++
	r.off += int64(c.Size)
}

func (r *objectReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		r.fill()
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// WriteTo lets io.Copy skip a buffer.
func (r *objectReader) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		for len(r.buf) == 0 {
			if r.err == io.EOF {
				return total, nil
			}
			if r.err != nil {
				return total, r.err
			}
			r.fill()
		}
		n, err := w.Write(r.buf)
		total += int64(n)
		r.buf = r.buf[n:]
		if err != nil {
			return total, err
		}
	}
}

func (r *objectReader) Close() error {
	r.release()
	if r.err == nil {
		r.err = errors.New("chunkstore: read after Close")
	}
	r.buf = nil
	return nil
}

// readChunk returns c's content, checked; errors wrap ErrMissing, ErrCorrupt
// or the backend's.
func (s *Store) readChunk(ctx context.Context, c ChunkRef) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	blob, err := s.b.Get(ctx, c.ID.key())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrMissing
	} else if err != nil {
		return nil, err
	}
	return decode(blob, c.ID, c.Size)
}
