package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"golang.org/x/term"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/sdk"
)

func newTemplateCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "template", Aliases: []string{"templates", "tpl"}, Short: "Manage templates (root filesystems)"}

	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List templates",
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
	inspect := &cobra.Command{
		Use:   "inspect REF",
		Short: "Show a template (REF is name:tag or sha256:…)",
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
			return a.printTemplate(t)
		},
	}
	rm := &cobra.Command{
		Use:   "rm TAG",
		Short: "Remove a template tag",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.Client()
			if err != nil {
				return err
			}
			if err := c.RemoveTemplate(a.ctx, args[0], false); err != nil {
				return err
			}
			if !a.json {
				fmt.Fprintln(a.out, args[0])
			}
			return nil
		},
	}
	var tag string
	imp := &cobra.Command{
		Use:   "import [--tag name:tag] DIR|TAR",
		Short: "Import a root filesystem from a directory or a tar (optionally gzip) file",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if tag != "" && !validTag(tag) {
				return usagef("--tag %q: want name:tag (letters, digits, . _ -)", tag)
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			t, err := a.importTemplate(c, tag, args[0])
			if err != nil {
				return err
			}
			return a.printTemplate(t)
		},
	}
	imp.Flags().StringVar(&tag, "tag", "", "tag the template as name:tag")
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
				// Without a server: build only the cached root filesystem
				// (what scripts/setup.sh does on a fresh machine).
				var rootfs string
				_, err := a.buildBase(func(progress func(sdk.BuildProgress)) (*api.Template, error) {
					var err error
					rootfs, err = template.BuildBase(a.ctx, cacheDir, func(p template.Progress) {
						progress(sdk.BuildProgress{Phase: p.Phase, Done: int64(p.Done), Total: int64(p.Total), Message: p.Message})
					})
					return nil, err
				})
				if err != nil {
					return err
				}
				fmt.Fprintln(a.out, "base root filesystem ready:", rootfs)
				return nil
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
	cmd.AddCommand(ls, inspect, rm, imp, build)
	return cmd
}

// validTag checks "name:tag" the way users can type it; the server has the
// final word.
func validTag(s string) bool {
	name, tag, ok := strings.Cut(s, ":")
	ok2 := func(p string) bool {
		if p == "" || len(p) > 128 {
			return false
		}
		for _, r := range p {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
				return false
			}
		}
		return true
	}
	return ok && ok2(name) && ok2(tag)
}

func (a *app) importTemplate(c *sdk.Client, tag, src string) (*api.Template, error) {
	fi, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		f, err := os.Open(src)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return c.ImportTemplate(a.ctx, tag, f)
	}
	// A directory is streamed as a tar of its contents, owners kept: a
	// root filesystem's ownership is part of it.
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(pw, src, "", true)) }()
	t, err := c.ImportTemplate(a.ctx, tag, pr)
	pr.CloseWithError(err)
	return t, err
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
	t := newTable(a.out, "DIGEST", "TAGS", "SIZE", "SOURCE", "CREATED")
	for _, tp := range list {
		t.row(shortDigest(tp.Digest), orDash(strings.Join(tp.Tags, ",")), humanBytes(tp.SizeBytes), orDash(tp.Source), ago(now, tp.CreatedAt))
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
	if !errors.Is(err, errdefs.ErrNotFound) {
		return nil // present, or the create will report the problem
	}
	fmt.Fprintln(a.errOut, "space: building the base template (once; a few minutes)")
	_, err = a.buildBaseTo(a.errOut, func(progress func(sdk.BuildProgress)) (*api.Template, error) {
		return c.BuildBaseTemplate(ctx, progress)
	})
	return err
}
