package template

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/store"
)

// Store holds templates on disk and their metadata in SQLite.
//
// Layout under dir:
//
//	<hex>/rootfs   content of template sha256:<hex>; read-only by convention
//	tmp/           imports in progress; junk here after a crash is removed by Open
//	.lock          shared flock held by every open Store; the one that gets it
//	               exclusively at Open is alone and may collect garbage
//
// One Store per directory per process is expected; several processes may
// share a directory (garbage collection then waits for the last one).
type Store struct {
	db       *sql.DB
	dir      string
	cacheDir string
	log      *slog.Logger
	lock     *os.File

	// commitMu serialises the short step that renames a staged tree into
	// place and records it, so concurrent imports of the same content in
	// this process dedup cleanly.
	commitMu sync.Mutex

	baseMu   sync.Mutex
	baseCall *baseCall

	holdMu sync.Mutex
	holds  map[string]int // digests GC must keep (see Hold)
}

// ImportOptions tune an import.
type ImportOptions struct {
	Tags     []string // "name[:tag]" to point at the result
	Source   string   // recorded provenance, e.g. "dir", "tar", "debootstrap:bookworm"
	Parent   string   // ref of the template this one derives from (stored as its digest)
	MaxBytes int64    // limit on content plus 512 bytes per entry; 0 = none
	// Progress, if set, receives PhaseImport events.
	Progress func(Progress)
	// Config are the defaults sandboxes of the template get; Layers its
	// provenance (OCI layers or build steps).
	Config api.TemplateConfig
	Layers []api.TemplateLayer
	// ExpectDigest, if set, must equal the resulting template digest, or the
	// import fails (ErrInvalidArgument) and nothing is kept.
	ExpectDigest string
}

// templateSchema is the schema of the template_ tables; its version lives
// in template_schema (PRAGMA user_version belongs to internal/store).
var templateSchema = []string{
	`
CREATE TABLE template_images (
	digest     TEXT PRIMARY KEY,   -- "sha256:<hex>"
	size_bytes INTEGER NOT NULL,
	source     TEXT NOT NULL,
	parent     TEXT NOT NULL,
	created_at INTEGER NOT NULL    -- unix nanoseconds
);
CREATE TABLE template_tags (
	ref    TEXT PRIMARY KEY,       -- "name:tag"
	digest TEXT NOT NULL REFERENCES template_images (digest) ON DELETE CASCADE
);
CREATE INDEX template_tags_by_digest ON template_tags (digest);
`,
	// v2: a template is a tree plus defaults. Content lives under the tree
	// digest, which equals the template digest when there are no defaults
	// (so every v1 template keeps its digest and directory).
	`
ALTER TABLE template_images ADD COLUMN tree TEXT NOT NULL DEFAULT '';
ALTER TABLE template_images ADD COLUMN config TEXT NOT NULL DEFAULT '{}';
ALTER TABLE template_images ADD COLUMN layers TEXT NOT NULL DEFAULT '[]';
UPDATE template_images SET tree = digest;
CREATE INDEX template_images_by_tree ON template_images (tree);
CREATE TABLE template_build_cache (
	key        TEXT PRIMARY KEY,   -- sha256 of (parent digest, step, inputs)
	digest     TEXT NOT NULL,      -- the template the step produced
	created_at INTEGER NOT NULL
);
`,
}

// Open opens the template store rooted at dir, with metadata in db and the
// base build cache in cacheDir. It creates its tables, removes leftovers of
// interrupted imports and forgets templates whose content has vanished.
func Open(db *sql.DB, dir, cacheDir string, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.Default()
	}
	if dir == "" {
		return nil, fmt.Errorf("template dir is empty: %w", errdefs.ErrInvalidArgument)
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	// 0700: template trees come from untrusted archives and contain
	// world-writable directories (every /tmp); no host user but root may
	// reach them. Runtimes read templates as root.
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o700); err != nil {
		return nil, fmt.Errorf("create template dir: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("restrict template dir: %w", err)
	}
	s := &Store{db: db, dir: dir, cacheDir: cacheDir, log: log}
	if err := s.migrate(context.Background()); err != nil {
		return nil, fmt.Errorf("template schema: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	s.lock = lock
	if unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
		if err := s.collectGarbage(context.Background()); err != nil {
			log.Warn("template store: garbage collection failed", "dir", dir, "err", err)
		}
	}
	// Downgrade (or take) the shared lock for the Store's lifetime.
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_SH); err != nil {
		lock.Close()
		return nil, fmt.Errorf("lock template dir: %w", err)
	}
	return s, nil
}

// Close releases the store's directory lock. The *sql.DB is the caller's.
func (s *Store) Close() error {
	if s.lock == nil {
		return nil
	}
	err := s.lock.Close()
	s.lock = nil
	return err
}

// Dir returns the store's root directory.
func (s *Store) Dir() string { return s.dir }

func (s *Store) migrate(ctx context.Context) error {
	return store.MigrateTables(ctx, s.db, "template", templateSchema)
}

