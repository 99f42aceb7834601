package template

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Hold keeps the template digest (and its ancestors) from garbage
// collection until release is called, e.g. between the steps of a build,
// while it is untagged and no sandbox uses it yet.
func (s *Store) Hold(digest string) (release func()) {
	s.holdMu.Lock()
	if s.holds == nil {
		s.holds = map[string]int{}
	}
	s.holds[digest]++
	s.holdMu.Unlock()
	var done bool
	return func() {
		s.holdMu.Lock()
		defer s.holdMu.Unlock()
		if done {
			return
		}
		done = true
		if s.holds[digest]--; s.holds[digest] <= 0 {
			delete(s.holds, digest)
		}
	}
}

// Remove removes ref: a tag is untagged (the content stays while sandboxes,
// other tags or derived templates use it); a digest forgets the template,
// refused while it is tagged (unless force, which drops its tags), used by
// a sandbox in inUse, or the parent of another template. Stored content is
// freed by GC.
func (s *Store) Remove(ctx context.Context, ref string, force bool, inUse map[string]bool) error {
	if !strings.HasPrefix(ref, "sha256:") {
		return s.Untag(ctx, ref)
	}
	t, err := s.Get(ctx, ref)
	if err != nil {
		return err
	}
	if len(t.Tags) > 0 && !force {
		return fmt.Errorf("template %s is tagged %s: remove the tags or force: %w", t.Digest, strings.Join(t.Tags, ", "), errdefs.ErrConflict)
	}
	if inUse[t.Digest] {
		return fmt.Errorf("template %s is used by a sandbox: %w", t.Digest, errdefs.ErrConflict)
	}
	var child string
	err = s.db.QueryRowContext(ctx, `SELECT digest FROM template_images WHERE parent = ? LIMIT 1`, t.Digest).Scan(&child)
	if err == nil {
		return fmt.Errorf("template %s is the parent of %s: %w", t.Digest, child, errdefs.ErrConflict)
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	for _, q := range []string{
		`DELETE FROM template_tags WHERE digest = ?`,
		`DELETE FROM template_build_cache WHERE digest = ?`,
		`DELETE FROM template_images WHERE digest = ?`,
	} {
		if _, err := tx.ExecContext(ctx, q, t.Digest); err != nil {
			return fmt.Errorf("remove template %s: %w", t.Digest, err)
		}
	}
	return tx.Commit()
}

// GC removes every template that is not live and every stored tree no
// remaining template uses, and reports the bytes freed on disk. A template
// is live when it is tagged, used by a sandbox (inUse: digests of every
// sandbox that still exists, whatever its state), held (Hold), or an
// ancestor of a live template. forget, if set, is called for each removed
// tree so runtimes drop what they derived from it.
func (s *Store) GC(ctx context.Context, inUse map[string]bool, forget func(ctx context.Context, tree string) error) (api.GCResult, error) {
	// One collection at a time, and none while a commit is in flight: a
	// commit may be adding a template to a tree that looks unused.
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	res := api.GCResult{Removed: []string{}}
	all, err := s.List(ctx)
	if err != nil {
		return res, err
	}
	byDigest := map[string]api.Template{}
	for _, t := range all {
		byDigest[t.Digest] = t
	}
	live := map[string]bool{}
	mark := func(d string) {
		for d != "" && !live[d] {
			t, ok := byDigest[d]
			if !ok {
				return
			}
			live[d] = true
			d = t.Parent
		}
	}
	s.holdMu.Lock()
	for d := range s.holds {
		mark(d)
	}
	s.holdMu.Unlock()
	for _, t := range all {
		if len(t.Tags) > 0 || inUse[t.Digest] {
			mark(t.Digest)
		}
	}
	liveTrees := map[string]bool{}
	var dead []api.Template
	for _, t := range all {
		if live[t.Digest] {
			liveTrees[t.TreeDigest] = true
		} else {
			dead = append(dead, t)
		}
	}
	// Children first, so a crash half-way never leaves a dangling parent.
	sort.Slice(dead, func(i, j int) bool { return dead[i].CreatedAt.After(dead[j].CreatedAt) })
	for _, t := range dead {
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return res, err
		}
		for _, q := range []string{
			`DELETE FROM template_build_cache WHERE digest = ?`,
			`DELETE FROM template_images WHERE digest = ?`,
		} {
			if _, err := tx.ExecContext(ctx, q, t.Digest); err != nil {
				tx.Rollback()
				return res, fmt.Errorf("gc %s: %w", t.Digest, err)
			}
		}
		if err := tx.Commit(); err != nil {
			return res, fmt.Errorf("gc %s: %w", t.Digest, err)
		}
		res.Removed = append(res.Removed, t.Digest)
	}
	// Trees: every stored one no remaining template names.
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return res, err
	}
	for _, e := range entries {
		if !hexDigest.MatchString(e.Name()) || liveTrees["sha256:"+e.Name()] {
			continue
		}
		tree := "sha256:" + e.Name()
		var n int
		if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM template_images WHERE tree = ?`, tree).Scan(&n); err != nil {
			return res, err
		}
		if n > 0 {
			continue // a template outside the live set still names it (cannot happen after the loop above, but cheap)
		}
		if forget != nil {
			err := forget(ctx, tree)
			if errors.Is(err, errdefs.ErrConflict) {
				// A runtime still uses its copy (a sandbox the caller did
				// not count): keep the tree; a later gc retries.
				s.log.Warn("template gc: keeping a tree a runtime still uses", "tree", tree, "err", err)
				continue
			}
			if err != nil {
				return res, fmt.Errorf("gc: runtime formats of %s: %w", tree, err)
			}
		}
		p := filepath.Join(s.dir, e.Name())
		freed, err := exclusiveBytes(p)
		if err != nil {
			return res, err
		}
		if err := os.RemoveAll(p); err != nil {
			return res, fmt.Errorf("gc: remove %s: %w", p, err)
		}
		res.Trees++
		res.BytesFreed += freed
	}
	if len(res.Removed) > 0 || res.Trees > 0 {
		s.log.Info("template gc", "templates", len(res.Removed), "trees", res.Trees, "bytes_freed", res.BytesFreed)
	}
	return res, nil
}

// exclusiveBytes is the disk space removing the tree at root frees: blocks
// of directories and of inodes all of whose links are inside it (trees
// share unchanged files with their parents by hard links).
func exclusiveBytes(root string) (int64, error) {
	type inode struct{ dev, ino uint64 }
	seen := map[inode]uint64{}
	var total int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			if errors.Is(err, unix.ENOENT) {
				return nil
			}
			return err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR || st.Nlink <= 1 {
			total += st.Blocks * 512
			return nil
		}
		k := inode{st.Dev, st.Ino}
		seen[k]++
		if seen[k] == uint64(st.Nlink) {
			total += st.Blocks * 512
		}
		return nil
	})
	return total, err
}
