package chunkstore

import (
	"context"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"sync"
)

// memBackend keeps blobs in memory: for tests, here and in the packages
// that use a Store.
type memBackend struct {
	mu    sync.Mutex
	blobs map[string][]byte // +checklocks:mu
}

var _ Backend = (*memBackend)(nil)

// NewMem returns an empty Backend held in memory.
func NewMem() Backend { return &memBackend{blobs: map[string][]byte{}} }

func (m *memBackend) PutIfAbsent(ctx context.Context, key string, data []byte) (bool, error) {
	if err := checkKey(key); err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.blobs[key]; ok {
		return false, nil
	}
	m.blobs[key] = slices.Clone(data)
	return true, nil
}

func (m *memBackend) Get(ctx context.Context, key string) ([]byte, error) {
	if err := checkKey(key); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.blobs[key]
	if !ok {
		return nil, fmt.Errorf("%s: %w", key, fs.ErrNotExist)
	}
	return slices.Clone(b), nil
}

func (m *memBackend) Stat(ctx context.Context, key string) (Info, error) {
	if err := checkKey(key); err != nil {
		return Info{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.blobs[key]
	if !ok {
		return Info{}, fmt.Errorf("%s: %w", key, fs.ErrNotExist)
	}
	return Info{Key: key, Size: int64(len(b))}, nil
}

func (m *memBackend) List(ctx context.Context, prefix string, fn func(Info) error) error {
	m.mu.Lock()
	var infos []Info
	for k, b := range m.blobs {
		if strings.HasPrefix(k, prefix) {
			infos = append(infos, Info{Key: k, Size: int64(len(b))})
		}
	}
	m.mu.Unlock()
	slices.SortFunc(infos, func(a, b Info) int { return strings.Compare(a.Key, b.Key) })
	for _, in := range infos {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(in); err != nil {
			return err
		}
	}
	return nil
}

func (m *memBackend) Delete(ctx context.Context, key string) error {
	if err := checkKey(key); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.blobs, key)
	return nil
}
