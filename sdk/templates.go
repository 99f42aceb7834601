package sdk

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"

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

// GetTemplate is GET /v1/templates/{ref}; ref is "name:tag" or "sha256:…".
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

// DeleteTemplate is DELETE /v1/templates/{tag}.
func (c *Client) DeleteTemplate(ctx context.Context, tag string) error {
	if err := checkID("template", tag); err != nil {
		return err
	}
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/templates/" + seg(tag)}, nil)
}

// ImportTemplate is POST /v1/templates?tag=name:tag with a tar (optionally
// gzip-compressed) root filesystem as the body. tag may be empty.
func (c *Client) ImportTemplate(ctx context.Context, tag string, tarball io.Reader) (*api.Template, error) {
	q := url.Values{}
	if tag != "" {
		q.Set("tag", tag)
	}
	var out api.Template
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/templates", query: q, body: tarball, contentType: "application/x-tar"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
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
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), maxBuildLine)
	for sc.Scan() {
		if len(sc.Bytes()) == 0 {
			continue
		}
		var l buildLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return nil, fmt.Errorf("building base template: bad progress line: %w", err)
		}
		switch {
		case l.Error != nil:
			return nil, &APIError{Status: resp.StatusCode, Code: l.Error.Code, Message: l.Error.Message}
		case l.Template != nil:
			return l.Template, nil
		case progress != nil:
			progress(l.BuildProgress)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("building base template: reading progress: %w", err)
	}
	return nil, fmt.Errorf("building base template: stream ended without a result: %w", errdefs.ErrUnavailable)
}
