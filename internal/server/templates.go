package server

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/templatesvc"
)

// Template endpoints: list, inspect, import (tar, OCI, archive), pull,
// build, tag, remove, gc, export. They decode, call the template service
// (templatesvc) and encode; the work, including preparing every new tree
// for the runtimes, is the service's.

func (part templatesAPI) listTemplates(w http.ResponseWriter, r *http.Request) {
	s := part.s
	ts, err := s.tmplsvc.List(r.Context())
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
func (part templatesAPI) getTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	t, err := s.tmplsvc.Inspect(r.Context(), r.PathValue("ref"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, t)
}

// removeTemplate is DELETE /v1/templates/{ref}: a tag is untagged, a digest
// forgotten (see template.Store.Remove).
func (part templatesAPI) removeTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	force, err := queryBool(r, "force")
	if err != nil {
		writeError(w, r, err)
		return
	}
	if err := s.tmplsvc.Remove(r.Context(), r.PathValue("ref"), force); err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// tagTemplate is POST /v1/templates/{ref}/tags: point a tag at ref, moving
// it if it points elsewhere. It answers the template as it now is.
func (part templatesAPI) tagTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var req api.TagRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	t, err := s.tmplsvc.Tag(r.Context(), r.PathValue("ref"), req.Tag)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, t)
}

// gcTemplates is POST /v1/templates/gc.
func (part templatesAPI) gcTemplates(w http.ResponseWriter, r *http.Request) {
	s := part.s
	res, err := s.tmplsvc.GC(r.Context())
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, 200, res)
}

// exportTemplate is GET /v1/templates/{ref}/export: the template archive.
func (part templatesAPI) exportTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	ref := r.PathValue("ref")
	t, err := s.tmplsvc.Get(r.Context(), ref)
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
	if err := s.tmplsvc.Export(r.Context(), t.Digest, lw); err != nil {
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

// importTemplate is POST /v1/templates?format=tar|oci|archive&tag=….
func (part templatesAPI) importTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	format := r.URL.Query().Get("format")
	tags := queryTags(r)
	body, err := uploadBody(r, s.cfg.MaxTemplateBytes)
	if err != nil {
		writeError(w, r, err)
		return
	}
	t, err := s.tmplsvc.Import(r.Context(), format, body, tags)
	if err != nil {
		writeError(w, r, body.check(err))
		return
	}
	writeJSON(w, http.StatusCreated, t)
}

// pullTemplate is POST /v1/templates/pull.
func (part templatesAPI) pullTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var req api.PullRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	t, err := s.tmplsvc.Pull(r.Context(), req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, t)
}

// buildWriteTimeout bounds one write of the build stream: a client that
// stops reading must not hold a build (and its sandbox) forever.
const buildWriteTimeout = time.Minute

// buildTemplate is POST /v1/templates/build?file=…&tag=…&no_cache=1: the
// body is a tar of the build context; the answer an NDJSON stream of
// api.BuildEvent once the build file has parsed.
func (part templatesAPI) buildTemplate(w http.ResponseWriter, r *http.Request) {
	s := part.s
	req := templatesvc.BuildRequest{File: r.URL.Query().Get("file"), Tags: queryTags(r)}
	var err error
	if req.NoCache, err = queryBool(r, "no_cache"); err == nil {
		req.Network, err = queryBool(r, "network")
	}
	var internet bool
	if err == nil {
		internet, err = queryBool(r, "internet")
	}
	if q := r.URL.Query(); err == nil && (internet || len(q["allow_out"]) > 0 || len(q["deny_out"]) > 0 || len(q["allow_private"]) > 0) {
		req.NetworkPolicy = &api.NetworkPolicy{Internet: internet, AllowOut: q["allow_out"], DenyOut: q["deny_out"], AllowPrivate: q["allow_private"]}
	}
	if err == nil {
		err = req.Check() // before the body is read
	}
	if err != nil {
		writeError(w, r, err)
		return
	}
	body, err := uploadBody(r, s.cfg.MaxTemplateBytes)
	if err != nil {
		writeError(w, r, err)
		return
	}
	b, err := s.tmplsvc.OpenBuild(r.Context(), req, body)
	if err != nil {
		writeError(w, r, body.check(err))
		return
	}
	defer b.Close()

	nd := newNDJSON(w, buildWriteTimeout)
	defer nd.Close()
	t, err := b.Run(r.Context(), func(ev api.BuildEvent) error { return nd.Send(ev) })
	if err != nil {
		nd.Send(api.BuildEvent{Error: &api.ErrorBody{Code: errdefs.Code(err), Message: errorMessage(err)}})
		return
	}
	nd.Send(api.BuildEvent{Template: &t})
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
func (part templatesAPI) buildBase(w http.ResponseWriter, r *http.Request) {
	s := part.s
	nd := newNDJSON(w, 0)
	progress := make(chan template.Progress, 64)
	done := make(chan struct{})
	var (
		t   api.Template
		err error
	)
	go func() {
		defer close(done)
		t, err = s.tmplsvc.EnsureBase(r.Context(), func(p template.Progress) {
			select {
			case progress <- p:
			default: // never block the build on a slow client
			}
		})
	}()
	for {
		select {
		case p := <-progress:
			nd.Send(map[string]any{"phase": p.Phase, "done": p.Done, "total": p.Total, "message": p.Message})
		case <-done:
			if err != nil {
				nd.Send(api.Error{Error: api.ErrorBody{Code: errdefs.Code(err), Message: err.Error()}})
			} else {
				nd.Send(map[string]any{"template": t})
			}
			return
		}
	}
}
