package template

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// Base template parameters. The suite and package set are fixed so that every
// host builds the same base, and the cache directory name encodes the suite.
const (
	baseSuite    = "bookworm"
	baseSource   = "debootstrap:" + baseSuite
	baseCacheDir = "base-" + baseSuite
	basePackages = "python3,ca-certificates,curl,git,procps"
	// completeMarker is written last; testenv.BaseRootfs and BuildBase itself
	// treat a rootfs without it as garbage from an interrupted build.
	completeMarker = "complete"
)

// Progress phases reported by BuildBase and EnsureBase.
const (
	PhaseResolve   = "resolve"   // debootstrap is fetching indices and resolving dependencies
	PhaseRetrieve  = "retrieve"  // downloading .debs
	PhaseExtract   = "extract"   // extracting the essential packages
	PhaseUnpack    = "unpack"    // dpkg --unpack
	PhaseConfigure = "configure" // dpkg --configure
	PhaseFinalize  = "finalize"  // cleaning caches, fixing up /etc and /tmp
	PhaseImport    = "import"    // copying the rootfs into the template store
	PhaseDone      = "done"      // EnsureBase finished (the last event)
)

// Progress is one step of a long template operation.
type Progress struct {
	Phase   string `json:"phase"`
	Done    int    `json:"done"`
	Total   int    `json:"total"` // 0 when unknown
	Message string `json:"message"`
}

// BuildBase builds the Debian bookworm base root filesystem with debootstrap
// into <cacheDir>/base-bookworm/rootfs and returns that path. A previous
// complete build is reused as is. The build happens in a temporary directory
// next to the result and is renamed into place, and the "complete" marker is
// written last, so an interrupted build never looks finished. Concurrent
// callers — in this process or others, e.g. parallel test binaries — are
// serialised by an flock on <cacheDir>/base-bookworm.lock.
//
// The base has the unprivileged account "user" (ensureBaseUser). A cached
// build from before that account existed gets it in place, under the
// lock, instead of being rebuilt.
func BuildBase(ctx context.Context, cacheDir string, progress func(Progress)) (string, error) {
	if progress == nil {
		progress = func(Progress) {}
	}
	final := filepath.Join(cacheDir, baseCacheDir)
	rootfs := filepath.Join(final, "rootfs")
	if baseComplete(final) {
		if ok, err := ensureBaseUser(rootfs, false); err == nil && ok {
			return rootfs, nil
		}
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return "", fmt.Errorf("create cache dir: %w", err)
	}
	unlock, err := lockFile(ctx, filepath.Join(cacheDir, baseCacheDir+".lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	// Another process may have finished while we waited for the lock.
	if baseComplete(final) {
		if _, err := ensureBaseUser(rootfs, true); err != nil {
			return "", fmt.Errorf("add the %q account to the cached base rootfs: %w", baseUserName, err)
		}
		return rootfs, nil
	}

	mirror, err := debianMirror("/etc/apt")
	if err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(cacheDir, "."+baseCacheDir+"-build-")
	if err != nil {
		return "", fmt.Errorf("create build dir: %w", err)
	}
	defer os.RemoveAll(tmp)
	target := filepath.Join(tmp, "rootfs")

	if err := runDebootstrap(ctx, target, mirror, progress); err != nil {
		return "", err
	}
	progress(Progress{Phase: PhaseFinalize, Message: "cleaning apt caches"})
	if err := finalizeBase(target); err != nil {
		return "", fmt.Errorf("finalize base rootfs: %w", err)
	}

	// Replace whatever an interrupted earlier build left behind.
	if err := os.RemoveAll(final); err != nil {
		return "", fmt.Errorf("remove stale %s: %w", final, err)
	}
	// 0700: the tree has world-writable directories (/tmp); no host user
	// but root may plant files in what becomes every sandbox's template.
	if err := os.MkdirAll(final, 0o700); err != nil {
		return "", err
	}
	if err := os.Rename(target, rootfs); err != nil {
		return "", fmt.Errorf("move base rootfs into place: %w", err)
	}
	// The marker must not reach disk before the tree does.
	if err := syncFS(final); err != nil {
		return "", err
	}
	stamp := fmt.Sprintf("suite=%s\nmirror=%s\npackages=%s\nbuilt=%s\n", baseSuite, mirror, basePackages, time.Now().UTC().Format(time.RFC3339))
	if err := writeFileSync(filepath.Join(final, completeMarker), []byte(stamp), 0o644); err != nil {
		return "", err
	}
	progress(Progress{Phase: PhaseFinalize, Message: "base rootfs ready at " + rootfs})
	return rootfs, nil
}

func baseComplete(final string) bool {
	_, err := os.Stat(filepath.Join(final, completeMarker))
	return err == nil
}

// lockFile takes an exclusive flock on path, polling so ctx can cancel the wait.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", path, err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { _ = unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// runDebootstrap runs debootstrap and turns its "I: …" lines into Progress.
func runDebootstrap(ctx context.Context, target, mirror string, progress func(Progress)) error {
	bin, err := exec.LookPath("debootstrap")
	if err != nil {
		return fmt.Errorf("debootstrap is not installed: %w", errdefs.ErrUnavailable)
	}
	cmd := exec.CommandContext(ctx, bin,
		"--variant=minbase",
		"--include="+basePackages,
		baseSuite, target, mirror)
	// A fixed, minimal environment: the host's locale or proxy settings must
	// not change what gets built.
	cmd.Env = []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"LC_ALL=C", "DEBIAN_FRONTEND=noninteractive", "HOME=/root",
	}
	cmd.WaitDelay = 10 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr tailBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start debootstrap: %w", err)
	}
	var tail tailBuffer
	p := &debootstrapParser{emit: progress}
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(&tail, line)
		p.line(line)
	}
	if err := cmd.Wait(); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("debootstrap: %w", ctx.Err())
		}
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = strings.TrimSpace(tail.String())
		}
		// debootstrap keeps its own log inside the target; its tail is
		// usually the only useful explanation of a failure.
		if b, rerr := os.ReadFile(filepath.Join(target, "debootstrap", "debootstrap.log")); rerr == nil {
			msg += "\n--- debootstrap.log (tail) ---\n" + lastBytes(string(b), 4096)
		}
		return fmt.Errorf("debootstrap %s %s: %w\n%s", baseSuite, mirror, err, msg)
	}
	return nil
}

