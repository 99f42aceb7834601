package chunkstore

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// Backend stores immutable blobs by key. Keys are slash-separated paths of
// non-empty elements, none "." or "..", none starting with ".tmp-" (reserved
// for a backend's temporary files). Every method is safe for concurrent use.
// A key that does not exist is reported by an error wrapping fs.ErrNotExist.
//
// The contract is what an S3-compatible object store gives (PutObject with
// If-None-Match: *, GetObject, HeadObject, ListObjectsV2, DeleteObject), so
// one can be added behind it.
type Backend interface {
	// PutIfAbsent stores data under key unless key exists; created reports
	// whether it did. The blob is durable when PutIfAbsent returns, and a
	// reader sees either no blob or all of it.
	PutIfAbsent(ctx context.Context, key string, data []byte) (created bool, err error)
	// Get returns the blob stored under key.
	Get(ctx context.Context, key string) ([]byte, error)
	// Stat returns the blob's size.
	Stat(ctx context.Context, key string) (Info, error)
	// List calls fn for every key starting with prefix, in no set order; it
	// stops at fn's first error and returns it.
	List(ctx context.Context, prefix string, fn func(Info) error) error
	// Delete removes key; removing a key that does not exist is no error.
	Delete(ctx context.Context, key string) error
}

// Info describes one stored blob.
type Info struct {
	Key  string
	Size int64
}

// TempCleaner is implemented by backends that leave temporary files behind
// when their process dies mid-write (the directory backend). CleanTemp
// removes those older than olderThan and says how many it removed; younger
// ones may belong to a write in progress.
type TempCleaner interface {
	CleanTemp(ctx context.Context, olderThan time.Duration) (int, error)
}

// tempPrefix starts the name of every temporary file a backend writes.
const tempPrefix = ".tmp-"

// checkKey refuses keys outside the contract above.
func checkKey(key string) error {
	if key == "" || len(key) > 1024 {
		return fmt.Errorf("key %q: empty or longer than 1024 bytes: %w", key, errdefs.ErrInvalidArgument)
	}
	for _, el := range strings.Split(key, "/") {
		switch {
		case el == "" || el == "." || el == "..":
			return fmt.Errorf("key %q: empty, . or .. element: %w", key, errdefs.ErrInvalidArgument)
		case strings.HasPrefix(el, tempPrefix):
			return fmt.Errorf("key %q: %s is reserved: %w", key, tempPrefix, errdefs.ErrInvalidArgument)
		case strings.ContainsAny(el, "\x00\\"):
			return fmt.Errorf("key %q: NUL or backslash: %w", key, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}
