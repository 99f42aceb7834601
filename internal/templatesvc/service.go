// Package templatesvc is the template service beside sandbox.Manager: import,
// pull, build, tag, remove, gc and export of templates, and the runtimes'
// own forms of template trees (prepared after every import, pull and build,
// forgotten at gc). The HTTP handlers only decode, call and encode.
//
// It sits above internal/template (the store), internal/build (build files)
// and the runtimes; the sandbox manager reaches it only through Sandboxes.
package templatesvc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/build"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/template"
)

// Sandboxes is what the service needs of the sandbox manager: which
// sandboxes exist (a template in use is kept) and a runner for build steps.
type Sandboxes interface {
	List(ctx context.Context, state string, labels map[string]string) ([]api.Sandbox, error)
	// PoolTemplates names the templates warm pools' members (which List
	// never shows) are made from: they are in use too.
	PoolTemplates(ctx context.Context) (map[string]bool, error)
	build.Runner
}

// Config configures a Service.
type Config struct {
	Templates *template.Store
	Runtimes  map[string]runtime.Runtime
	// Sandboxes is the sandbox manager; nil only where no sandbox is ever
	// needed (tests: a build with RUN steps is then refused).
	Sandboxes Sandboxes
	Logger    *slog.Logger
	// MaxBytes bounds one import, pull or build context.
	MaxBytes int64
	// AllowPrivateRegistries lets pulls reach loopback, private and
	// link-local addresses.
	AllowPrivateRegistries bool
	// Owners records which tenant owns each tag (tenants.go); nil: every
	// template is visible to every caller.
	Owners Owners
}

// Service does the template work of one server.
type Service struct {
	cfg Config
	log *slog.Logger
}

// New returns the service for cfg.
func New(cfg Config) *Service {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg, log: cfg.Logger}
}

// List returns every template.
func (s *Service) List(ctx context.Context) ([]api.Template, error) {
	ts, err := s.cfg.Templates.List(ctx)
	if err != nil {
		return nil, err
	}
	return s.filterVisible(ctx, ts)
}

// Get returns the template ref names (a tag or a digest).
func (s *Service) Get(ctx context.Context, ref string) (api.Template, error) {
	t, err := s.cfg.Templates.Get(ctx, ref)
	if err != nil {
		return api.Template{}, err
	}
	return s.checkVisible(ctx, ref, t)
}

// Inspect is Get plus the sandboxes created from the template.
func (s *Service) Inspect(ctx context.Context, ref string) (api.Template, error) {
	t, err := s.Get(ctx, ref)
	if err != nil {
		return api.Template{}, err
	}
	users, err := s.Users(ctx)
	if err != nil {
		return api.Template{}, err
	}
	t.UsedBy = users[t.Digest]
	return t, nil
}

// Users maps template digests to the ids of the sandboxes created from them
// that still exist, whatever their state: a stopped or suspended sandbox
// needs its template as much as a running one.
func (s *Service) Users(ctx context.Context) (map[string][]string, error) {
	sbs, err := s.cfg.Sandboxes.List(ctx, "", nil)
	if err != nil {
		return nil, fmt.Errorf("listing sandboxes: %w", err)
	}
	out := map[string][]string{}
	for _, sb := range sbs {
		d := sb.TemplateDigest
		if d == "" && strings.HasPrefix(sb.Template, "sha256:") && len(sb.Template) == len("sha256:")+64 {
			d = sb.Template // a create that has not resolved its template yet
		}
		if sb.State == api.StateDeleted || d == "" {
			continue
		}
		out[d] = append(out[d], sb.ID)
	}
	return out, nil
}

// inUse is Users as the set the store's Remove and GC take.
func (s *Service) inUse(ctx context.Context) (map[string]bool, error) {
	// Every tenant's sandboxes keep their templates alive, whoever asks.
	users, err := s.Users(principal.With(ctx, principal.System))
	if err != nil {
		return nil, err
	}
	inUse := make(map[string]bool, len(users))
	for d := range users {
		inUse[d] = true
	}
	if s.cfg.Sandboxes != nil {
		held, err := s.cfg.Sandboxes.PoolTemplates(ctx)
		if err != nil {
			return nil, fmt.Errorf("listing pool members: %w", err)
		}
		for d := range held {
			inUse[d] = true
		}
	}
	return inUse, nil
}