// collectGarbage removes tmp/ leftovers and content directories without a
// record (a crash between rename and insert), and drops records whose
// content is gone. Only called while holding the exclusive lock.
func (s *Store) collectGarbage(ctx context.Context) error {
	tmp := filepath.Join(s.dir, "tmp")
	junk, _ := os.ReadDir(tmp)
	for _, e := range junk {
		p := filepath.Join(tmp, e.Name())
		s.log.Info("template store: removing interrupted import", "path", p)
		if err := os.RemoveAll(p); err != nil {
			return err
		}
	}
	known := map[string]bool{}
	rows, err := s.db.QueryContext(ctx, `SELECT DISTINCT tree FROM template_images`)
	if err != nil {
		return err
	}
	var trees []string
	for rows.Next() {
		var d string
		if err := rows.Scan(&d); err != nil {
			rows.Close()
			return err
		}
		trees = append(trees, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, d := range trees {
		hex := strings.TrimPrefix(d, "sha256:")
		known[hex] = true
		if _, err := os.Stat(filepath.Join(s.dir, hex, "rootfs")); errors.Is(err, os.ErrNotExist) {
			s.log.Warn("template store: content missing, forgetting its templates", "tree", d)
			if _, err := s.db.ExecContext(ctx, `DELETE FROM template_images WHERE tree = ?`, d); err != nil {
				return err
			}
		}
	}
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !hexDigest.MatchString(e.Name()) || known[e.Name()] {
			continue
		}
		p := filepath.Join(s.dir, e.Name())
		s.log.Info("template store: removing unrecorded content", "path", p)
		if err := os.RemoveAll(p); err != nil {
			return err
		}
	}
	return nil
}

var (
	nameRE      = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]*$`)
	tagRE       = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,128}$`)
	hexDigest   = regexp.MustCompile(`^[0-9a-f]{64}$`)
	hexPrefixRE = regexp.MustCompile(`^[0-9a-f]{12,64}$`)
)

// maxNameLen bounds template names (the pattern alone does not).
const maxNameLen = 128

// ParseTag validates "name[:tag]" and returns it normalised to "name:tag"
// ("name" means "name:latest"). The name "sha256" is reserved for digests.
func ParseTag(ref string) (string, error) {
	name, tag, ok := strings.Cut(ref, ":")
	if !ok {
		tag = "latest"
	}
	if len(name) > maxNameLen || !nameRE.MatchString(name) {
		return "", fmt.Errorf("template name %q must match [a-z0-9][a-z0-9._-]* (at most %d bytes): %w", name, maxNameLen, errdefs.ErrInvalidArgument)
	}
	if name == "sha256" {
		return "", fmt.Errorf("template name %q is reserved for digests: %w", name, errdefs.ErrInvalidArgument)
	}
	if !tagRE.MatchString(tag) {
		return "", fmt.Errorf("template tag %q must match [A-Za-z0-9_.-]{1,128}: %w", tag, errdefs.ErrInvalidArgument)
	}
	return name + ":" + tag, nil
}

// ValidateRef checks that ref is well formed — "sha256:" and 12 to 64
// lowercase hex digits, or "name[:tag]" (see ParseTag) — without looking it
// up, so a request naming a malformed template is refused before anything
// is recorded for it.
func ValidateRef(ref string) error {
	if hexPart, ok := strings.CutPrefix(ref, "sha256:"); ok {
		if !hexPrefixRE.MatchString(hexPart) {
			return fmt.Errorf("template digest %q must be sha256: and 12 to 64 lowercase hex digits: %w", ref, errdefs.ErrInvalidArgument)
		}
		return nil
	}
	_, err := ParseTag(ref)
	return err
}

