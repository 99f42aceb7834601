package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"golang.org/x/term"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

func newTemplateCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "template", Aliases: []string{"templates", "tpl"}, Short: "Manage templates: build, pull, import, tag, export, gc"}
	cmd.AddCommand(
		newTemplateLsCmd(a), newTemplateInspectCmd(a), newTemplateRmCmd(a), newTemplateTagCmd(a),
		newTemplateGCCmd(a), newTemplateExportCmd(a), newTemplateImportCmd(a), newTemplatePullCmd(a),
		newTemplateBuildCmd(a), newTemplateBuildBaseCmd(a),
	)
	return cmd
}

func newTemplateLsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List templates (one row per tag)",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			list, err := c.ListTemplates(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, api.TemplateList{Templates: nonNil(list)})
			}
			return printTemplates(a, list, time.Now())
		},
	}
}

func newTemplateInspectCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect REF",
		Short: "Show a template as JSON: size, config, layers or build steps, parent, the sandboxes using it",
		Long:  "REF is name:tag, sha256:… or a unique digest prefix of at least 12 hex digits.",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := c.GetTemplate(a.ctx, args[0])
			if err != nil {
				return err
			}
			return printJSON(a.out, t)
		},
	}
}

func newTemplateRmCmd(a *app) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "rm [--force] REF...",
		Short: "Remove tags, or forget templates by digest",
		Long: "A tag (name:tag) is only untagged: the content stays while sandboxes, other tags or derived\n" +
			"templates use it, and `space template gc` frees it. A digest forgets the template; refused while\n" +
			"it is tagged (unless --force, which drops its tags), used by a sandbox, or the parent of another.",
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			failed := 0
			for _, ref := range args {
				if err := c.RemoveTemplate(a.ctx, ref, force); err != nil {
					fmt.Fprintf(a.errOut, "space: %s: %v\n", ref, err)
					failed++
					continue
				}
				if !a.json {
					fmt.Fprintln(a.out, ref)
				}
			}
			if failed > 0 {
				return &exitCodeError{code: ExitError}
			}
			return nil
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "with a digest, drop the template's tags as well")
	return cmd
}

func newTemplateTagCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "tag REF TAG",
		Short: "Point TAG (name[:tag]) at the template REF, moving it if it exists",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !validTag(args[1]) {
				return usagef("tag %q: want name[:tag] (name: lowercase letters, digits, . _ -)", args[1])
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := c.TagTemplate(a.ctx, args[0], args[1])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, t)
			}
			return nil
		},
	}
}

func newTemplateGCCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "gc",
		Short: "Remove templates and stored trees nothing needs (untagged, unused by any sandbox)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			res, err := c.GCTemplates(a.ctx)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, res)
			}
			fmt.Fprintf(a.out, "removed %d %s, %d %s, freed %.1f MiB\n", len(res.Removed), plural(len(res.Removed), "template"),
				res.Trees, plural(res.Trees, "tree"), float64(res.BytesFreed)/(1<<20))
			return nil
		},
	}
}

func plural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}

func newTemplateExportCmd(a *app) *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use:   "export REF [-o FILE]",
		Short: "Write a template to one archive (import it anywhere with --format archive; same digest)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if out == "" || out == "-" {
				if f, ok := a.out.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
					return usagef("refusing to write an archive to a terminal; use -o FILE or redirect stdout")
				}
				return c.ExportTemplate(a.ctx, args[0], a.out)
			}
			return writeFileAtomic(out, func(w io.Writer) error { return c.ExportTemplate(a.ctx, args[0], w) })
		},
	}
	cmd.Flags().StringVarP(&out, "output", "o", "", "archive file to write (default stdout)")
	return cmd
}

// writeFileAtomic writes path through a temp file beside it, renamed into
// place only when write succeeded: a failed export leaves no half archive
// under the name the user asked for.
func writeFileAtomic(path string, write func(io.Writer) error) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	err = write(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp, 0o644)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// Import formats of `template import`; all but dir are sdk formats.
const formatDir = "dir"

