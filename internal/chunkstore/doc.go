// Package chunkstore is a content-addressed, deduplicating store of large
// byte streams (memory images, disks) under named, immutable manifests: the
// storage under checkpoints. It knows nothing of sandboxes.
//
// # Model
//
// [Store.Put] cuts a stream into content-defined chunks (Rabin fingerprints,
// github.com/restic/chunker, one fixed polynomial, 512 KiB–8 MiB, about 1 MiB
// on average), names each chunk by the SHA-256 of its content ([ID]) and
// writes only the chunks the store does not hold yet. Equal content gives
// equal chunks whichever stream, sandbox or checkpoint it comes from, and an
// insertion or a change moves only the chunks around it. Put returns an
// [Object]: the ordered chunk ids and sizes. [Store.Commit] writes a named
// [Manifest] (objects with metadata, JSON): that write is the commit point.
// [Store.Reader] streams an object back and checks every chunk's length and
// hash on the way.
//
// # Layout
//
// Keys in a [Backend] (a directory with [NewDir], later an object store):
//
//	chunks/ab/abcdef…(64 hex)   one chunk: a format byte (0 raw, 1 zstd) and the bytes
//	manifests/<name>.json       one committed manifest
//
// [NewDir] writes each key to a temporary file beside it (".tmp-*"), fsyncs
// it, links it into place without replacing an existing key, and fsyncs the
// directory. Temporary files are never listed; [Store.GC] removes those older
// than an hour (left by a crash).
//
// # Guarantees
//
//   - Nothing is visible before Commit: a manifest appears whole or not at
//     all, and Commit first checks that every chunk it names is present, so a
//     committed manifest never names a chunk that was not written. A crash
//     (kill -9) during Put or Commit leaves at most unreferenced chunks and
//     temporary files, which GC removes.
//   - Manifests are immutable: Commit of an existing name fails with
//     errdefs.ErrConflict.
//   - A chunk that is missing or whose content does not hash to its id fails
//     the read with a [*ChunkError] naming the manifest, the object and the
//     chunk, wrapping [ErrMissing] or [ErrCorrupt] (both errdefs.ErrUnprocessable):
//     a restore never yields different bytes silently.
//   - GC deletes only chunks no committed manifest names, and none that a Put
//     awaiting its Commit, a Commit or an open Reader of this Store uses; see
//     [Store.GC] for how. A crash during GC loses nothing: it deletes chunks
//     only, one by one, and the next GC finishes the job.
//
// One Store owns GC for a backend. Several Stores (processes) may Put, Commit
// and read on one backend, but GC protects only the in-flight work of its own
// Store; running GC beside writers in other processes needs a cross-process
// lease this package does not have yet.
package chunkstore
