package build

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/template"
)

// Options describe one build.
type Options struct {
	File       *File  // from Parse
	ContextDir string // host directory COPY and ADD read from ("" if none)
	Tags       []string
	Templates  Templates
	Runner     Runner // needed only when the file has RUN steps
	// MaxBytes bounds what one step may add (content plus 512 bytes per
	// entry); 0 = no limit.
	MaxBytes int64
	// NoCache builds every step even if the cache has it (the results
	// still go into the cache).
	NoCache bool
	// Network is what "RUN" and "RUN --network=default" get: whether the
	// client asked for network access for the whole build and the host
	// allows it. "--network=none" never has network; "--network=host"
	// asks for it and is refused unless Network is set.
	Network bool
	// NetworkPolicy is the egress policy of steps with network; nil:
	// every public destination. Part of those steps' cache key.
	NetworkPolicy *api.NetworkPolicy
	// Events receives progress: a "running" event per step, then "cached",
	// "done" or "failed"; RUN output in between as Output chunks of at
	// most OutputChunk bytes (Output alone set; it belongs to the step
	// last reported running, never splits a UTF-8 sequence). Events is
	// never called concurrently. Build does not send the final result
	// event: its return value is that.
	Events func(api.BuildEvent)
}

const (
	// OutputChunk is the largest Output of one event.
	OutputChunk = 32 << 10
	// tailBytes of a failed RUN's output go into its error.
	tailBytes = 4 << 10
	// createdByMax bounds a layer's CreatedBy.
	createdByMax = 200
)

// StepError is a RUN step that exited non-zero.
type StepError struct {
	Step, Steps int
	Line        int
	Instruction string // shortened
	ExitCode    int
	Tail        string // the last output (at most 4 KiB)
}

func (e *StepError) Error() string {
	msg := fmt.Sprintf("step %d/%d (line %d) %s: exit code %d", e.Step, e.Steps, e.Line, e.Instruction, e.ExitCode)
	if e.Tail != "" {
		msg += ": " + e.Tail
	}
	return msg
}

// Unwrap makes a failing step errdefs.ErrUnprocessable (the build file is
// fine; what it runs fails).
func (e *StepError) Unwrap() error { return errdefs.ErrUnprocessable }

// builder is one build in progress.
type builder struct {
	o      Options
	steps  int
	parent string             // digest of the previous step's template
	cfg    api.TemplateConfig // defaults accumulated so far
	bctx   *buildContext
	hits   map[string]bool // digests this build took from the cache
}

// holder is implemented by stores that can pin a template against garbage
// collection (*template.Store).
type holder interface {
	Hold(digest string) (release func())
}

var _ holder = (*template.Store)(nil)

// Build runs o.File and returns the resulting template, tagged with
// o.Tags. Step i (1-based; FROM is step 1) produces a template derived from
// step i-1's; each is cached under a key of (parent digest, the step with
// its arguments expanded and the defaults so far, and for COPY/ADD a digest
// of the files read), so an unchanged step whose parent is unchanged is not
// run again. A failing step leaves the completed steps' templates (and
// their cache entries) and nothing else.
func Build(ctx context.Context, o Options) (api.Template, error) {
	if o.File == nil || len(o.File.Instructions) == 0 || o.File.Instructions[0].Cmd != "FROM" {
		return api.Template{}, fmt.Errorf("build file must start with FROM: %w", errdefs.ErrInvalidArgument)
	}
	if o.Templates == nil {
		return api.Template{}, errors.New("build: no template store")
	}
	for _, t := range o.Tags {
		if _, err := template.ParseTag(t); err != nil {
			return api.Template{}, err
		}
	}
	b := &builder{o: o, steps: len(o.File.Instructions), hits: map[string]bool{}}
	defer b.bctx.close()
	if err := b.check(); err != nil {
		return api.Template{}, err
	}
	for i, in := range o.File.Instructions {
		n := i + 1
		b.emit(api.BuildEvent{Step: n, Steps: b.steps, Line: in.Line, Instr: shorten(in.Text, createdByMax), Status: "running"})
		start := time.Now()
		digest, cached, err := b.step(ctx, n, &in)
		elapsed := float64(time.Since(start).Microseconds()) / 1000
		if err != nil {
			ev := api.BuildEvent{Step: n, Steps: b.steps, Line: in.Line, Instr: shorten(in.Text, createdByMax), Status: "failed", ElapsedMS: elapsed}
			var se *StepError
			if errors.As(err, &se) {
				ev.ExitCode = &se.ExitCode
			} else {
				err = fmt.Errorf("step %d/%d (line %d) %s: %w", n, b.steps, in.Line, shorten(in.Text, 80), err)
			}
			b.emit(ev)
			return api.Template{}, err
		}
		status := "done"
		if cached {
			status = "cached"
			b.hits[digest] = true
		}
		b.emit(api.BuildEvent{Step: n, Steps: b.steps, Line: in.Line, Instr: shorten(in.Text, createdByMax), Status: status, Digest: digest, ElapsedMS: elapsed})
		b.parent = digest
		// Untagged and unused until the build ends: keep it (and with it
		// its ancestors) out of a concurrent garbage collection.
		if h, ok := o.Templates.(holder); ok {
			defer h.Hold(digest)()
		}
	}
	for _, tag := range o.Tags {
		if err := o.Templates.Tag(ctx, b.parent, tag); err != nil {
			return api.Template{}, fmt.Errorf("tag %s: %w", tag, err)
		}
	}
	t, err := o.Templates.Get(ctx, b.parent)
	if err != nil {
		return api.Template{}, err
	}
	// The record keeps the layers of the build that first made each
	// template; report this build's cache hits.
	for i := range t.Layers {
		if b.hits[t.Layers[i].Digest] {
			t.Layers[i].Cached = true
		}
	}
	return t, nil
}