// resolveDigest turns a ref into a full digest: "sha256:<hex>" (or a unique
// prefix of at least 12 hex digits) or a tag.
func (s *Store) resolveDigest(ctx context.Context, ref string) (string, error) {
	if err := ValidateRef(ref); err != nil {
		return "", err
	}
	if strings.HasPrefix(ref, "sha256:") {
		rows, err := s.db.QueryContext(ctx,
			`SELECT digest FROM template_images WHERE substr(digest, 1, ?) = ? LIMIT 2`, len(ref), ref)
		if err != nil {
			return "", err
		}
		defer rows.Close()
		var found []string
		for rows.Next() {
			var d string
			if err := rows.Scan(&d); err != nil {
				return "", err
			}
			found = append(found, d)
		}
		if err := rows.Err(); err != nil {
			return "", err
		}
		switch len(found) {
		case 0:
			return "", fmt.Errorf("template %q: %w", ref, errdefs.ErrNotFound)
		case 1:
			return found[0], nil
		}
		return "", fmt.Errorf("template digest prefix %q is ambiguous: %w", ref, errdefs.ErrInvalidArgument)
	}
	tag, err := ParseTag(ref)
	if err != nil {
		return "", err
	}
	var d string
	err = s.db.QueryRowContext(ctx, `SELECT digest FROM template_tags WHERE ref = ?`, tag).Scan(&d)
	if errors.Is(err, sql.ErrNoRows) {
		return "", fmt.Errorf("template %q: %w", tag, errdefs.ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("resolve template %q: %w", tag, err)
	}
	return d, nil
}

// Resolve returns the template ref names and the directory holding its root
// filesystem (read-only by convention: derive, never write).
func (s *Store) Resolve(ctx context.Context, ref string) (api.Template, string, error) {
	t, err := s.Get(ctx, ref)
	if err != nil {
		return api.Template{}, "", err
	}
	rootfs, err := s.Content(t)
	if err != nil {
		return api.Template{}, "", err
	}
	return t, rootfs, nil
}

// Content returns the directory holding the root filesystem of t, a
// template Get returned (Resolve without the lookup).
func (s *Store) Content(t api.Template) (string, error) {
	rootfs := s.rootfsDir(t.TreeDigest)
	if _, err := os.Stat(rootfs); err != nil {
		return "", fmt.Errorf("template %s: content missing at %s: %w", t.Digest, rootfs, errdefs.ErrNotFound)
	}
	return rootfs, nil
}

func (s *Store) rootfsDir(digest string) string {
	return filepath.Join(s.dir, strings.TrimPrefix(digest, "sha256:"), "rootfs")
}

// Get returns the template ref names.
func (s *Store) Get(ctx context.Context, ref string) (api.Template, error) {
	d, err := s.resolveDigest(ctx, ref)
	if err != nil {
		return api.Template{}, err
	}
	list, err := s.list(ctx, d)
	if err != nil {
		return api.Template{}, err
	}
	if len(list) == 0 {
		return api.Template{}, fmt.Errorf("template %q: %w", ref, errdefs.ErrNotFound)
	}
	return list[0], nil
}

// List returns every template, oldest first.
func (s *Store) List(ctx context.Context) ([]api.Template, error) { return s.list(ctx, "") }

func (s *Store) list(ctx context.Context, digest string) ([]api.Template, error) {
	q := `SELECT i.digest, i.tree, i.size_bytes, i.source, i.parent, i.config, i.layers, i.created_at, t.ref
FROM template_images i LEFT JOIN template_tags t ON t.digest = i.digest`
	var args []any
	if digest != "" {
		q += ` WHERE i.digest = ?`
		args = append(args, digest)
	}
	q += ` ORDER BY i.created_at, i.digest, t.ref`
	rows, err := s.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list templates: %w", err)
	}
	defer rows.Close()
	out := []api.Template{}
	for rows.Next() {
		var (
			t              api.Template
			created        int64
			ref            sql.NullString
			config, layers string
		)
		if err := rows.Scan(&t.Digest, &t.TreeDigest, &t.SizeBytes, &t.Source, &t.Parent, &config, &layers, &created, &ref); err != nil {
			return nil, fmt.Errorf("list templates: %w", err)
		}
		if n := len(out); n > 0 && out[n-1].Digest == t.Digest {
			if ref.Valid {
				out[n-1].Tags = append(out[n-1].Tags, ref.String)
			}
			continue
		}
		if err := json.Unmarshal([]byte(config), &t.Config); err != nil {
			return nil, fmt.Errorf("template %s: corrupt config record: %w", t.Digest, err)
		}
		if err := json.Unmarshal([]byte(layers), &t.Layers); err != nil {
			return nil, fmt.Errorf("template %s: corrupt layers record: %w", t.Digest, err)
		}
		t.CreatedAt = time.Unix(0, created).UTC()
		t.Tags = []string{}
		if ref.Valid {
			t.Tags = append(t.Tags, ref.String)
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list templates: %w", err)
	}
	for i := range out {
		sort.Strings(out[i].Tags)
	}
	return out, nil
}

// Tag points tag ("name[:tag]") at the template ref names, moving it if it
// already points elsewhere.
func (s *Store) Tag(ctx context.Context, ref, tag string) error {
	norm, err := ParseTag(tag)
	if err != nil {
		return err
	}
	d, err := s.resolveDigest(ctx, ref)
	if err != nil {
		return err
	}
	return s.setTags(ctx, d, []string{norm})
}

func (s *Store) setTags(ctx context.Context, digest string, tags []string) error {
	if len(tags) == 0 {
		return nil
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	for _, t := range tags {
		if _, err := tx.ExecContext(ctx, `INSERT INTO template_tags (ref, digest) VALUES (?, ?)
ON CONFLICT (ref) DO UPDATE SET digest = excluded.digest`, t, digest); err != nil {
			return fmt.Errorf("tag %s as %s: %w", digest, t, err)
		}
	}
	return tx.Commit()
}

// Untag removes a tag. The content stays (it may be in use by sandboxes).
func (s *Store) Untag(ctx context.Context, tag string) error {
	norm, err := ParseTag(tag)
	if err != nil {
		return err
	}
	res, err := s.db.ExecContext(ctx, `DELETE FROM template_tags WHERE ref = ?`, norm)
	if err != nil {
		return fmt.Errorf("untag %s: %w", norm, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("tag %q: %w", norm, errdefs.ErrNotFound)
	}
	return nil
}