func newTemplateImportCmd(a *app) *cobra.Command {
	var (
		format string
		tags   []string
	)
	cmd := &cobra.Command{
		Use:   "import [--format tar|oci|archive|dir] [-t name:tag]... PATH",
		Short: "Import a template from a directory, a root filesystem tar, an OCI image or a template archive",
		Long: "Formats: dir (a root filesystem directory, sent as a tar with owners kept), tar (a plain or gzip\n" +
			"tar of a root filesystem), oci (a `docker save` archive or an OCI image layout, as a tar or a\n" +
			"directory), archive (written by `space template export`). Without --format: dir for a directory,\n" +
			"archive for a file that starts like one, tar otherwise.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			switch format {
			case "", formatDir, sdk.FormatTar, sdk.FormatOCI, sdk.FormatArchive:
			default:
				return usagef("--format %q: want tar, oci, archive or dir", format)
			}
			for _, t := range tags {
				if !validTag(t) {
					return usagef("--tag %q: want name:tag or name (name: lowercase letters, digits, . _ -)", t)
				}
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := a.importTemplate(c, format, tags, args[0])
			if err != nil {
				return err
			}
			return a.printTemplate(t)
		},
	}
	cmd.Flags().StringVar(&format, "format", "", "tar, oci, archive or dir (default: from PATH)")
	cmd.Flags().StringArrayVarP(&tags, "tag", "t", nil, "tag the template as name[:tag] (repeatable)")
	return cmd
}

func newTemplatePullCmd(a *app) *cobra.Command {
	var (
		insecure bool
		tags     []string
	)
	cmd := &cobra.Command{
		Use:   "pull [--insecure] [-t name:tag]... IMAGE",
		Short: "Import an image from a registry (e.g. 127.0.0.1:5000/app:1.2)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, t := range tags {
				if !validTag(t) {
					return usagef("--tag %q: want name:tag or name (name: lowercase letters, digits, . _ -)", t)
				}
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := c.PullTemplate(a.ctx, api.PullRequest{Image: args[0], Tags: tags, Insecure: insecure})
			if err != nil {
				return err
			}
			return a.printTemplate(t)
		},
	}
	cmd.Flags().BoolVar(&insecure, "insecure", false, "allow a plain-HTTP registry (loopback always is)")
	cmd.Flags().StringArrayVarP(&tags, "tag", "t", nil, "tag the template as name[:tag] (repeatable)")
	return cmd
}

