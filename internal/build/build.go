// Package build turns a build file (a Dockerfile subset) and a context
// directory into a template: each instruction yields a template derived from
// the previous one, RUN steps execute in a real sandbox of their parent, and
// every step is cached by (parent digest, step, inputs digest).
package build

import (
	"context"
	"io"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/template"
)

// Templates is what a build needs of the template store
// (*template.Store implements it).
type Templates interface {
	Get(ctx context.Context, ref string) (api.Template, error)
	// Derive makes a template from parent: parent's tree changed by
	// o.Apply (none: the same tree), with o.Config as its defaults.
	Derive(ctx context.Context, parent string, o template.DeriveOptions) (api.Template, error)
	// CacheGet returns the template a step with this key produced, if it
	// is still stored.
	CacheGet(ctx context.Context, key string) (digest string, ok bool, err error)
	CachePut(ctx context.Context, key, digest string) error
	Tag(ctx context.Context, ref, tag string) error
}

var _ Templates = (*template.Store)(nil)

// Step is one RUN instruction to execute.
type Step struct {
	Template string   // digest of the template to run in
	Cmd      []string // argv
	Env      map[string]string
	Workdir  string
	User     string
	Network  bool // the build asked for network access
	// Policy is the egress policy of a step with Network; nil: every
	// public destination (internet).
	Policy *api.NetworkPolicy
	Output io.Writer // stdout and stderr as they come, interleaved
	// Apply is called, only when Cmd exited 0, with the stopped sandbox's
	// filesystem changes, before the sandbox is removed.
	Apply func(ctx context.Context, upper template.Upper) error
}

// Runner runs build steps in sandboxes. The sandbox manager implements it.
type Runner interface {
	// RunStep runs s.Cmd in a fresh sandbox of s.Template and removes the
	// sandbox afterwards, whatever happens. A non-zero exit is not an
	// error: it is returned as the exit code (Apply is then not called).
	RunStep(ctx context.Context, s Step) (exitCode int, err error)
}
