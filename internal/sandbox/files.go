package sandbox

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
)

// FileSession is the one way a front door (REST, MCP through REST, E2B's
// envd) acts on a sandbox's files. Every operation is decided by the
// policy before it happens, on the path the sandbox's kernel will act on:
//
//  1. the path as asked, made clean ("/tmp/../etc/x" is "/etc/x"), is
//     decided before anything else (before the sandbox is woken);
//  2. when a policy applies to the sandbox, the agent resolves the path's
//     symlinks inside the sandbox's root and the result, if different, is
//     decided too;
//  3. the operation runs on the resolved path with every symlink refused
//     on the way (agentclient.Exact), so a symlink planted after the
//     decision fails the operation instead of moving it.
//
// Each entry of a tar upload is an action of its own. A session reaches
// the agent (waking the sandbox) on its first operation that passes step
// 1, and holds the sandbox active until Close.
type FileSession struct {
	m    *Manager
	sb   api.Sandbox
	user string

	c       *agentclient.Client
	release func()
}

// OpenFiles starts a file session on sandbox id as user ("" is root).
// It does not wake the sandbox.
func (part *Files) OpenFiles(ctx context.Context, id, user string) (*FileSession, error) {
	m := part.m
	if err := ValidateUser(user); err != nil {
		return nil, err
	}
	sb, err := m.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	return &FileSession{m: m, sb: sb, user: user}, nil
}

// Close releases the sandbox.
func (s *FileSession) Close() {
	if s.release != nil {
		s.release()
		s.release = nil
	}
}

// Sandbox is the session's sandbox record as it was opened.
func (s *FileSession) Sandbox() api.Sandbox { return s.sb }

// agent reaches the sandbox's agent once per session.
func (s *FileSession) agent(ctx context.Context) (*agentclient.Client, error) {
	if s.c != nil {
		return s.c, nil
	}
	c, release, err := s.m.Agent(ctx, s.sb.ID)
	if err != nil {
		return nil, err
	}
	s.c, s.release = c, release
	return c, nil
}

// CleanPath validates an absolute sandbox path and returns it clean.
func CleanPath(field, p string) (string, error) {
	if err := validatePath(field, p, false); err != nil {
		return "", err
	}
	if !strings.HasPrefix(p, "/") {
		return "", invalid("%s must be absolute, got %q", field, truncate(p, 128))
	}
	return path.Clean(p), nil
}

// use is one path an operation touches: the action kind it is and
// whether the operation follows a symlink at its final component.
type use struct {
	kind   string
	path   string
	follow bool
}

// policyApplies reports whether the sandbox has rules that could decide
// a files action; without, the decisions are plain allows and the agent's
// resolution round trip is skipped.
func (s *FileSession) policyApplies() bool {
	switch d := s.m.cfg.Decider.(type) {
	case actions.AllowAll:
		return false
	case interface {
		AppliesTo(tenant, template, sandbox string) bool
	}:
		return d.AppliesTo(s.sb.Tenant, s.sb.Template, s.sb.ID)
	}
	return true
}

// prepare decides uses as described on FileSession and returns the agent,
// the paths to act on and the options to act with.
func (s *FileSession) prepare(ctx context.Context, uses ...use) (*agentclient.Client, []string, []agentclient.FileOption, error) {
	for i := range uses {
		p, err := CleanPath("path", uses[i].path)
		if err != nil {
			return nil, nil, nil, err
		}
		uses[i].path = p
		if err := s.m.decide(ctx, s.sb, actions.Action{Kind: uses[i].kind, Path: p, User: s.user}); err != nil {
			return nil, nil, nil, err
		}
	}
	c, err := s.agent(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	opts := []agentclient.FileOption{agentclient.AsUser(s.user)}
	paths := make([]string, len(uses))
	strict := s.policyApplies()
	for i, u := range uses {
		paths[i] = u.path
		if !strict {
			continue
		}
		real, err := c.Resolve(ctx, u.path, u.follow)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("resolving %s in the sandbox before the policy decides: %w", truncate(u.path, 128), err)
		}
		if real = path.Clean(real); real != u.path {
			if err := s.m.decide(ctx, s.sb, actions.Action{Kind: u.kind, Path: real, User: s.user}); err != nil {
				return nil, nil, nil, err
			}
		}
		paths[i] = real
	}
	if strict {
		opts = append(opts, agentclient.Exact())
	}
	return c, paths, opts, nil
}

// Read streams the regular file p; the caller closes the reader before
// the session.
func (s *FileSession) Read(ctx context.Context, p string) (io.ReadCloser, error) {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileRead, path: p, follow: true})
	if err != nil {
		return nil, err
	}
	return c.ReadFile(ctx, ps[0], opts...)
}

// TarGet streams a tar of p (a directory's entries, or one file).
func (s *FileSession) TarGet(ctx context.Context, p string) (io.ReadCloser, error) {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileRead, path: p})
	if err != nil {
		return nil, err
	}
	return c.TarGet(ctx, ps[0], opts...)
}

// Stat describes p (a symlink itself, not its target).
func (s *FileSession) Stat(ctx context.Context, p string) (api.FileInfo, error) {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileRead, path: p})
	if err != nil {
		return api.FileInfo{}, err
	}
	return c.Stat(ctx, ps[0], opts...)
}