func newTemplateBuildCmd(a *app) *cobra.Command {
	var (
		file              string
		tags              []string
		noCache           bool
		network           bool
		allowOut, denyOut []string
		allowPrivate      []string
		internet          bool
	)
	cmd := &cobra.Command{
		Use:   "build [-f FILE] [-t name:tag]... [--no-cache] [CONTEXT]",
		Short: "Build a template from a build file (a Dockerfile subset) and a context directory",
		Long: "CONTEXT (default .) is sent to the server as a tar, leaving out what its .dockerignore excludes\n" +
			"(patterns per line, * ? [..] within a path component, ** across components, ! to re-include,\n" +
			"# comments). FILE (default CONTEXT/Dockerfile) is relative to the current directory and may lie\n" +
			"outside the context. Each step prints one line when it ends; RUN output streams indented.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir := "."
			if len(args) == 1 {
				dir = args[0]
			}
			for _, t := range tags {
				if !validTag(t) {
					return usagef("--tag %q: want name:tag or name (name: lowercase letters, digits, . _ -)", t)
				}
			}
			if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
				return usagef("build context %q is not a directory", dir)
			}
			bf := filepath.Join(dir, "Dockerfile")
			if file != "" {
				bf = file
			}
			bf, err := filepath.Abs(bf)
			if err != nil {
				return err
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			w := a.out
			if a.json {
				w = a.errOut // stdout stays one JSON document
			}
			p := &buildPrinter{w: w}
			t, err := c.BuildTemplate(a.ctx, dir, sdk.BuildOptions{File: bf, Tags: tags, NoCache: noCache, Network: network,
				AllowOut: allowOut, DenyOut: denyOut, AllowPrivate: allowPrivate, Internet: internet}, p.event)
			p.endOutput()
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, t)
			}
			tag := ""
			if len(t.Tags) > 0 {
				tag = " (" + strings.Join(t.Tags, ", ") + ")"
			}
			fmt.Fprintf(a.out, "built %s%s\n", t.Digest, tag)
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "build file (default CONTEXT/Dockerfile)")
	cmd.Flags().StringArrayVarP(&tags, "tag", "t", nil, "tag the result as name[:tag] (repeatable)")
	cmd.Flags().BoolVar(&noCache, "no-cache", false, "run every step even when the build cache has it")
	cmd.Flags().BoolVar(&network, "network", false, "give RUN steps network access: every public destination unless --allow-out narrows it (refused if the host cannot)")
	cmd.Flags().StringArrayVar(&allowOut, "allow-out", nil, "egress of RUN steps with network: domain, *.suffix, IP or CIDR, optionally :port (repeatable; implies --network)")
	cmd.Flags().StringArrayVar(&denyOut, "deny-out", nil, "IP or CIDR RUN steps may never reach (repeatable)")
	cmd.Flags().StringArrayVar(&allowPrivate, "allow-private", nil, "loopback/private IP or CIDR the --allow-out names of RUN steps may lead into, within the server's --egress-allow-private (repeatable)")
	cmd.Flags().BoolVar(&internet, "internet", false, "RUN steps with network may reach every public destination (implies --network)")
	return cmd
}

// buildPrinter renders build events as plain lines, readable on a terminal
// and in a log alike: each step ends with one line
//
//	Step 2/5 : RUN make  (done 1.2s)
//
// and a step with output first prints its header, then the output indented.
type buildPrinter struct {
	w       io.Writer
	pending string // header of the running step
	shown   bool   // the running step's header is printed
	midLine bool   // output stopped in the middle of a line
}

const buildIndent = "    "

func (p *buildPrinter) event(ev api.BuildEvent) {
	head := fmt.Sprintf("Step %d/%d : %s", ev.Step, ev.Steps, sanitizeLine(ev.Instr))
	switch {
	case ev.Output != "":
		// Output belongs to the step last reported running.
		if !p.shown {
			fmt.Fprintln(p.w, p.pending)
			p.shown = true
		}
		p.output(ev.Output)
	case ev.Status == "running":
		p.endOutput()
		p.pending, p.shown = head, false
	case ev.Status == "cached":
		p.endOutput()
		fmt.Fprintf(p.w, "%s  (cached)\n", head)
	case ev.Status == "done" || ev.Status == "failed":
		p.endOutput()
		status := ev.Status
		if ev.ExitCode != nil {
			status += fmt.Sprintf(", exit code %d", *ev.ExitCode)
		}
		fmt.Fprintf(p.w, "%s  (%s %s)\n", head, status, fmtElapsed(ev.ElapsedMS))
	}
}

// output writes RUN output indented, without the control characters a
// hostile step could use to rewrite the user's terminal.
func (p *buildPrinter) output(s string) {
	var b strings.Builder
	for _, r := range s {
		if !p.midLine {
			b.WriteString(buildIndent)
			p.midLine = true
		}
		switch {
		case r == '\n':
			b.WriteRune(r)
			p.midLine = false
		case r == '\t' || r >= 0x20 && r != 0x7f && !(r >= 0x80 && r < 0xa0):
			b.WriteRune(r)
		}
	}
	io.WriteString(p.w, b.String())
}

// endOutput finishes a partial output line.
func (p *buildPrinter) endOutput() {
	if p.midLine {
		fmt.Fprintln(p.w)
		p.midLine = false
	}
}

