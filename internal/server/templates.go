package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/build"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/template"
)

// Template endpoints: list, inspect, import (tar, OCI, archive), pull,
// build, tag, remove, gc, export. Every import path ends in prepared: the
// runtimes derive what they need from the new tree before the client hears
// of it, so the first sandbox of a template does not pay for that.

func (s *Server) listTemplates(w http.ResponseWriter, r *http.Request) {
	ts, err := s.tmpl.List(r.Context())
	if err != nil {
		writeError(w, r, err)
		return
	}
	if ts == nil {
		ts = []api.Template{}
	}
	writeJSON(w, 200, api.TemplateList{Templates: ts})
}

// getTemplate is inspect: the template plus the sandboxes created from it.
func (s *Server) getTemplate(w http.ResponseWriter, r *http.Request) {
	t, err := s.tmpl.Get(r.Context(), r.PathValue("ref"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	users, err := s.templateUsers(r.Context())
	if err != nil {
		writeError(w, r, err)
		return
	}
	t.UsedBy = users[t.Digest]
	writeJSON(w, 200, t)
}

// templateUsers maps template digests to the ids of the sandboxes created
// from them that still exist, whatever their state: a stopped or suspended
// sandbox needs its template as much as a running one.
func (s *Server) templateUsers(ctx context.Context) (map[string][]string, error) {
	sbs, err := s.mgr.List(ctx, "", nil)
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

// templatesInUse is templateUsers as the set the store's Remove and GC take.
func (s *Server) templatesInUse(ctx context.Context) (map[string]bool, error) {
	users, err := s.templateUsers(ctx)
	if err != nil {
		return nil, err
	}
	inUse := make(map[string]bool, len(users))
	for d := range users {
		inUse[d] = true
	}
	return inUse, nil
}

// removeTemplate is DELETE /v1/templates/{ref}: a tag is untagged, a digest
// forgotten (see template.Store.Remove).
func (s *Server) removeTemplate(w http.ResponseWriter, r *http.Request) {
	force, err := queryBool(r, "force")
	if err != nil {
		writeError(w, r, err)
		return
	}
	inUse, err := s.templatesInUse(r.Context())
	if err != nil {
		writeError(w, r, err)
		return
	}
	if err := s.tmpl.Remove(r.Context(), r.PathValue("ref"), force, inUse); err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// tagTemplate is POST /v1/templates/{ref}/tags: point a tag at ref, moving
// it if it points elsewhere. It answers the template as it now is.
func (s *Server) tagTemplate(w http.ResponseWriter, r *http.Request) {
	var req api.TagRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if req.Tag == "" {
		writeError(w, r, fmt.Errorf("tag is empty; want name:tag: %w", errdefs.ErrInvalidArgument))
		return
	}
	ref := r.PathValue("ref")
	if err := s.tmpl.Tag(r.Context(), ref, req.Tag); err != nil {
		writeError(w, r, err)
		return
	}
	t, err := s.tmpl.Get(r.Context(), req.Tag)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, t)
}

// gcTemplates is POST /v1/templates/gc.
func (s *Server) gcTemplates(w http.ResponseWriter, r *http.Request) {
	inUse, err := s.templatesInUse(r.Context())
	if err != nil {
		writeError(w, r, err)
		return
	}
	res, err := s.tmpl.GC(r.Context(), inUse, s.forgetTemplate)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, res)
}

// forgetTemplate asks every configured runtime that derives formats from
// template trees to drop what it made of tree. Unavailable runtimes are
// asked too: they may have prepared the tree while they still worked.
func (s *Server) forgetTemplate(ctx context.Context, tree string) error {
	var errs []error
	for name, rt := range s.runtimes {
		if p, ok := rt.(runtime.TemplatePreparer); ok {
			if err := p.ForgetTemplate(ctx, tree); err != nil {
				errs = append(errs, fmt.Errorf("runtime %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}

// prepare lets every available runtime derive its format of t's tree. A
// failure is logged, not returned: the template is stored and good, and a
// runtime derives on demand at create if it has to.
func (s *Server) prepare(ctx context.Context, t api.Template) {
	var rootfs string
	for name, rt := range s.runtimes {
		p, ok := rt.(runtime.TemplatePreparer)
		if !ok || !rt.Probe(ctx).Available {
			continue
		}
		if rootfs == "" {
			_, dir, err := s.tmpl.Resolve(ctx, t.Digest)
			if err != nil {
				s.cfg.Logger.Warn("preparing template: resolve", "template", t.Digest, "err", err)
				return
			}
			rootfs = dir
		}
		if err := p.PrepareTemplate(ctx, t.TreeDigest, rootfs); err != nil {
			s.cfg.Logger.Warn("runtime could not prepare template; it will derive at create", "runtime", name,
				"template", t.Digest, "tree", t.TreeDigest, "err", err)
		}
	}
}

// exportTemplate is GET /v1/templates/{ref}/export: the template archive.
func (s *Server) exportTemplate(w http.ResponseWriter, r *http.Request) {
	ref := r.PathValue("ref")
	t, err := s.tmpl.Get(r.Context(), ref)
	if err != nil {
		writeError(w, r, err)
		return
	}
	lw := &lazyWriter{w: w, start: func() {
		w.Header().Set("Content-Type", "application/x-tar")
		w.Header().Set("Content-Disposition", `attachment; filename="`+archiveFileName(t)+`"`)
		w.WriteHeader(200)
	}}
	// Export by digest: a tag moved between Get and Export must not change
	// what the headers above describe.
	if err := s.tmpl.Export(r.Context(), t.Digest, lw); err != nil {
		if !lw.started {
			writeError(w, r, err)
			return
		}
		// Half an archive is on the wire; an archive without its end
		// marker is refused by import, but cut the connection as well so
		// no client mistakes it for complete.
		s.cfg.Logger.Warn("template export failed mid-stream", "template", t.Digest, "err", err)
		panic(http.ErrAbortHandler)
	}
}

// archiveFileName is a safe download name for t: its first tag, else its
// digest, with characters that do not belong in a file name replaced.
func archiveFileName(t api.Template) string {
	name := t.Digest
	if len(t.Tags) > 0 {
		name = t.Tags[0]
	}
	b := []byte(name)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_') {
			b[i] = '_'
		}
	}
	return string(b) + ".tar"
}

// lazyWriter sends the response head only when the first byte of the body
// is written, so a failure before that can still be an error response.
type lazyWriter struct {
	w       io.Writer
	start   func()
	started bool
}

func (l *lazyWriter) Write(p []byte) (int, error) {
	if !l.started {
		l.started = true
		l.start()
	}
	return l.w.Write(p)
}

// Import formats of POST /v1/templates.
const (
	formatTar     = "tar"     // a root filesystem
	formatOCI     = "oci"     // a docker-save or OCI image layout tar
	formatArchive = "archive" // a template archive (GET …/export)
)

// importTemplate is POST /v1/templates?format=tar|oci|archive&tag=….
func (s *Server) importTemplate(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	format := q.Get("format")
	if format == "" {
		format = formatTar
	}
	tags := queryTags(r)
	body, err := uploadBody(r, s.cfg.MaxTemplateBytes)
	if err != nil {
		writeError(w, r, err)
		return
	}
	opts := template.ImportOptions{Tags: tags, MaxBytes: s.cfg.MaxTemplateBytes}
	var t api.Template
	switch format {
	case formatTar:
		opts.Source = "tar"
		t, err = s.tmpl.ImportTar(r.Context(), body, opts)
	case formatArchive:
		t, err = s.tmpl.ImportArchive(r.Context(), body, opts)
	case formatOCI:
		// Archives are read in place: the store spools the upload to a
		// file under its tmp/ (gzip decompressed) and removes it after.
		t, err = s.tmpl.ImportOCIStream(r.Context(), body, template.OCISource{}, opts)
	default:
		err = fmt.Errorf("format %q: want tar, oci or archive: %w", format, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		writeError(w, r, body.check(err))
		return
	}
	s.prepare(r.Context(), t)
	writeJSON(w, http.StatusCreated, t)
}

// pullTemplate is POST /v1/templates/pull.
func (s *Server) pullTemplate(w http.ResponseWriter, r *http.Request) {
	var req api.PullRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if strings.TrimSpace(req.Image) == "" {
		writeError(w, r, fmt.Errorf("image is empty; want a reference like registry:5000/app:1: %w", errdefs.ErrInvalidArgument))
		return
	}
	t, err := s.tmpl.ImportOCI(r.Context(), template.OCISource{Image: req.Image, Insecure: req.Insecure, AllowPrivate: s.cfg.AllowPrivateRegistries},
		template.ImportOptions{Tags: req.Tags, MaxBytes: s.cfg.MaxTemplateBytes})
	if err != nil {
		writeError(w, r, err)
		return
	}
	s.prepare(r.Context(), t)
	writeJSON(w, http.StatusCreated, t)
}

// buildFileDir is the top-level context directory a client puts a build
// file from outside the context in (sdk.BuildFileDir). It is removed from
// the context before the build, so COPY never sees it.
const buildFileDir = ".space-build"

// buildWriteTimeout bounds one write of the build stream: a client that
// stops reading must not hold a build (and its sandbox) forever.
const buildWriteTimeout = time.Minute

// buildTemplate is POST /v1/templates/build?file=…&tag=…&no_cache=1: the
// body is a tar of the build context; the answer an NDJSON stream of
// api.BuildEvent once the build file has parsed.
func (s *Server) buildTemplate(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	file := q.Get("file")
	if file == "" {
		file = "Dockerfile"
	}
	if path.IsAbs(file) || strings.ContainsRune(file, 0) || path.Clean(file) == ".." || strings.HasPrefix(path.Clean(file), "../") {
		writeError(w, r, fmt.Errorf("file %q must be a relative path inside the build context: %w", file, errdefs.ErrInvalidArgument))
		return
	}
	file = path.Clean(file)
	noCache, err := queryBool(r, "no_cache")
	if err != nil {
		writeError(w, r, err)
		return
	}
	network, err := queryBool(r, "network")
	if err != nil {
		writeError(w, r, err)
		return
	}
	tags := queryTags(r)
	for _, t := range tags {
		if _, err := template.ParseTag(t); err != nil {
			writeError(w, r, err)
			return
		}
	}
	body, err := uploadBody(r, s.cfg.MaxTemplateBytes)
	if err != nil {
		writeError(w, r, err)
		return
	}
	// The context lives under the template store's tmp/, emptied when the
	// store opens: a crash mid-build leaves nothing for long.
	work, err := os.MkdirTemp(filepath.Join(s.tmpl.Dir(), "tmp"), "build-context-")
	if err != nil {
		writeError(w, r, fmt.Errorf("build context dir: %w", err))
		return
	}
	defer os.RemoveAll(work)
	dir := filepath.Join(work, "context")
	if err := os.Mkdir(dir, 0o700); err != nil {
		writeError(w, r, err)
		return
	}
	if err := template.ExtractTar(ctx, body, dir, s.cfg.MaxTemplateBytes); err != nil {
		writeError(w, r, body.check(fmt.Errorf("build context: %w", err)))
		return
	}
	bf, err := readBuildFile(dir, file)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if err := os.RemoveAll(filepath.Join(dir, buildFileDir)); err != nil {
		writeError(w, r, err)
		return
	}

	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	// The deadline would outlive this response on a kept-alive connection
	// (the server sets none of its own): clear it when done.
	defer rc.SetWriteDeadline(time.Time{})
	rc.Flush()
	var (
		mu     sync.Mutex
		broken bool
	)
	send := func(ev api.BuildEvent) {
		mu.Lock()
		defer mu.Unlock()
		if broken {
			return
		}
		line, err := json.Marshal(ev)
		if err == nil {
			_ = rc.SetWriteDeadline(time.Now().Add(buildWriteTimeout))
			if _, err = w.Write(append(line, '\n')); err == nil {
				err = rc.Flush()
			}
		}
		if err != nil {
			// The client is gone or stuck: stop the build, which removes
			// its step sandbox.
			broken = true
			cancel()
		}
	}
	if err := s.ensureBaseFor(bctx, bf, send); err != nil {
		send(api.BuildEvent{Error: &api.ErrorBody{Code: errdefs.Code(err), Message: errorMessage(err)}})
		return
	}
	t, err := build.Build(bctx, build.Options{
		File: bf, ContextDir: dir, Tags: tags, Templates: s.tmpl, Runner: s.mgr,
		MaxBytes: s.cfg.MaxTemplateBytes, NoCache: noCache, Network: network, Events: send,
	})
	if err != nil {
		status := errdefs.HTTPStatus(err)
		if status >= 500 && !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrTimeout) && ctx.Err() == nil {
			s.cfg.Logger.Error("template build failed", "err", err)
		}
		send(api.BuildEvent{Error: &api.ErrorBody{Code: errdefs.Code(err), Message: errorMessage(err)}})
		return
	}
	s.prepare(bctx, t)
	send(api.BuildEvent{Template: &t})
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
		return nil, fmt.Errorf("build file %q: %v: %w", file, err, errdefs.ErrInvalidArgument)
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

// queryTags returns the non-empty tag= parameters (validated by the store).
func queryTags(r *http.Request) []string {
	var tags []string
	for _, t := range r.URL.Query()["tag"] {
		if t != "" {
			tags = append(tags, t)
		}
	}
	return tags
}

// queryBool parses an optional boolean query parameter ("1", "true", …).
func queryBool(r *http.Request, name string) (bool, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("query parameter %s=%q: want true or false: %w", name, v, errdefs.ErrInvalidArgument)
	}
	return b, nil
}

// buildBase streams the base template build's progress as NDJSON.
func (s *Server) buildBase(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(200)
	enc := json.NewEncoder(w)
	fl, _ := w.(http.Flusher)
	progress := make(chan template.Progress, 64)
	done := make(chan struct{})
	var (
		t   api.Template
		err error
	)
	go func() {
		defer close(done)
		t, err = s.tmpl.EnsureBase(r.Context(), func(p template.Progress) {
			select {
			case progress <- p:
			default: // never block the build on a slow client
			}
		})
	}()
	for {
		select {
		case p := <-progress:
			enc.Encode(map[string]any{"phase": p.Phase, "done": p.Done, "total": p.Total, "message": p.Message})
			if fl != nil {
				fl.Flush()
			}
		case <-done:
			if err != nil {
				enc.Encode(api.Error{Error: api.ErrorBody{Code: errdefs.Code(err), Message: err.Error()}})
			} else {
				s.prepare(r.Context(), t)
				enc.Encode(map[string]any{"template": t})
			}
			return
		}
	}
}

// ensureBaseFor builds the base template when the build starts FROM it and
// it is missing (a fresh server), as `space run` does, reporting progress
// as build output instead of failing the first build.
func (s *Server) ensureBaseFor(ctx context.Context, bf *build.File, send func(api.BuildEvent)) error {
	if len(bf.Instructions) == 0 || bf.Instructions[0].Cmd != "FROM" || len(bf.Instructions[0].Args) == 0 {
		return nil
	}
	ref, err := template.ParseTag(bf.Instructions[0].Args[0])
	if err != nil || ref != template.BaseTag {
		return nil
	}
	if _, err := s.tmpl.Get(ctx, ref); !errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	send(api.BuildEvent{Output: "building the base template first (once; a few minutes)\n"})
	last := ""
	_, err = s.tmpl.EnsureBase(ctx, func(p template.Progress) {
		if p.Phase != last {
			last = p.Phase
			send(api.BuildEvent{Output: "base: " + p.Phase + "\n"})
		}
	})
	return err
}