// debootstrapParser maps debootstrap's informational lines to phases:
//
//	I: Retrieving InRelease / Packages   → resolve
//	I: Retrieving libc6 2.36-9           → retrieve (one per package)
//	I: Extracting libc6...               → extract
//	I: Unpacking libc6:amd64...          → unpack
//	I: Configuring libc6:amd64...        → configure
//
// The number of retrieved packages is the total for the later phases.
type debootstrapParser struct {
	emit      func(Progress)
	phase     string
	done      int
	retrieved int
}

func (p *debootstrapParser) line(line string) {
	msg, ok := strings.CutPrefix(line, "I: ")
	if !ok {
		return
	}
	phase := PhaseResolve
	switch {
	case strings.HasPrefix(msg, "Retrieving "):
		what := strings.TrimPrefix(msg, "Retrieving ")
		if what == "InRelease" || what == "Release" || what == "Release.gpg" || what == "Packages" {
			phase = PhaseResolve
		} else {
			phase = PhaseRetrieve
			p.retrieved++
		}
	case strings.HasPrefix(msg, "Extracting "):
		phase = PhaseExtract
	case strings.HasPrefix(msg, "Unpacking ") && !strings.HasSuffix(msg, "packages..."):
		phase = PhaseUnpack
	case strings.HasPrefix(msg, "Configuring ") && !strings.HasSuffix(msg, "packages..."):
		phase = PhaseConfigure
	case strings.HasPrefix(msg, "Unpacking "), strings.HasPrefix(msg, "Configuring "),
		strings.HasPrefix(msg, "Validating "), strings.HasPrefix(msg, "Installing "),
		strings.HasPrefix(msg, "Base system"):
		// Section headers ("Unpacking required packages...") and the
		// checksum check after each download keep the current phase and
		// count but are still worth showing.
		if p.phase != "" {
			phase = p.phase
		}
		p.emit(Progress{Phase: phase, Done: p.done, Total: p.total(phase), Message: msg})
		return
	}
	if phase != p.phase {
		p.phase, p.done = phase, 0
	}
	if phase != PhaseResolve {
		p.done++
	}
	p.emit(Progress{Phase: phase, Done: p.done, Total: p.total(phase), Message: msg})
}

func (p *debootstrapParser) total(phase string) int {
	switch phase {
	case PhaseExtract, PhaseUnpack, PhaseConfigure:
		// Every package is retrieved once; extract covers only the
		// essential subset, and unpack/configure may be split into
		// "required" and "base" passes, so keep Done ≤ Total honest.
		if p.done > p.retrieved {
			return p.done
		}
		return p.retrieved
	}
	return 0
}