func fmtElapsed(ms float64) string {
	if ms < 1000 {
		return fmt.Sprintf("%.0fms", ms)
	}
	return fmt.Sprintf("%.1fs", ms/1000)
}

// sanitizeLine drops control characters from server-provided text shown on
// one line.
func sanitizeLine(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return ' '
		}
		return r
	}, s)
}

func newTemplateBuildBaseCmd(a *app) *cobra.Command {
	var (
		local    bool
		cacheDir string
	)
	build := &cobra.Command{
		Use:   "build-base",
		Short: "Build the Debian base template base:latest if it is missing",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if local {
				return a.buildBaseLocal(cacheDir) // host.go: no server involved
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := a.buildBase(func(progress func(sdk.BuildProgress)) (*api.Template, error) {
				return c.BuildBaseTemplate(a.ctx, progress)
			})
			if err != nil {
				return err
			}
			return a.printTemplate(t)
		},
	}
	build.Flags().BoolVar(&local, "local", false, "build only the cached base root filesystem, without a server")
	build.Flags().StringVar(&cacheDir, "cache", defaultCacheDir(), "cache directory for --local (env SPACE_CACHE)")
	return build
}

// validTag checks "name[:tag]" the way users can type it; the server has
// the final word.
func validTag(s string) bool {
	name, tag, hasTag := strings.Cut(s, ":")
	if name == "" || len(name) > 128 || name == "sha256" {
		return false
	}
	for i, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || i > 0 && (r == '.' || r == '_' || r == '-')) {
			return false
		}
	}
	if !hasTag {
		return true
	}
	if tag == "" || len(tag) > 128 {
		return false
	}
	for _, r := range tag {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// importTemplate sends src in format ("" = decide from src).
func (a *app) importTemplate(c *sdk.Client, format string, tags []string, src string) (*api.Template, error) {
	fi, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	if fi.IsDir() {
		switch format {
		case "", formatDir:
			// A root filesystem's ownership is part of it: keep owners.
			return a.importDirAs(c, sdk.FormatTar, tags, src, true)
		case sdk.FormatOCI:
			// An OCI image layout directory; its files' owners mean nothing.
			return a.importDirAs(c, sdk.FormatOCI, tags, src, false)
		}
		return nil, usagef("%s is a directory; --format %s needs a file", src, format)
	}
	if format == formatDir {
		return nil, usagef("%s is not a directory", src)
	}
	f, err := os.Open(src)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	br := bufio.NewReaderSize(f, 64<<10)
	if format == "" {
		format = sdk.FormatTar
		if isTemplateArchive(br) {
			format = sdk.FormatArchive
		}
	}
	return c.ImportTemplateFormat(a.ctx, format, br, tags...)
}

func (a *app) importDirAs(c *sdk.Client, format string, tags []string, dir string, keepOwner bool) (*api.Template, error) {
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(pw, dir, "", keepOwner)) }()
	t, err := c.ImportTemplateFormat(a.ctx, format, pr, tags...)
	pr.CloseWithError(err)
	return t, err
}

// isTemplateArchive reports whether r starts with the header entry of a
// `space template export` archive (uncompressed).
func isTemplateArchive(r *bufio.Reader) bool {
	b, err := r.Peek(512)
	if err != nil {
		return false
	}
	name := string(b[:100])
	if i := strings.IndexByte(name, 0); i >= 0 {
		name = name[:i]
	}
	return name == "space-template.json" && string(b[257:262]) == "ustar"
}

// buildBase runs build with a progress display: bars on a terminal, plain
// lines otherwise.
func (a *app) buildBase(build func(progress func(sdk.BuildProgress)) (*api.Template, error)) (*api.Template, error) {
	return a.buildBaseTo(a.out, build)
}

