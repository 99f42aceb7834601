package chunkstore

import (
	"fmt"

	"github.com/spacehq/space/internal/errdefs"
)

// classError is a sentinel that also wraps the errdefs class the API maps it
// to, so errors.Is works for both and its text stays short.
type classError struct {
	msg   string
	class error
}

func (e *classError) Error() string { return e.msg }
func (e *classError) Unwrap() error { return e.class }

// ErrMissing and ErrCorrupt are what a [*ChunkError] wraps when a chunk a
// manifest names is absent, or its stored bytes do not decode to content of
// the recorded length and hash. Both wrap errdefs.ErrUnprocessable (422): the
// checkpoint exists (not a 404) but cannot be restored, and retrying will not
// help (not a 503). ErrCorrupt is also returned for a manifest that does not
// parse.
var (
	ErrMissing error = &classError{"chunk missing", errdefs.ErrUnprocessable}
	ErrCorrupt error = &classError{"corrupt", errdefs.ErrUnprocessable}
)

// ChunkError is a failure to read (or, in Commit, to find) one chunk of an
// object. Err is ErrMissing, ErrCorrupt with detail, or the backend's error.
type ChunkError struct {
	Manifest string // the manifest's name; empty for an object not read through Open
	Object   string // the object's name within it
	Index    int    // the chunk's position in the object
	Offset   int64  // the object's byte offset where the chunk starts
	Chunk    ID
	Err      error
}

func (e *ChunkError) Error() string {
	where := "uncommitted object"
	if e.Manifest != "" {
		where = fmt.Sprintf("manifest %q", e.Manifest)
	}
	if e.Object != "" {
		where += fmt.Sprintf(" object %q", e.Object)
	}
	return fmt.Sprintf("%s: chunk %d (byte %d) sha256:%s: %v", where, e.Index, e.Offset, e.Chunk, e.Err)
}

func (e *ChunkError) Unwrap() error { return e.Err }