// List describes the entries of directory p.
func (s *FileSession) List(ctx context.Context, p string) ([]api.FileInfo, error) {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileRead, path: p, follow: true})
	if err != nil {
		return nil, err
	}
	return c.List(ctx, ps[0], opts...)
}

// Write atomically replaces p with body's content (a symlink at p is
// replaced, not followed). mode 0 keeps an existing file's mode.
func (s *FileSession) Write(ctx context.Context, p string, mode os.FileMode, body io.Reader) (api.FileInfo, error) {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileWrite, path: p})
	if err != nil {
		return api.FileInfo{}, err
	}
	fi, err := c.WriteFile(ctx, ps[0], mode, body, opts...)
	s.m.aud.AuditFiles(ctx, s.sb.ID, "write", ps[0], "", err)
	return fi, err
}

// Mkdir is mkdir -p of p.
func (s *FileSession) Mkdir(ctx context.Context, p string, mode os.FileMode) (api.FileInfo, error) {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileWrite, path: p, follow: true})
	if err != nil {
		return api.FileInfo{}, err
	}
	fi, err := c.Mkdir(ctx, ps[0], mode, opts...)
	s.m.aud.AuditFiles(ctx, s.sb.ID, "mkdir", ps[0], "", err)
	return fi, err
}

// Remove deletes p (a non-empty directory only when recursive).
func (s *FileSession) Remove(ctx context.Context, p string, recursive bool) error {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileDelete, path: p})
	if err != nil {
		return err
	}
	err = c.Remove(ctx, ps[0], recursive, opts...)
	s.m.aud.AuditFiles(ctx, s.sb.ID, "remove", ps[0], "", err)
	return err
}

// Rename moves from to to: a delete of its source and a write of its
// target.
func (s *FileSession) Rename(ctx context.Context, from, to string) error {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileDelete, path: from}, use{kind: actions.FileWrite, path: to})
	if err != nil {
		return err
	}
	err = c.Rename(ctx, ps[0], ps[1], opts...)
	s.m.aud.AuditFiles(ctx, s.sb.ID, "rename", ps[0], ps[1], err)
	return err
}

// TarPut extracts the tar stream body into directory p (created if
// missing). When a policy applies, the stream is first spooled to an
// unlinked temporary file and every entry decided as a write of its own
// path (and a hard link's target too) before any of it reaches the
// sandbox: one refused entry refuses the whole upload, and nothing of it
// is extracted.
func (s *FileSession) TarPut(ctx context.Context, p string, body io.Reader) error {
	c, ps, opts, err := s.prepare(ctx, use{kind: actions.FileWrite, path: p, follow: true})
	if err != nil {
		return err
	}
	if s.policyApplies() {
		spool, err := spoolTar(body)
		if err != nil {
			return err
		}
		defer spool.Close()
		if err := s.decideEntries(ctx, ps[0], spool); err != nil {
			return err
		}
		if _, err := spool.Seek(0, io.SeekStart); err != nil {
			return err
		}
		body = spool
	}
	err = c.TarPut(ctx, ps[0], body, opts...)
	s.m.aud.AuditFiles(ctx, s.sb.ID, "tar_put", ps[0], "", err)
	return err
}

// spoolTar copies body to a temporary file unlinked at once, so a crash
// leaves nothing behind. The caller bounds body's size.
func spoolTar(body io.Reader) (*os.File, error) {
	f, err := os.CreateTemp("", "space-tar-*")
	if err != nil {
		return nil, fmt.Errorf("spooling the tar upload: %w", err)
	}
	os.Remove(f.Name())
	if _, err := io.Copy(f, body); err != nil {
		f.Close()
		return nil, err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// decideEntries decides every entry of the tar in r, extracted into dir:
// the same names the agent will create (archive/tar on both sides; the
// agent refuses absolute names and ".." the same way). Entries cannot
// reach through a symlink: the agent extracts with symlinks refused on the
// way (Exact) and relative to dir.
func (s *FileSession) decideEntries(ctx context.Context, dir string, r io.Reader) error {
	tr := tar.NewReader(r)
	seen := map[string]bool{}
	decide := func(name string) error {
		if strings.HasPrefix(name, "/") || strings.IndexByte(name, 0) >= 0 || slices.Contains(strings.Split(name, "/"), "..") {
			return invalid("tar entry %q is absolute or has a '..' component", truncate(name, 128))
		}
		p := path.Join(dir, name)
		if seen[p] {
			return nil
		}
		seen[p] = true
		return s.m.decide(ctx, s.sb, actions.Action{Kind: actions.FileWrite, Path: p, User: s.user})
	}
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading tar: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		if err := decide(hdr.Name); err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeLink {
			// A hard link makes its target writable under a second name.
			if err := decide(hdr.Linkname); err != nil {
				return err
			}
		}
	}
}

// ReadIDFile reads the sandbox's /etc/passwd or /etc/group (bounded by
// limit), undecided: a listing shows owners by name, and that must not
// ask the policy about files the caller did not name. Nothing else.
func (s *FileSession) ReadIDFile(ctx context.Context, p string, limit int64) ([]byte, error) {
	if p != "/etc/passwd" && p != "/etc/group" {
		return nil, invalid("ReadIDFile reads /etc/passwd or /etc/group, not %q", p)
	}
	c, err := s.agent(ctx)
	if err != nil {
		return nil, err
	}
	rc, err := c.ReadFile(ctx, p)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(io.LimitReader(rc, limit))
}