// buildBaseTo is buildBase with the progress display on out.
func (a *app) buildBaseTo(out io.Writer, build func(progress func(sdk.BuildProgress)) (*api.Template, error)) (*api.Template, error) {
	f, isFile := out.(*os.File)
	if a.json || !isFile || !term.IsTerminal(int(f.Fd())) {
		// Plain lines for logs and pipes; in --json mode progress goes to
		// stderr so stdout stays one JSON document.
		w := out
		if a.json {
			w = a.errOut
		}
		return build(func(p sdk.BuildProgress) {
			fmt.Fprintln(w, progressLine(p))
		})
	}
	p := mpb.NewWithContext(a.ctx, mpb.WithOutput(out), mpb.WithWidth(40))
	var bar *mpb.Bar
	phase := ""
	t, err := build(func(pr sdk.BuildProgress) {
		if pr.Phase != phase || bar == nil {
			if bar != nil {
				bar.SetTotal(-1, true)
			}
			phase = pr.Phase
			msg := pr.Message
			bar = p.AddBar(max(pr.Total, 0),
				mpb.PrependDecorators(decor.Name(fmt.Sprintf("%-12s", phase))),
				mpb.AppendDecorators(decor.CountersNoUnit("%d/%d"), decor.Any(func(decor.Statistics) string { return " " + msg })),
			)
		}
		if pr.Total > 0 {
			bar.SetTotal(pr.Total, false)
		}
		bar.SetCurrent(pr.Done)
	})
	if bar != nil {
		if err == nil {
			bar.SetTotal(-1, true)
		} else {
			bar.Abort(false)
		}
	}
	p.Wait()
	return t, err
}

func progressLine(p sdk.BuildProgress) string {
	s := p.Phase
	if p.Total > 0 {
		s += fmt.Sprintf(" %d/%d", p.Done, p.Total)
	} else if p.Done > 0 {
		s += fmt.Sprintf(" %d", p.Done)
	}
	if p.Message != "" {
		s += ": " + p.Message
	}
	return s
}

func (a *app) printTemplate(t *api.Template) error {
	if a.json {
		return printJSON(a.out, t)
	}
	return printTemplates(a, []api.Template{*t}, time.Now())
}

func printTemplates(a *app, list []api.Template, now time.Time) error {
	t := newTable(a.out, "REF", "DIGEST", "SIZE", "SOURCE", "CREATED")
	for _, tp := range list {
		refs := tp.Tags
		if len(refs) == 0 {
			refs = []string{"-"}
		}
		for _, ref := range refs {
			t.row(ref, shortDigest(tp.Digest), humanBytes(tp.SizeBytes), orDash(tp.Source), ago(now, tp.CreatedAt))
		}
	}
	return t.flush()
}

// shortDigest keeps "sha256:" and 12 hex digits, enough to be unique.
func shortDigest(d string) string {
	if len(d) > len("sha256:")+12 && strings.HasPrefix(d, "sha256:") {
		return d[:len("sha256:")+12]
	}
	return orDash(d)
}

func defaultCacheDir() string {
	if d := os.Getenv("SPACE_CACHE"); d != "" {
		return d
	}
	return "/var/cache/space"
}

// ensureBase builds the base template with a progress display (on stderr)
// before a create that needs it, so a first `space run` on a fresh server
// shows what the minutes are spent on instead of waiting silently.
func (a *app) ensureBase(ctx context.Context, c *sdk.Client, ref string) error {
	if ref != "" && ref != "base" && ref != "base:latest" {
		return nil
	}
	_, err := c.GetTemplate(ctx, "base:latest")
	if !errors.Is(err, sdk.ErrNotFound) {
		return nil // present, or the create will report the problem
	}
	fmt.Fprintln(a.errOut, "space: building the base template (once; a few minutes)")
	_, err = a.buildBaseTo(a.errOut, func(progress func(sdk.BuildProgress)) (*api.Template, error) {
		return c.BuildBaseTemplate(ctx, progress)
	})
	return err
}