// finalizeBase trims the rootfs and makes sure the files every runtime
// relies on exist.
func finalizeBase(root string) error {
	for _, glob := range []string{
		"var/cache/apt/archives/*.deb",
		"var/cache/apt/*.bin",
		"var/lib/apt/lists/*",
		"var/log/*.log",
	} {
		matches, err := filepath.Glob(filepath.Join(root, glob))
		if err != nil {
			return err
		}
		for _, m := range matches {
			if filepath.Base(m) == "lock" || filepath.Base(m) == "partial" || filepath.Base(m) == "auxfiles" {
				continue
			}
			if err := os.RemoveAll(m); err != nil {
				return err
			}
		}
	}
	// resolv.conf may be a dangling symlink or missing; runtimes bind or
	// write their own over it, so an empty regular file is what they need.
	resolv := filepath.Join(root, "etc", "resolv.conf")
	if fi, err := os.Lstat(resolv); err != nil || !fi.Mode().IsRegular() {
		_ = os.Remove(resolv)
		if err := os.WriteFile(resolv, nil, 0o644); err != nil {
			return err
		}
	}
	if _, err := ensureBaseUser(root, true); err != nil {
		return fmt.Errorf("add the %q account: %w", baseUserName, err)
	}
	// debootstrap copies the host's hostname; a template must not leak it.
	if err := os.WriteFile(filepath.Join(root, "etc", "hostname"), []byte("sandbox\n"), 0o644); err != nil {
		return err
	}
	tmp := filepath.Join(root, "tmp")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return err
	}
	return os.Chmod(tmp, 0o777|os.ModeSticky)
}

// debianMirror finds the Debian archive URI for baseSuite in the host's apt
// configuration (sources.list one-line format and deb822 .sources files).
// SPACE_DEBIAN_MIRROR overrides it.
func debianMirror(aptDir string) (string, error) {
	if m := os.Getenv("SPACE_DEBIAN_MIRROR"); m != "" {
		return m, nil
	}
	var entries []aptSource
	if b, err := os.ReadFile(filepath.Join(aptDir, "sources.list")); err == nil {
		entries = append(entries, parseOneLineSources(string(b))...)
	}
	files, _ := filepath.Glob(filepath.Join(aptDir, "sources.list.d", "*"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		switch {
		case strings.HasSuffix(f, ".list"):
			entries = append(entries, parseOneLineSources(string(b))...)
		case strings.HasSuffix(f, ".sources"):
			entries = append(entries, parseDeb822Sources(string(b))...)
		}
	}
	for _, e := range entries {
		if e.suite == baseSuite && (strings.HasPrefix(e.uri, "http") || strings.HasPrefix(e.uri, "file:")) {
			return e.uri, nil
		}
	}
	return "", fmt.Errorf("no apt source for suite %q in %s (set SPACE_DEBIAN_MIRROR): %w", baseSuite, aptDir, errdefs.ErrUnavailable)
}

type aptSource struct{ uri, suite string }

// parseOneLineSources parses "deb [options] uri suite [component...]" lines.
func parseOneLineSources(text string) []aptSource {
	var out []aptSource
	for _, line := range strings.Split(text, "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") {
			// Options may contain spaces: skip to the closing bracket.
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) == 0 {
				continue
			}
			f = f[1:]
		}
		if len(f) < 2 {
			continue
		}
		out = append(out, aptSource{uri: strings.TrimSuffix(f[0], "/"), suite: f[1]})
	}
	return out
}

// parseDeb822Sources parses deb822 stanzas (Types/URIs/Suites/Enabled).
func parseDeb822Sources(text string) []aptSource {
	var out []aptSource
	flush := func(st map[string]string) {
		if strings.EqualFold(st["enabled"], "no") {
			return
		}
		if !contains(strings.Fields(st["types"]), "deb") {
			return
		}
		for _, uri := range strings.Fields(st["uris"]) {
			for _, suite := range strings.Fields(st["suites"]) {
				out = append(out, aptSource{uri: strings.TrimSuffix(uri, "/"), suite: suite})
			}
		}
	}
	st := map[string]string{}
	last := ""
	for _, line := range strings.Split(text+"\n\n", "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		if strings.TrimSpace(line) == "" {
			if len(st) > 0 {
				flush(st)
			}
			st, last = map[string]string{}, ""
			continue
		}
		if line[0] == ' ' || line[0] == '\t' {
			if last != "" {
				st[last] += " " + strings.TrimSpace(line)
			}
			continue
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		last = strings.ToLower(strings.TrimSpace(k))
		st[last] = strings.TrimSpace(v)
	}
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// tailBuffer keeps the last 16 KiB written to it.
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > 16<<10 {
		t.b = append(t.b[:0], t.b[len(t.b)-16<<10:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }

var _ io.Writer = (*tailBuffer)(nil)

func lastBytes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

func writeFileSync(path string, data []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
