package chunkstore

import (
	"fmt"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// manifestFormat is the version Commit writes; Open refuses newer ones.
const manifestFormat = 1

const manifestPrefix = "manifests/"

// Manifest is a committed, immutable set of objects: what a checkpoint
// stores. It is written as JSON to manifests/<Name>.json.
type Manifest struct {
	Format  int               `json:"format"`
	Name    string            `json:"name"`    // set by Commit
	Created time.Time         `json:"created"` // set by Commit when zero
	Meta    map[string]string `json:"meta,omitempty"`
	Objects []Object          `json:"objects"`
}

// Object is one stream stored as chunks: what Put returns, named by its
// caller before Commit.
type Object struct {
	Name   string            `json:"name"` // unique within its manifest, e.g. "disk", "memory"
	Meta   map[string]string `json:"meta,omitempty"`
	Size   int64             `json:"size"` // the sum of the chunks' sizes
	Chunks []ChunkRef        `json:"chunks"`

	manifest string // the manifest Open read it from, for error messages
}

// ChunkRef is one chunk of an object, in order.
type ChunkRef struct {
	ID   ID  `json:"id"`
	Size int `json:"size"`
}

// Object returns the object with the given name, or false.
func (m *Manifest) Object(name string) (Object, bool) {
	for _, o := range m.Objects {
		if o.Name == name {
			return o, true
		}
	}
	return Object{}, false
}

// checkName accepts manifest names that are one safe path element in every
// backend: 1–200 bytes of letters, digits and . _ - : @ +, not starting with
// a dot.
func checkName(name string) error {
	if name == "" || len(name) > 200 {
		return fmt.Errorf("manifest name %q: must be 1 to 200 bytes: %w", name, errdefs.ErrInvalidArgument)
	}
	if name[0] == '.' {
		return fmt.Errorf("manifest name %q: must not start with a dot: %w", name, errdefs.ErrInvalidArgument)
	}
	for _, c := range []byte(name) {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '.' || c == '_' || c == '-' || c == ':' || c == '@' || c == '+':
		default:
			return fmt.Errorf("manifest name %q: only letters, digits and . _ - : @ + are allowed: %w",
				name, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func manifestKey(name string) string { return manifestPrefix + name + ".json" }

// check reports what makes m unfit to commit or to read: an invalid name,
// an unnamed or repeated object, a chunk size out of bounds, or sizes that do
// not add up.
func (m *Manifest) check() error {
	if err := checkName(m.Name); err != nil {
		return err
	}
	seen := make(map[string]bool, len(m.Objects))
	for i, o := range m.Objects {
		if o.Name == "" || len(o.Name) > 200 {
			return fmt.Errorf("object %d: name must be 1 to 200 bytes", i)
		}
		if seen[o.Name] {
			return fmt.Errorf("object %q appears twice", o.Name)
		}
		seen[o.Name] = true
		var sum int64
		for j, c := range o.Chunks {
			if c.Size <= 0 || c.Size > MaxChunk {
				return fmt.Errorf("object %q chunk %d: size %d is not in 1..%d", o.Name, j, c.Size, MaxChunk)
			}
			sum += int64(c.Size)
		}
		if sum != o.Size {
			return fmt.Errorf("object %q: its chunks add up to %d bytes, its size is %d", o.Name, sum, o.Size)
		}
	}
	return nil
}