// Remove untags a tag or forgets a digest (see template.Store.Remove).
func (s *Service) Remove(ctx context.Context, ref string, force bool) error {
	t, err := s.Get(ctx, ref)
	if err != nil {
		return err
	}
	// A tenant removes its own tags, and forgets a digest only when every
	// tag of it is its own: never a shared template, never another's.
	if p, limited := caller(ctx); limited && s.cfg.Owners != nil {
		tags := t.Tags
		if !strings.HasPrefix(ref, "sha256:") {
			tag, _ := template.ParseTag(ref)
			tags = []string{tag}
		} else if full, err := s.cfg.Templates.Get(ctx, ref); err == nil && len(full.Tags) != len(t.Tags) {
			return fmt.Errorf("template %s has tags of other tenants: %w", ref, errdefs.ErrPermissionDenied)
		}
		for _, tag := range tags {
			if owner, err := s.cfg.Owners.TagOwner(ctx, tag); err != nil {
				return err
			} else if owner != p.Tenant {
				return fmt.Errorf("template tag %s is shared; only an admin key may remove it: %w", tag, errdefs.ErrPermissionDenied)
			}
		}
	}
	inUse, err := s.inUse(ctx)
	if err != nil {
		return err
	}
	if err := s.cfg.Templates.Remove(ctx, ref, force, inUse); err != nil {
		return err
	}
	if s.cfg.Owners != nil && !strings.HasPrefix(ref, "sha256:") {
		if tag, err := template.ParseTag(ref); err == nil {
			return s.cfg.Owners.SetTagOwner(ctx, tag, "")
		}
	}
	return nil
}

// Tag points tag at ref, moving it if it points elsewhere, and returns the
// template as it now is.
func (s *Service) Tag(ctx context.Context, ref, tag string) (api.Template, error) {
	if tag == "" {
		return api.Template{}, fmt.Errorf("tag is empty; want name:tag: %w", errdefs.ErrInvalidArgument)
	}
	if _, err := s.Get(ctx, ref); err != nil {
		return api.Template{}, err
	}
	if _, err := s.claimTags(ctx, []string{tag}); err != nil {
		return api.Template{}, err
	}
	if err := s.cfg.Templates.Tag(ctx, ref, tag); err != nil {
		return api.Template{}, err
	}
	if err := s.ownTags(ctx, []string{tag}); err != nil {
		return api.Template{}, err
	}
	return s.Get(ctx, tag)
}

// GC removes every template nothing keeps alive, and what the runtimes
// made of their trees.
func (s *Service) GC(ctx context.Context) (api.GCResult, error) {
	inUse, err := s.inUse(ctx)
	if err != nil {
		return api.GCResult{}, err
	}
	return s.cfg.Templates.GC(ctx, inUse, s.Forget)
}

// Export writes the template archive of ref to w.
func (s *Service) Export(ctx context.Context, ref string, w io.Writer) error {
	if _, err := s.Get(ctx, ref); err != nil {
		return err
	}
	return s.cfg.Templates.Export(ctx, ref, w)
}

