package sdk

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// ListTemplates is GET /v1/templates.
func (c *Client) ListTemplates(ctx context.Context) ([]api.Template, error) {
	var out api.TemplateList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/templates"}, &out); err != nil {
		return nil, err
	}
	return out.Templates, nil
}

// GetTemplate is GET /v1/templates/{ref} (inspect); ref is "name:tag",
// "sha256:…" or a unique digest prefix. UsedBy lists the sandboxes created
// from it that still exist.
func (c *Client) GetTemplate(ctx context.Context, ref string) (*api.Template, error) {
	if err := checkID("template", ref); err != nil {
		return nil, err
	}
	var out api.Template
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/templates/" + seg(ref)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RemoveTemplate is DELETE /v1/templates/{ref}: a tag is untagged (the
// content stays while anything uses it); a digest forgets the template,
// which the server refuses (ErrConflict) while it is tagged (unless force,
// which drops the tags), used by a sandbox or the parent of another.
func (c *Client) RemoveTemplate(ctx context.Context, ref string, force bool) error {
	if err := checkID("template", ref); err != nil {
		return err
	}
	var q url.Values
	if force {
		q = url.Values{"force": {"true"}}
	}
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/templates/" + seg(ref), query: q}, nil)
}

// TagTemplate is POST /v1/templates/{ref}/tags: point tag ("name[:tag]")
// at ref, moving it if it points elsewhere. It returns the template.
func (c *Client) TagTemplate(ctx context.Context, ref, tag string) (*api.Template, error) {
	if err := checkID("template", ref); err != nil {
		return nil, err
	}
	if tag == "" {
		return nil, fmt.Errorf("tag is empty: %w", errdefs.ErrInvalidArgument)
	}
	var out api.Template
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/templates/" + seg(ref) + "/tags", json: api.TagRequest{Tag: tag}}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// GCTemplates is POST /v1/templates/gc: remove every template nothing
// needs and the stored trees no template uses.
func (c *Client) GCTemplates(ctx context.Context) (*api.GCResult, error) {
	var out api.GCResult
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/templates/gc"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ExportTemplate is GET /v1/templates/{ref}/export: it writes the template
// archive to w. An error after some bytes were written means w holds a
// truncated archive (which ImportTemplateArchive refuses).
func (c *Client) ExportTemplate(ctx context.Context, ref string, w io.Writer) error {
	if err := checkID("template", ref); err != nil {
		return err
	}
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/v1/templates/" + seg(ref) + "/export"})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("exporting template %s: %w", ref, err)
	}
	return nil
}

// Import formats of POST /v1/templates.
const (
	FormatTar     = "tar"     // a root filesystem as a plain or gzip tar
	FormatOCI     = "oci"     // a `docker save` archive or a tar of an OCI image layout
	FormatArchive = "archive" // a template archive written by ExportTemplate
)

// ImportTemplate is POST /v1/templates?tag=name:tag with a tar (optionally
// gzip-compressed) root filesystem as the body. tag may be empty.
func (c *Client) ImportTemplate(ctx context.Context, tag string, tarball io.Reader) (*api.Template, error) {
	var tags []string
	if tag != "" {
		tags = []string{tag}
	}
	return c.ImportTemplateFormat(ctx, FormatTar, tarball, tags...)
}

// ImportTemplateArchive imports an archive written by ExportTemplate. The
// server recomputes the digest from the content and refuses a mismatch, so
// the template keeps its digest across hosts.
func (c *Client) ImportTemplateArchive(ctx context.Context, archive io.Reader, tags ...string) (*api.Template, error) {
	return c.ImportTemplateFormat(ctx, FormatArchive, archive, tags...)
}

// ImportOCI imports an OCI image from a `docker save` archive or a tar of
// an OCI image layout.
func (c *Client) ImportOCI(ctx context.Context, image io.Reader, tags ...string) (*api.Template, error) {
	return c.ImportTemplateFormat(ctx, FormatOCI, image, tags...)
}

// ImportTemplateFormat is POST /v1/templates?format=…&tag=…; format is one
// of FormatTar, FormatOCI, FormatArchive.
func (c *Client) ImportTemplateFormat(ctx context.Context, format string, body io.Reader, tags ...string) (*api.Template, error) {
	switch format {
	case FormatTar, FormatOCI, FormatArchive:
	default:
		return nil, fmt.Errorf("import format %q: want %s, %s or %s: %w", format, FormatTar, FormatOCI, FormatArchive, errdefs.ErrInvalidArgument)
	}
	if body == nil {
		return nil, fmt.Errorf("import: no body: %w", errdefs.ErrInvalidArgument)
	}
	q := url.Values{}
	if format != FormatTar {
		q.Set("format", format)
	}
	for _, t := range tags {
		if t != "" {
			q.Add("tag", t)
		}
	}
	var out api.Template
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/templates", query: q, body: body, contentType: "application/x-tar"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// PullTemplate is POST /v1/templates/pull: import an image from a
// registry.
func (c *Client) PullTemplate(ctx context.Context, req api.PullRequest) (*api.Template, error) {
	if strings.TrimSpace(req.Image) == "" {
		return nil, fmt.Errorf("pull: image is empty: %w", errdefs.ErrInvalidArgument)
	}
	var out api.Template
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/templates/pull", json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// BuildOptions tune a template build.
type BuildOptions struct {
	// File is the build file. For BuildTemplateTar it is a path inside the
	// context (default "Dockerfile"). For BuildTemplate a relative path is
	// relative to the context directory; an absolute path may be outside
	// it, and is then sent along as an extra entry the build does not see
	// as part of the context.
	File    string
	Tags    []string // "name[:tag]" to point at the result
	NoCache bool     // run every step even when the build cache has it
	// Network asks for network access in RUN steps; the server refuses
	// the build if the host cannot give it.
	Network bool
	// AllowOut, DenyOut, AllowPrivate and Internet are the egress policy
	// of RUN steps with network (any of them implies Network); none: every
	// public destination.
	AllowOut     []string
	DenyOut      []string
	AllowPrivate []string
	Internet     bool
}

// maxBuildEvent bounds one line of a build stream (RUN output comes in
// chunks of at most 32 KiB, JSON-escaped).
const maxBuildEvent = 1 << 20

// BuildTemplate builds a template from the build file and the context
// directory contextDir. The context is sent as a tar of its regular files,
// directories and symlinks (kept as symlinks, never followed) with their
// modes, owned by 0:0, minus what contextDir/.dockerignore excludes (see
// dockerignore for the supported syntax); the build file is always sent.
// onEvent, if set, receives every event as it arrives. A failing build
// returns an *APIError whose message names the step, its exit code and the
// tail of its output.
func (c *Client) BuildTemplate(ctx context.Context, contextDir string, o BuildOptions, onEvent func(api.BuildEvent)) (*api.Template, error) {
	if contextDir == "" {
		return nil, fmt.Errorf("build: context directory is empty: %w", errdefs.ErrInvalidArgument)
	}
	file, extra, err := buildFileEntry(contextDir, o.File)
	if err != nil {
		return nil, err
	}
	// Fail on an unreadable context or a bad .dockerignore before any
	// request: a failure inside the pipe would surface as a cut upload.
	ign, err := readDockerignore(contextDir)
	if err != nil {
		return nil, err
	}
	o.File = file
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(writeBuildContext(pw, contextDir, ign, file, extra))
	}()
	t, err := c.BuildTemplateTar(ctx, pr, o, onEvent)
	pr.CloseWithError(err)
	return t, err
}

// BuildTemplateTar is POST /v1/templates/build with a ready tar (plain or
// gzip) of the build context; o.File is a path inside it.
func (c *Client) BuildTemplateTar(ctx context.Context, contextTar io.Reader, o BuildOptions, onEvent func(api.BuildEvent)) (*api.Template, error) {
	if contextTar == nil {
		return nil, fmt.Errorf("build: no context: %w", errdefs.ErrInvalidArgument)
	}
	q := url.Values{}
	if o.File != "" {
		q.Set("file", o.File)
	}
	for _, t := range o.Tags {
		if t != "" {
			q.Add("tag", t)
		}
	}
	if o.NoCache {
		q.Set("no_cache", "true")
	}
	if o.Network {
		q.Set("network", "true")
	}
	for _, a := range o.AllowOut {
		q.Add("allow_out", a)
	}
	for _, d := range o.DenyOut {
		q.Add("deny_out", d)
	}
	for _, p := range o.AllowPrivate {
		q.Add("allow_private", p)
	}
	if o.Internet {
		q.Set("internet", "true")
	}
	resp, err := c.send(ctx, request{method: http.MethodPost, path: "/v1/templates/build", query: q, body: contextTar, contentType: "application/x-tar"})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return readBuildStream(ctx, resp, onEvent)
}

// readBuildStream reads BuildEvent lines until the final one.
func readBuildStream(ctx context.Context, resp *http.Response, onEvent func(api.BuildEvent)) (*api.Template, error) {
	const what = "building template"
	var tmpl *api.Template
	err := readNDJSON(ctx, resp.Body, ndjsonStream{what: what, item: "event", maxLine: maxBuildEvent}, func(ev api.BuildEvent) error {
		if onEvent != nil {
			onEvent(ev)
		}
		switch {
		case ev.Error != nil:
			return &APIError{Status: resp.StatusCode, Code: ev.Error.Code, Message: ev.Error.Message}
		case ev.Template != nil:
			tmpl = ev.Template
			return errStopStream
		}
		return nil
	})
	return buildResult(ctx, what, tmpl, err)
}

// buildResult is the outcome of a build stream: the template once it
// came; else err; else the caller's ended ctx; else a stream cut short,
// ErrUnavailable.
func buildResult(ctx context.Context, what string, tmpl *api.Template, err error) (*api.Template, error) {
	switch {
	case tmpl != nil:
		return tmpl, nil
	case err != nil:
		return nil, err
	case ctx.Err() != nil:
		return nil, fmt.Errorf("%s: %w", what, ctx.Err())
	}
	return nil, fmt.Errorf("%s: stream ended without a result: %w", what, errdefs.ErrUnavailable)
}

// BuildProgress is one progress line of BuildBaseTemplate.
type BuildProgress struct {
	Phase   string `json:"phase"`
	Done    int64  `json:"done"`
	Total   int64  `json:"total"`
	Message string `json:"message,omitempty"`
}

// buildLine is one NDJSON line of POST /v1/templates/base: progress, or the
// final template, or the final error.
type buildLine struct {
	BuildProgress
	Template *api.Template  `json:"template,omitempty"`
	Error    *api.ErrorBody `json:"error,omitempty"`
}

// maxBuildLine bounds one progress line.
const maxBuildLine = 1 << 20

// BuildBaseTemplate is POST /v1/templates/base: it builds base:latest if
// missing, calling progress (if non-nil) for every progress line, and
// returns the template. A build failure reported in the stream comes back as
// an *APIError.
func (c *Client) BuildBaseTemplate(ctx context.Context, progress func(BuildProgress)) (*api.Template, error) {
	resp, err := c.send(ctx, request{method: http.MethodPost, path: "/v1/templates/base"})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	const what = "building base template"
	var tmpl *api.Template
	err = readNDJSON(ctx, resp.Body, ndjsonStream{what: what, item: "progress", maxLine: maxBuildLine}, func(l buildLine) error {
		switch {
		case l.Error != nil:
			return &APIError{Status: resp.StatusCode, Code: l.Error.Code, Message: l.Error.Message}
		case l.Template != nil:
			tmpl = l.Template
			return errStopStream
		case progress != nil:
			progress(l.BuildProgress)
		}
		return nil
	})
	return buildResult(ctx, what, tmpl, err)
}
