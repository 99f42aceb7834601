package chunkstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// tempAge is how old a backend's temporary file must be for GC to take it
// for a crash's leftover: far longer than one chunk or manifest write.
const tempAge = time.Hour

// GCStats says what a GC found and did.
type GCStats struct {
	Manifests    int   // committed manifests read
	Referenced   int   // distinct chunks they name
	Chunks       int   // chunks in the backend
	Spared       int   // unreferenced chunks kept: leased by a Put, held, or committed during the GC
	Deleted      int   // chunks deleted
	DeletedBytes int64 // their stored size
	TempRemoved  int   // leftover temporary files removed
}

// gcRun is one GC between its start and its end.
type gcRun struct {
	keep map[ID]struct{} // guarded by Store.mu: chunks of manifests committed since the run began
}

// GC deletes the chunks no committed manifest names: it reads every
// manifest (mark), then deletes each unreferenced chunk (sweep), one at a
// time. A manifest that cannot be read stops it before anything is deleted.
//
// Safety against work in flight uses leases and holds in this Store rather
// than a grace period on chunk age. A grace period protects only chunks
// written recently; a Put that finds a chunk already present (the common
// case, and the point of deduplication) writes nothing, so an old,
// unreferenced chunk it now relies on would look deletable. So:
//   - Put leases every chunk it uses (Options.LeaseTTL, default an hour)
//     before checking whether it is present; GC spares leased chunks.
//   - Commit holds the manifest's chunks while it checks each is present and
//     writes the manifest, and then adds them to the spare set of every GC
//     already running (one that listed the manifests before this one
//     existed). A lease that ran out is therefore safe too: Commit fails with
//     ErrMissing rather than commit a manifest naming a deleted chunk.
//   - A Reader holds its object's chunks until it is closed.
//   - Leasing, holding and GC's decision to delete a chunk happen under one
//     lock, and a Put or Commit that wants a chunk GC is deleting waits for
//     the delete to finish, so none finds present a chunk about to go.
//
// A crash at any point loses nothing committed: GC deletes only chunks, each
// in one backend call, and only unreferenced ones; the next GC deletes what
// the interrupted one did not. Leases and holds live in memory and die with
// the process, as do the Puts and Commits they protect. GC also removes the
// backend's temporary files older than an hour (TempCleaner).
//
// One GC runs at a time per Store. It does not see other processes' work in
// flight (see the package comment).
func (s *Store) GC(ctx context.Context) (GCStats, error) {
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	var st GCStats

	// Registered before the manifests are listed, so that a Commit either
	// writes its manifest in time to be listed or finds this run in s.gcs.
	run := &gcRun{keep: map[ID]struct{}{}}
	s.mu.Lock()
	s.gcs[run] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.gcs, run)
		s.mu.Unlock()
	}()

	names, err := s.List(ctx)
	if err != nil {
		return st, fmt.Errorf("chunkstore: gc: %w", err)
	}
	marked := map[ID]struct{}{}
	for _, name := range names {
		m, err := s.Open(ctx, name)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue // deleted since listed
		}
		if err != nil {
			return st, fmt.Errorf("chunkstore: gc: nothing deleted: %w", err)
		}
		st.Manifests++
		for _, o := range m.Objects {
			for _, c := range o.Chunks {
				marked[c.ID] = struct{}{}
			}
		}
	}
	st.Referenced = len(marked)

	var unmarked []Info
	err = s.b.List(ctx, chunkPrefix, func(in Info) error {
		id, ok := idFromKey(in.Key)
		if !ok {
			return nil // not ours: leave it alone
		}
		st.Chunks++
		if _, ok := marked[id]; !ok {
			unmarked = append(unmarked, in)
		}
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("chunkstore: gc: list chunks: %w", err)
	}

	for _, in := range unmarked {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		id, _ := idFromKey(in.Key)
		done, ok := s.claim(run, id)
		if !ok {
			st.Spared++
			continue
		}
		err := s.b.Delete(ctx, in.Key)
		s.mu.Lock()
		delete(s.deleting, id)
		close(done)
		s.mu.Unlock()
		if err != nil {
			return st, fmt.Errorf("chunkstore: gc: delete chunk %s: %w", id, err)
		}
		st.Deleted++
		st.DeletedBytes += in.Size
	}

	s.mu.Lock()
	now := s.now()
	for id, until := range s.leases {
		if !until.After(now) {
			delete(s.leases, id)
		}
	}
	s.mu.Unlock()

	if tc, ok := s.b.(TempCleaner); ok {
		n, err := tc.CleanTemp(ctx, tempAge)
		st.TempRemoved = n
		if err != nil {
			return st, fmt.Errorf("chunkstore: gc: temporary files: %w", err)
		}
	}
	return st, nil
}

// claim decides, under the lock Put and Commit take, whether GC may delete
// the unreferenced chunk id now; if so it marks it being deleted and returns
// the channel to close when done.
func (s *Store) claim(run *gcRun, id ID) (chan struct{}, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := run.keep[id]; ok {
		return nil, false
	}
	if s.holds[id] > 0 {
		return nil, false
	}
	if until, ok := s.leases[id]; ok {
		if until.After(s.now()) {
			return nil, false
		}
		delete(s.leases, id)
	}
	done := make(chan struct{})
	s.deleting[id] = done
	return done, true
}
