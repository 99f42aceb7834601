package chunkstore

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Dir is a Backend in a local directory: a key is a file under it.
type Dir struct {
	root string
}

var (
	_ Backend     = (*Dir)(nil)
	_ TempCleaner = (*Dir)(nil)
)

// NewDir returns a Backend storing its blobs under root, which it creates
// (0700) if needed.
func NewDir(root string) (*Dir, error) {
	if root == "" {
		return nil, errors.New("chunkstore: empty directory path")
	}
	root, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	if err := mkdirAllSync(root); err != nil {
		return nil, fmt.Errorf("chunkstore: %w", err)
	}
	return &Dir{root: root}, nil
}

func (d *Dir) path(key string) (string, error) {
	if err := checkKey(key); err != nil {
		return "", err
	}
	return filepath.Join(d.root, filepath.FromSlash(key)), nil
}

// PutIfAbsent writes data to a temporary file in the key's directory, fsyncs
// it, hard-links it to the key's name (which, unlike rename, fails if the
// name exists, so a key is never replaced) and fsyncs the directory.
func (d *Dir) PutIfAbsent(ctx context.Context, key string, data []byte) (bool, error) {
	p, err := d.path(key)
	if err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if _, err := os.Lstat(p); err == nil {
		return false, nil
	}
	dir := filepath.Dir(p)
	if err := mkdirAllSync(dir); err != nil {
		return false, err
	}
	f, err := os.CreateTemp(dir, tempPrefix+"*")
	if err != nil {
		return false, err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, fmt.Errorf("write %s: %w", key, err)
	}
	if err := os.Link(tmp, p); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return false, nil
		}
		return false, fmt.Errorf("write %s: %w", key, err)
	}
	if err := syncDir(dir); err != nil {
		return false, fmt.Errorf("write %s: %w", key, err)
	}
	return true, nil
}

func (d *Dir) Get(ctx context.Context, key string) ([]byte, error) {
	p, err := d.path(key)
	if err != nil {
		return nil, err
	}
	return os.ReadFile(p)
}

func (d *Dir) Stat(ctx context.Context, key string) (Info, error) {
	p, err := d.path(key)
	if err != nil {
		return Info{}, err
	}
	fi, err := os.Lstat(p)
	if err != nil {
		return Info{}, err
	}
	if !fi.Mode().IsRegular() {
		return Info{}, fmt.Errorf("%s is not a regular file", p)
	}
	return Info{Key: key, Size: fi.Size()}, nil
}

// List walks the directory the prefix names up to its last slash and skips
// temporary files.
func (d *Dir) List(ctx context.Context, prefix string, fn func(Info) error) error {
	base := "."
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		base = prefix[:i]
		if err := checkKey(base); err != nil {
			return err
		}
	}
	start := filepath.Join(d.root, filepath.FromSlash(base))
	err := filepath.WalkDir(start, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if p == start && errors.Is(err, fs.ErrNotExist) {
				return fs.SkipAll
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if strings.HasPrefix(de.Name(), tempPrefix) || !de.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(d.root, p)
		if err != nil {
			return err
		}
		key := filepath.ToSlash(rel)
		if !strings.HasPrefix(key, prefix) {
			return nil
		}
		fi, err := de.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil // deleted since the directory was read
		} else if err != nil {
			return err
		}
		return fn(Info{Key: key, Size: fi.Size()})
	})
	return err
}

// Delete removes the key's file and fsyncs its directory, so a deleted
// manifest does not come back after a crash.
func (d *Dir) Delete(ctx context.Context, key string) error {
	p, err := d.path(key)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	return syncDir(filepath.Dir(p))
}

// CleanTemp removes temporary files older than olderThan: those of writes a
// crash interrupted.
func (d *Dir) CleanTemp(ctx context.Context, olderThan time.Duration) (int, error) {
	cutoff := time.Now().Add(-olderThan)
	n := 0
	err := filepath.WalkDir(d.root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if de.IsDir() || !strings.HasPrefix(de.Name(), tempPrefix) {
			return nil
		}
		fi, err := de.Info()
		if err != nil || !fi.ModTime().Before(cutoff) {
			return nil
		}
		if err := os.Remove(p); err == nil {
			n++
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	})
	return n, err
}

// mkdirAllSync creates dir and any missing parents (0700), fsyncing each
// new directory's parent so the new entries survive a crash.
func mkdirAllSync(dir string) error {
	if fi, err := os.Stat(dir); err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory", dir)
		}
		return nil
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := mkdirAllSync(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		if !errors.Is(err, fs.ErrExist) {
			return err
		}
		// Made by a concurrent call, which may not have synced parent yet.
	}
	return syncDir(parent)
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