// check finds errors that need no work to find, before any step runs.
func (b *builder) check() error {
	for _, in := range b.o.File.Instructions {
		if in.Cmd != "RUN" {
			continue
		}
		if b.o.Runner == nil {
			return fmt.Errorf("line %d: RUN needs a sandbox runner, and this build has none: %w", in.Line, errdefs.ErrNotSupported)
		}
		if in.Flags["network"] == "host" && !b.o.Network {
			return fmt.Errorf("line %d: RUN --network=host asks for network access, which this build was not given: %w", in.Line, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func (b *builder) emit(ev api.BuildEvent) {
	if b.o.Events != nil {
		b.o.Events(ev)
	}
}

// plan is one step, ready to be looked up in the cache and run.
type plan struct {
	key stepKey
	cfg api.TemplateConfig                                                       // defaults after the step
	run func(ctx context.Context, layer api.TemplateLayer) (api.Template, error) // nil: defaults only
}

// stepKey is the canonical description of a step that its cache key
// hashes. Changing its form needs a new version string.
type stepKey struct {
	Version string             `json:"v"`
	Parent  string             `json:"parent"`
	Cmd     string             `json:"cmd"`
	Args    []string           `json:"args"`
	Flags   map[string]string  `json:"flags,omitempty"`
	Config  api.TemplateConfig `json:"config"`
	Inputs  string             `json:"inputs,omitempty"`
}

func (k stepKey) hash() string {
	k.Version = "space-build-step-v1"
	b, err := json.Marshal(k)
	if err != nil {
		panic(err) // strings, maps and slices only
	}
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// step runs instruction n and returns the template it produced.
func (b *builder) step(ctx context.Context, n int, in *Instruction) (digest string, cached bool, err error) {
	if err := ctx.Err(); err != nil {
		return "", false, err
	}
	if in.Cmd == "FROM" {
		t, err := b.o.Templates.Get(ctx, in.Args[0])
		if err != nil {
			return "", false, fmt.Errorf("base template %q: %w", in.Args[0], err)
		}
		b.cfg = cloneConfig(t.Config)
		return t.Digest, false, nil
	}
	p, err := b.plan(ctx, n, in)
	if err != nil {
		return "", false, err
	}
	p.key.Parent, p.key.Cmd, p.key.Config = b.parent, in.Cmd, p.cfg
	key := p.key.hash()
	if !b.o.NoCache {
		d, ok, err := b.o.Templates.CacheGet(ctx, key)
		if err != nil {
			return "", false, err
		}
		if ok {
			b.cfg = p.cfg
			return d, true, nil
		}
	}
	layer := api.TemplateLayer{CreatedBy: shorten(in.Text, createdByMax)}
	var t api.Template
	if p.run == nil {
		t, err = b.o.Templates.Derive(ctx, b.parent, template.DeriveOptions{Config: p.cfg, Layer: layer, MaxBytes: b.o.MaxBytes})
	} else {
		t, err = p.run(ctx, layer)
	}
	if err != nil {
		return "", false, err
	}
	if err := b.o.Templates.CachePut(ctx, key, t.Digest); err != nil {
		return "", false, err
	}
	b.cfg = p.cfg
	return t.Digest, false, nil
}

func (b *builder) lookup() lookupFunc { return mapLookup(b.cfg.Env) }

// plan works out what instruction in does, without doing it.
func (b *builder) plan(ctx context.Context, n int, in *Instruction) (*plan, error) {
	p := &plan{cfg: cloneConfig(b.cfg)}
	switch in.Cmd {
	case "NETWORK":
		pol, err := in.NetworkPolicy()
		if err != nil {
			return nil, invalidf("NETWORK: %v", err)
		}
		p.cfg.Network = &pol
		pj, _ := json.Marshal(pol)
		p.key.Args = []string{string(pj)}
	case "ENV":
		pairs, err := parseEnv(in.Raw, b.lookup())
		if err != nil {
			return nil, invalidf("%v", err)
		}
		if p.cfg.Env == nil {
			p.cfg.Env = map[string]string{}
		}
		for _, kv := range pairs {
			p.cfg.Env[kv[0]] = kv[1]
			p.key.Args = append(p.key.Args, kv[0]+"="+kv[1])
		}
	case "USER":
		u, err := expandWord(in.Raw, b.lookup())
		if err != nil {
			return nil, invalidf("USER: %v", err)
		}
		if u == "" || strings.ContainsAny(u, " \t") {
			return nil, invalidf("USER %q: want one user[:group]", u)
		}
		p.cfg.User = u
		p.key.Args = []string{u}
	case "CMD", "START":
		if p.cfg.Start == nil {
			p.cfg.Start = &api.StartCommand{}
		}
		p.cfg.Start.Cmd = slices.Clone(in.Args)
		p.key.Args = in.Args
	case "READY":
		d, err := readyTimings(in.Flags)
		if err != nil {
			return nil, invalidf("%v", err)
		}
		if p.cfg.Start == nil {
			return nil, invalidf("READY checks the start command, and there is none yet: put START (or CMD) before READY")
		}
		p.cfg.Start.Ready = slices.Clone(in.Args)
		p.cfg.Start.ReadyTimeoutSeconds = d.timeout.Seconds()
		p.cfg.Start.ReadyIntervalMS = d.interval.Milliseconds()
		p.key.Args = in.Args
	case "WORKDIR":
		dir, err := expandWord(in.Raw, b.lookup())
		if err != nil {
			return nil, invalidf("WORKDIR: %v", err)
		}
		if dir == "" {
			return nil, invalidf("WORKDIR %q expands to nothing", in.Raw)
		}
		p.cfg.Workdir = path.Join(b.workdir(), dir)
		if path.IsAbs(dir) {
			p.cfg.Workdir = path.Clean(dir)
		}
		p.key.Args = []string{p.cfg.Workdir}
		p.run = b.derive(p, func(ctx context.Context, t *template.Tree) error {
			return t.Mkdir(p.cfg.Workdir)
		})
	case "COPY", "ADD":
		if err := b.planCopy(ctx, p, in); err != nil {
			return nil, err
		}
	case "RUN":
		b.planRun(p, n, in)
	default:
		return nil, invalidf("%s cannot be built", in.Cmd)
	}
	if err := template.ValidateConfig(p.cfg); err != nil {
		return nil, err
	}
	return p, nil
}

func (b *builder) workdir() string {
	if b.cfg.Workdir == "" {
		return "/"
	}
	return b.cfg.Workdir
}

// derive returns a run function deriving the step's template with apply.
func (b *builder) derive(p *plan, apply func(context.Context, *template.Tree) error) func(context.Context, api.TemplateLayer) (api.Template, error) {
	return func(ctx context.Context, layer api.TemplateLayer) (api.Template, error) {
		return b.o.Templates.Derive(ctx, b.parent, template.DeriveOptions{
			Config: p.cfg, Layer: layer, MaxBytes: b.o.MaxBytes, Apply: apply,
		})
	}
}

func (b *builder) planCopy(ctx context.Context, p *plan, in *Instruction) error {
	all, err := copyWords(in, b.lookup())
	if err != nil {
		return invalidf("%v", err)
	}
	// A variable that expands to nothing is no argument, as in sh.
	words := slices.DeleteFunc(all, func(w string) bool { return w == "" })
	if len(words) < 2 {
		return invalidf("%s needs at least one source and a destination (after expanding variables: %q)", in.Cmd, words)
	}
	var owner *[2]int
	if v, ok := in.Flags["chown"]; ok {
		v, err := expandWord(v, b.lookup())
		if err != nil {
			return invalidf("--chown: %v", err)
		}
		o, err := parseChown(v)
		if err != nil {
			return invalidf("%v", err)
		}
		owner = &o
		p.key.Flags = map[string]string{"chown": fmt.Sprintf("%d:%d", o[0], o[1])}
	}
	rawDest := words[len(words)-1]
	dest := rawDest
	if !path.IsAbs(dest) {
		dest = path.Join(b.workdir(), dest)
	}
	dest = path.Clean(dest)
	destIsDir := strings.HasSuffix(rawDest, "/") || rawDest == "." || strings.HasSuffix(rawDest, "/.")
	if b.bctx == nil {
		if b.bctx, err = openContext(b.o.ContextDir); err != nil {
			return err
		}
	}
	var srcs []source
	for _, w := range words[:len(words)-1] {
		if in.Cmd == "ADD" && isURL(w) {
			return invalidf("ADD %s: a URL source needs the network, and builds have none outside RUN; download it in a RUN step", w)
		}
		s, err := b.bctx.resolve(w)
		if err != nil {
			return err
		}
		srcs = append(srcs, s...)
	}
	if len(srcs) > 1 && !destIsDir {
		return invalidf("%s of %d sources needs a destination directory ending in /, not %q", in.Cmd, len(srcs), rawDest)
	}
	if in.Cmd == "ADD" {
		for _, s := range srcs {
			if s.dir {
				continue
			}
			kind, err := archiveKind(s.path)
			if err != nil {
				return fmt.Errorf("read source %q: %w", s.name, err)
			}
			if kind != "" {
				return invalidf("ADD %s: it is a %s, which Docker would extract; extracting archives is not supported: COPY it and extract it in a RUN step (or COPY it to keep it as is)", s.name, kind)
			}
		}
	}
	inputs, err := digestSources(ctx, srcs)
	if err != nil {
		return err
	}
	p.key.Args = append(append([]string{}, words[:len(words)-1]...), dest)
	if destIsDir {
		p.key.Args[len(p.key.Args)-1] += "/"
	}
	p.key.Inputs = inputs
	// A directory destination is made first (0755 root when missing,
	// kept as it is otherwise), so that it exists even when only empty
	// directories are copied into it, as in Docker.
	needDir := destIsDir || srcs[0].dir
	p.run = b.derive(p, func(ctx context.Context, t *template.Tree) error {
		if needDir {
			if err := t.Mkdir(dest); err != nil {
				return err
			}
		}
		o := template.CopyOptions{Owner: owner}
		for _, s := range srcs {
			if !s.dir {
				to := dest
				if destIsDir {
					to = path.Join(dest, path.Base("/"+s.name))
				}
				if err := t.CopyIn(ctx, s.path, to, o); err != nil {
					return fmt.Errorf("copy %q to %s: %w", s.name, to, err)
				}
				continue
			}
			// A directory's contents go into dest; dest itself keeps its
			// metadata when it exists (CopyIn of the directory would reset it).
			entries, err := os.ReadDir(s.path)
			if err != nil {
				return fmt.Errorf("read source %q: %w", s.name, err)
			}
			for _, e := range entries {
				to := path.Join(dest, e.Name())
				if err := t.CopyIn(ctx, filepath.Join(s.path, e.Name()), to, o); err != nil {
					return fmt.Errorf("copy %q to %s: %w", path.Join(s.name, e.Name()), to, err)
				}
			}
		}
		return nil
	})
	return nil
}

func (b *builder) planRun(p *plan, n int, in *Instruction) {
	network := b.o.Network
	switch in.Flags["network"] {
	case "none":
		network = false
	case "host":
		network = true // check refused it unless b.o.Network
	}
	p.key.Args = in.Args
	p.key.Flags = map[string]string{"network": strconv.FormatBool(network)}
	var policy *api.NetworkPolicy
	if network && b.o.NetworkPolicy != nil {
		policy = b.o.NetworkPolicy
		pj, _ := json.Marshal(policy)
		p.key.Flags["network_policy"] = string(pj)
	}
	p.run = func(ctx context.Context, layer api.TemplateLayer) (api.Template, error) {
		out := &outputWriter{emit: b.emit}
		var (
			result  api.Template
			applied bool
		)
		workdir := p.cfg.Workdir
		if workdir == "" {
			workdir = "/"
		}
		code, err := b.o.Runner.RunStep(ctx, Step{
			Template: b.parent,
			Cmd:      slices.Clone(in.Args),
			Env:      maps.Clone(p.cfg.Env),
			Workdir:  workdir,
			Policy:   policy,
			User:     p.cfg.User,
			Network:  network,
			Output:   out,
			Apply: func(ctx context.Context, upper template.Upper) error {
				t, err := b.o.Templates.Derive(ctx, b.parent, template.DeriveOptions{
					Config: p.cfg, Layer: layer, MaxBytes: b.o.MaxBytes,
					Apply: func(ctx context.Context, tree *template.Tree) error {
						return tree.ApplyUpperDir(ctx, upper)
					},
				})
				if err != nil {
					return err
				}
				result, applied = t, true
				return nil
			},
		})
		out.flush()
		if err != nil {
			return api.Template{}, err
		}
		if code != 0 {
			return api.Template{}, &StepError{
				Step: n, Steps: b.steps, Line: in.Line, Instruction: shorten(in.Text, 80),
				ExitCode: code, Tail: out.tail(),
			}
		}
		if !applied {
			return api.Template{}, errors.New("the runner reported success but did not hand over the step's changes")
		}
		return result, nil
	}
}

// outputWriter turns RUN output into Output events of at most OutputChunk
// bytes that never split a UTF-8 sequence, and keeps the last tailBytes.
type outputWriter struct {
	mu      sync.Mutex
	emit    func(api.BuildEvent)
	partial []byte // an incomplete UTF-8 sequence held for the next write
	last    []byte // ring of the last output
}

func (w *outputWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := len(p)
	w.last = append(w.last, p...)
	if len(w.last) > 2*tailBytes {
		w.last = append(w.last[:0], w.last[len(w.last)-tailBytes:]...)
	}
	data := append(w.partial, p...)
	w.partial = nil
	// Hold back a trailing incomplete sequence (at most 3 bytes).
	if cut := incompleteTail(data); cut > 0 {
		w.partial = append([]byte(nil), data[len(data)-cut:]...)
		data = data[:len(data)-cut]
	}
	for len(data) > 0 {
		end := min(len(data), OutputChunk)
		for end < len(data) && end > 0 && !utf8.RuneStart(data[end]) {
			end--
		}
		if end == 0 {
			end = min(len(data), OutputChunk)
		}
		w.emit(api.BuildEvent{Output: string(data[:end])})
		data = data[end:]
	}
	return n, nil
}

func (w *outputWriter) flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.partial) > 0 {
		w.emit(api.BuildEvent{Output: string(w.partial)})
		w.partial = nil
	}
}

// tail returns the last output, starting at a rune boundary.
func (w *outputWriter) tail() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	t := w.last
	if len(t) > tailBytes {
		t = t[len(t)-tailBytes:]
	}
	for i := 0; i < 3 && len(t) > 0 && !utf8.RuneStart(t[0]); i++ {
		t = t[1:]
	}
	return strings.TrimRight(string(t), "\n")
}

// incompleteTail returns how many bytes at the end of b are the start of a
// UTF-8 sequence that is not complete yet.
func incompleteTail(b []byte) int {
	for i := 1; i <= 3 && i <= len(b); i++ {
		c := b[len(b)-i]
		if !utf8.RuneStart(c) {
			continue
		}
		if c < 0x80 {
			return 0
		}
		need := 2
		switch {
		case c >= 0xf0:
			need = 4
		case c >= 0xe0:
			need = 3
		}
		if i < need {
			return i
		}
		return 0
	}
	return 0
}

// shorten returns s cut to at most max bytes at a rune boundary, with an
// ellipsis when cut.
func shorten(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

func cloneConfig(c api.TemplateConfig) api.TemplateConfig {
	out := c
	out.Env = maps.Clone(c.Env)
	if c.Start != nil {
		s := *c.Start
		s.Cmd = slices.Clone(c.Start.Cmd)
		s.Ready = slices.Clone(c.Start.Ready)
		out.Start = &s
	}
	if c.Network != nil {
		n := *c.Network
		n.AllowOut = slices.Clone(c.Network.AllowOut)
		n.DenyOut = slices.Clone(c.Network.DenyOut)
		n.AllowPrivate = slices.Clone(c.Network.AllowPrivate)
		n.Rules = slices.Clone(c.Network.Rules)
		out.Network = &n
	}
	return out
}
