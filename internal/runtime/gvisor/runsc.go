package gvisor

import (
	"bytes"
	"context"
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// runscTimeout bounds every runsc invocation that has no tighter deadline
// from its caller: a wedged sandbox must never hang the server.
const runscTimeout = 30 * time.Second

// runsc runs the runsc binary with the flags every call of one runtime
// shares: its own state directory and the sandbox configuration. runsc
// reads the configuration flags when it creates a sandbox and stores them in
// its state, but later calls (pause, delete, …) must name the same root.
type runsc struct {
	bin   string
	root  string // --root: this runtime's state directory
	flags []string
}

// RunscVersion is the gVisor module version the setup script pins. The
// probe reports the version of the binary it finds (its Go build info).
const RunscVersion = "v0.0.0-20260905035102-160fafc42237"

// globalFlags are the sandbox configuration: systrap (the default platform,
// named so a changed default cannot surprise us), no network at all, writes
// to the host's per-sandbox overlay (not a gVisor-internal one that would
// vanish on stop), and the agent's socket bound on a host directory.
func globalFlags() []string {
	var debug []string
	// SPACE_RUNSC_DEBUG=DIR writes runsc's and the sentry's debug logs
	// under DIR (diagnostics only; they are large).
	if d := os.Getenv("SPACE_RUNSC_DEBUG"); d != "" {
		debug = []string{"--debug", "--debug-log=" + filepath.Join(d, "%ID%.%COMMAND%.log")}
	}
	return append(debug,
		"--platform=systrap",
		"--network=none",
		// The root filesystem is a host overlay with a per-sandbox upper on
		// its own disk; gVisor's own rootfs overlay (default root:self)
		// would keep writes in a file that dies with the sandbox.
		"--overlay2=none",
		// The agent binds its socket on a host directory mounted into the
		// sandbox, and the host dials it.
		"--host-uds=create",
		// No direct host file access from the sentry: every file operation
		// goes through the gofer, and the sentry then runs as nobody in its
		// own user namespace rather than as root (runsc's directfs mode
		// keeps it root so that it can open host files itself).
		"--directfs=false",
		// Linux's seccomp filters from the OCI spec apply inside the
		// sandbox (see spec.go: no user namespaces, keyrings, bpf, …).
		"--oci-seccomp",
	)
}

func (r *runsc) args(sub string, args ...string) []string {
	out := append([]string{"--root", r.root}, r.flags...)
	out = append(out, sub)
	return append(out, args...)
}

// RunscError is a runsc failure: its own message, not just an exit status.
type RunscError struct {
	Args   []string
	Stderr string
	Err    error
}

func (e *RunscError) Error() string {
	msg := strings.TrimSpace(e.Stderr)
	if msg == "" {
		msg = e.Err.Error()
	}
	return fmt.Sprintf("runsc %s: %s", e.Args[0], msg)
}

func (e *RunscError) Unwrap() error { return e.Err }

// run runs one runsc subcommand and returns its stdout. stdin, stdout and
// stderr of the runsc process are never the server's: a sandbox started by
// `runsc run --detach` keeps its descriptors, and a sandbox must not hold a
// pipe this call waits on.
func (r *runsc) run(ctx context.Context, timeout time.Duration, sub string, args ...string) ([]byte, error) {
	if timeout <= 0 {
		timeout = runscTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// Output goes to files, not pipes: a detached sandbox inherits them, and
	// Wait would block until the sandbox exits if they were pipes.
	outF, err := os.CreateTemp(r.root, ".out-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(outF.Name())
	defer outF.Close()
	errF, err := os.CreateTemp(r.root, ".err-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(errF.Name())
	defer errF.Close()
	cmd := exec.CommandContext(ctx, r.bin, r.args(sub, args...)...)
	cmd.Stdout, cmd.Stderr = outF, errF
	cmd.WaitDelay = time.Second
	runErr := cmd.Run()
	out, _ := readBounded(outF.Name(), 4<<20)
	if runErr != nil {
		stderr, _ := readBounded(errF.Name(), 8<<10)
		if ctx.Err() != nil {
			return out, &RunscError{Args: append([]string{sub}, args...), Stderr: string(stderr),
				Err: fmt.Errorf("no answer within %v: %w", timeout, errdefs.ErrTimeout)}
		}
		return out, &RunscError{Args: append([]string{sub}, args...), Stderr: lastLines(string(stderr), 5), Err: runErr}
	}
	return out, nil
}

func readBounded(path string, max int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var b bytes.Buffer
	_, err = b.ReadFrom(io.LimitReader(f, max))
	return b.Bytes(), err
}

// lastLines keeps the end of runsc's stderr: its final lines name the error.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// containerState is the part of `runsc state` we use.
type containerState struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Status string `json:"status"` // creating, created, running, paused, stopped
}

func (r *runsc) state(ctx context.Context, id string) (containerState, error) {
	out, err := r.run(ctx, 10*time.Second, "state", id)
	if err != nil {
		return containerState{}, err
	}
	var st containerState
	if err := json.Unmarshal(out, &st); err != nil {
		return containerState{}, fmt.Errorf("runsc state %s: %v", id, err)
	}
	return st, nil
}

// list returns the ids of every container in this runtime's state dir.
func (r *runsc) list(ctx context.Context) ([]string, error) {
	out, err := r.run(ctx, 10*time.Second, "list", "--quiet")
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(out)), nil
}

// deleteForce kills and removes a container; a missing one is not an error.
func (r *runsc) deleteForce(ctx context.Context, id string) error {
	_, err := r.run(ctx, 0, "delete", "--force", id)
	if err != nil && isNotExist(err) {
		return nil
	}
	return err
}

func isNotExist(err error) bool {
	var re *RunscError
	if !errors.As(err, &re) {
		return false
	}
	s := re.Stderr
	return strings.Contains(s, "does not exist") || strings.Contains(s, "not found") || strings.Contains(s, "no such file")
}

// binaryVersion reads the gVisor module version from the runsc binary's Go
// build info: a `go install` build has none stamped for `runsc --version`.
func binaryVersion(bin string) (string, error) {
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		return "", fmt.Errorf("reading build info of %s: %w", bin, err)
	}
	if info.Main.Path == "gvisor.dev/gvisor" && info.Main.Version != "" && info.Main.Version != "(devel)" {
		return info.Main.Version, nil
	}
	for _, d := range info.Deps {
		if d.Path == "gvisor.dev/gvisor" {
			return d.Version, nil
		}
	}
	return "unknown", nil
}

// findRunsc locates runsc: $SPACE_RUNSC, then bin/runsc next to the running
// binary (where scripts/setup.sh puts it), then the repository's bin/ when
// running tests from a checkout, then $PATH.
func findRunsc() (string, error) {
	if p := os.Getenv("SPACE_RUNSC"); p != "" {
		return p, nil
	}
	var cands []string
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), "runsc"))
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				cands = append(cands, filepath.Join(d, "bin", "runsc"))
				break
			}
			if d == filepath.Dir(d) {
				break
			}
		}
	}
	for _, c := range cands {
		if fi, err := os.Stat(c); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return c, nil
		}
	}
	if p, err := exec.LookPath("runsc"); err == nil {
		return p, nil
	}
	return "", errors.New("runsc not found (scripts/setup.sh builds bin/runsc; or set SPACE_RUNSC)")
}