// Forget asks every configured runtime that derives formats from template
// trees to drop what it made of tree. Unavailable runtimes are asked too:
// they may have prepared the tree while they still worked.
func (s *Service) Forget(ctx context.Context, tree string) error {
	var errs []error
	for name, rt := range s.cfg.Runtimes {
		if p, ok := rt.(runtime.TemplatePreparer); ok {
			if err := p.ForgetTemplate(ctx, tree); err != nil {
				errs = append(errs, fmt.Errorf("runtime %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Prepare lets every available runtime derive its format of t's tree. A
// failure is logged, not returned: the template is stored and good, and a
// runtime derives on demand at create if it has to.
func (s *Service) Prepare(ctx context.Context, t api.Template) {
	var rootfs string
	for name, rt := range s.cfg.Runtimes {
		p, ok := rt.(runtime.TemplatePreparer)
		if !ok || !rt.Probe(ctx).Available {
			continue
		}
		if rootfs == "" {
			_, dir, err := s.cfg.Templates.Resolve(ctx, t.Digest)
			if err != nil {
				s.log.Warn("preparing template: resolve", "template", t.Digest, "err", err)
				return
			}
			rootfs = dir
		}
		if err := p.PrepareTemplate(ctx, t.TreeDigest, rootfs); err != nil {
			s.log.Warn("runtime could not prepare template; it will derive at create", "runtime", name,
				"template", t.Digest, "tree", t.TreeDigest, "err", err)
		}
	}
}

// Import formats.
const (
	FormatTar     = "tar"     // a root filesystem
	FormatOCI     = "oci"     // a docker-save or OCI image layout tar
	FormatArchive = "archive" // a template archive (Export)
)

// Import stores the template in r (format FormatTar, FormatOCI or
// FormatArchive; "" is FormatTar) under tags, and prepares it.
func (s *Service) Import(ctx context.Context, format string, r io.Reader, tags []string) (api.Template, error) {
	if format == "" {
		format = FormatTar
	}
	tags, err := s.claimTags(ctx, tags)
	if err != nil {
		return api.Template{}, err
	}
	opts := template.ImportOptions{Tags: tags, MaxBytes: s.cfg.MaxBytes}
	var t api.Template
	switch format {
	case FormatTar:
		opts.Source = "tar"
		t, err = s.cfg.Templates.ImportTar(ctx, r, opts)
	case FormatArchive:
		t, err = s.cfg.Templates.ImportArchive(ctx, r, opts)
	case FormatOCI:
		// Archives are read in place: the store spools the upload to a
		// file under its tmp/ (gzip decompressed) and removes it after.
		t, err = s.cfg.Templates.ImportOCIStream(ctx, r, template.OCISource{}, opts)
	default:
		err = fmt.Errorf("format %q: want tar, oci or archive: %w", format, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		return api.Template{}, err
	}
	if err := s.ownTags(ctx, tags); err != nil {
		return api.Template{}, err
	}
	s.Prepare(ctx, t)
	return t, nil
}

// Pull imports an image from a registry and prepares it.
func (s *Service) Pull(ctx context.Context, req api.PullRequest) (api.Template, error) {
	if strings.TrimSpace(req.Image) == "" {
		return api.Template{}, fmt.Errorf("image is empty; want a reference like registry:5000/app:1: %w", errdefs.ErrInvalidArgument)
	}
	tags, err := s.claimTags(ctx, req.Tags)
	if err != nil {
		return api.Template{}, err
	}
	t, err := s.cfg.Templates.ImportOCI(ctx, template.OCISource{Image: req.Image, Insecure: req.Insecure, AllowPrivate: s.cfg.AllowPrivateRegistries},
		template.ImportOptions{Tags: tags, MaxBytes: s.cfg.MaxBytes})
	if err != nil {
		return api.Template{}, err
	}
	if err := s.ownTags(ctx, tags); err != nil {
		return api.Template{}, err
	}
	s.Prepare(ctx, t)
	return t, nil
}

// EnsureBase returns the base template, building it first if it is missing
// (see template.Store.EnsureBase), and prepares it.
func (s *Service) EnsureBase(ctx context.Context, progress func(template.Progress)) (api.Template, error) {
	t, err := s.cfg.Templates.EnsureBase(ctx, progress)
	if err != nil {
		return api.Template{}, err
	}
	s.Prepare(ctx, t)
	return t, nil
}

// BuildFileDir is the top-level context directory a client puts a build
// file from outside the context in (sdk.BuildFileDir). It is removed from
// the context before the build, so COPY never sees it.
const BuildFileDir = ".space-build"

// BuildRequest is one build: the build file's path inside the context
// ("" is Dockerfile), tags for the result and the step options.
type BuildRequest struct {
	File    string
	Tags    []string
	NoCache bool
	Network bool
	// NetworkPolicy is the egress policy of RUN steps with network; nil:
	// every public destination. Setting it implies Network.
	NetworkPolicy *api.NetworkPolicy
}

// Check validates req without touching anything, so a caller can refuse a
// bad request before reading its context.
func (req BuildRequest) Check() error {
	if req.NetworkPolicy != nil {
		if err := netpolicy.Validate(*req.NetworkPolicy); err != nil {
			return err
		}
	}
	file := req.file()
	if path.IsAbs(file) || strings.ContainsRune(file, 0) || path.Clean(file) == ".." || strings.HasPrefix(path.Clean(file), "../") {
		return fmt.Errorf("file %q must be a relative path inside the build context: %w", file, errdefs.ErrInvalidArgument)
	}
	for _, t := range req.Tags {
		if _, err := template.ParseTag(t); err != nil {
			return err
		}
	}
	return nil
}

func (req BuildRequest) file() string {
	if req.File == "" {
		return "Dockerfile"
	}
	return req.File
}

// Build is a build whose context is extracted and whose build file has
// parsed: what is left can only fail as part of the build's own output.
// Close removes its context.
type Build struct {
	s    *Service
	req  BuildRequest
	work string // removed by Close
	dir  string // the context
	file *build.File
}

// OpenBuild checks req, extracts the context tar from r under the template
// store's tmp/ and parses the build file. Every problem with the request
// is found here, before any build output.
func (s *Service) OpenBuild(ctx context.Context, req BuildRequest, r io.Reader) (_ *Build, err error) {
	if err := req.Check(); err != nil {
		return nil, err
	}
	if req.Tags, err = s.claimTags(ctx, req.Tags); err != nil {
		return nil, err
	}
	req.File = path.Clean(req.file())
	// The context lives under the template store's tmp/, emptied when the
	// store opens: a crash mid-build leaves nothing for long.
	work, err := os.MkdirTemp(filepath.Join(s.cfg.Templates.Dir(), "tmp"), "build-context-")
	if err != nil {
		return nil, fmt.Errorf("build context dir: %w", err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(work)
		}
	}()
	dir := filepath.Join(work, "context")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	if err := template.ExtractTar(ctx, r, dir, s.cfg.MaxBytes); err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	bf, err := readBuildFile(dir, req.File)
	if err != nil {
		return nil, err
	}
	// FROM another tenant's template is FROM a template that is not there.
	if len(bf.Instructions) > 0 && bf.Instructions[0].Cmd == "FROM" && len(bf.Instructions[0].Args) > 0 {
		from := bf.Instructions[0].Args[0]
		if _, err := s.cfg.Templates.Get(ctx, from); err == nil {
			if err := s.Visible(ctx, from); err != nil {
				return nil, err
			}
		}
	}
	if err := os.RemoveAll(filepath.Join(dir, BuildFileDir)); err != nil {
		return nil, err
	}
	return &Build{s: s, req: req, work: work, dir: dir, file: bf}, nil
}

// Close removes the build's context.
func (b *Build) Close() error { return os.RemoveAll(b.work) }

// Run runs the build, reporting progress through send, and prepares the
// result. A send that fails (the client is gone or stuck) stops the build,
// which removes its step sandbox; later events are not sent. The final
// outcome is returned, not sent.
func (b *Build) Run(ctx context.Context, send func(api.BuildEvent) error) (api.Template, error) {
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	events := func(ev api.BuildEvent) {
		if send(ev) != nil {
			cancel()
		}
	}
	s := b.s
	if err := s.ensureBaseFor(bctx, b.file, events); err != nil {
		return api.Template{}, err
	}
	var runner build.Runner
	if s.cfg.Sandboxes != nil {
		runner = s.cfg.Sandboxes
	}
	t, err := build.Build(bctx, build.Options{
		File: b.file, ContextDir: b.dir, Tags: b.req.Tags, Templates: s.cfg.Templates, Runner: runner,
		MaxBytes: s.cfg.MaxBytes, NoCache: b.req.NoCache, Network: b.req.Network || b.req.NetworkPolicy != nil,
		NetworkPolicy: b.req.NetworkPolicy, Events: events,
	})
	if err != nil {
		status := errdefs.HTTPStatus(err)
		if status >= 500 && !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrTimeout) && ctx.Err() == nil {
			s.log.Error("template build failed", "err", err)
		}
		return api.Template{}, err
	}
	if err := s.ownTags(ctx, b.req.Tags); err != nil {
		return api.Template{}, err
	}
	s.Prepare(bctx, t)
	return t, nil
}

// readBuildFile opens file inside the extracted context dir, never
// following a symlink out of it (the context is the client's: a symlink to
// a host file must not make its content show up in a parse error), and
// parses it.
func readBuildFile(dir, file string) (*build.File, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	f, err := root.Open(file)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("build file %q is not in the build context: %w", file, errdefs.ErrInvalidArgument)
		}
		return nil, fmt.Errorf("build file %q: %w: %w", file, err, errdefs.ErrInvalidArgument)
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("build file %q is not a regular file: %w", file, errdefs.ErrInvalidArgument)
	}
	bf, err := build.Parse(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return bf, nil
}

// ensureBaseFor builds the base template when the build starts FROM it and
// it is missing (a fresh server), as `space run` does, reporting progress
// as build output instead of failing the first build.
func (s *Service) ensureBaseFor(ctx context.Context, bf *build.File, send func(api.BuildEvent)) error {
	if len(bf.Instructions) == 0 || bf.Instructions[0].Cmd != "FROM" || len(bf.Instructions[0].Args) == 0 {
		return nil
	}
	ref, err := template.ParseTag(bf.Instructions[0].Args[0])
	if err != nil || ref != template.BaseTag {
		return nil
	}
	if _, err := s.cfg.Templates.Get(ctx, ref); !errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	send(api.BuildEvent{Output: "building the base template first (once; a few minutes)\n"})
	last := ""
	_, err = s.cfg.Templates.EnsureBase(ctx, func(p template.Progress) {
		if p.Phase != last {
			last = p.Phase
			send(api.BuildEvent{Output: "base: " + p.Phase + "\n"})
		}
	})
	return err
}
