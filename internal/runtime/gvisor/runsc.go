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
	"sync"
	"sync/atomic"
	"syscall"
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
	// calls counts invocations by subcommand: tests hold the runtime to
	// one runsc process per start (TestOneRunscPerCreate).
	calls sync.Map // string → *atomic.Int64
}

// count records one invocation of sub.
func (r *runsc) count(sub string) {
	v, _ := r.calls.LoadOrStore(sub, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

// callCounts is how many times each subcommand ran so far.
func (r *runsc) callCounts() map[string]int64 {
	out := map[string]int64{}
	r.calls.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})
	return out
}

// RunscVersion is the gVisor module version the setup script pins. The
// probe reports the version of the binary it finds (its Go build info).
const RunscVersion = "v0.0.0-20260905035102-160fafc42237"

// globalFlags are the sandbox configuration: systrap (the default platform,
// named so a changed default cannot surprise us), the network of the
// sandbox's own namespace (its NIC), writes
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
		// The sandbox's network namespace (the bundle names it) holds its
		// one NIC, a TAP whose far end is the gateway: runsc moves the
		// TAP's address and routes into the sentry's stack, which sends
		// and receives on it through a packet socket (network.go).
		"--network=sandbox",
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
		// Each gofer gets a fresh empty network namespace. runsc's default
		// pins one shared namespace by a bind mount in the state directory:
		// a mount that outlives a killed server and makes its data
		// directory impossible to remove.
		"--gofer-network-namespace=new",
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

// Unwrap gives the process error and, when runsc's message says so, one of
// the container sentinels below, so callers use errors.Is instead of
// matching runsc's text themselves.
func (e *RunscError) Unwrap() []error {
	if k := classifyRunsc(e.Stderr); k != nil {
		return []error{e.Err, k}
	}
	return []error{e.Err}
}

var (
	// errContainerExists: runsc's state already has a container of this id
	// (one that died on its own stays there until deleted).
	errContainerExists = errors.New("runsc: container already exists")
	// errContainerNotExist: runsc's state has no container of this id.
	errContainerNotExist = errors.New("runsc: container does not exist")
)

// classifyRunsc is the one place runsc's messages are read for meaning:
// runsc reports these conditions only as text (its --log-fd JSON "msg" or
// stderr). Tested against the real runsc (TestRunscErrorKinds).
func classifyRunsc(msg string) error {
	switch {
	case strings.Contains(msg, "already exists"):
		return errContainerExists
	case strings.Contains(msg, "does not exist"), strings.Contains(msg, "not found"), strings.Contains(msg, "no such file"):
		return errContainerNotExist
	}
	return nil
}

// containerStdio lists the subcommands whose stdio the container inherits.
// Their stdio is /dev/null: the sandbox must not hold, or be able to fill,
// anything of the host's (processes inside can open /proc/1/fd/2).
var containerStdio = map[string]bool{"run": true, "restore": true, "create": true}

// run runs one runsc subcommand and returns its stdout. runsc's own errors
// come back through --log-fd (JSON lines), so they are available even when
// its stdio is /dev/null.
func (r *runsc) run(ctx context.Context, timeout time.Duration, sub string, args ...string) ([]byte, error) {
	if timeout <= 0 {
		timeout = runscTimeout
	}
	r.count(sub)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// Files, not pipes: Wait would otherwise also wait for any process
	// that inherited a pipe end.
	tmp := func(prefix string) (*os.File, error) {
		f, err := os.CreateTemp(r.root, prefix)
		if err == nil {
			os.Remove(f.Name())
		}
		return f, err
	}
	logF, err := tmp(".log-")
	if err != nil {
		return nil, err
	}
	defer logF.Close()
	var outF, errF *os.File
	if !containerStdio[sub] {
		if outF, err = tmp(".out-"); err != nil {
			return nil, err
		}
		defer outF.Close()
		if errF, err = tmp(".err-"); err != nil {
			return nil, err
		}
		defer errF.Close()
	}
	full := append([]string{"--log-fd=3"}, r.args(sub, args...)...)
	cmd := exec.CommandContext(ctx, r.bin, full...)
	if outF != nil {
		cmd.Stdout, cmd.Stderr = outF, errF
	}
	cmd.ExtraFiles = []*os.File{logF}
	// Its own session: a signal to the server's process group (Ctrl-C in
	// a terminal) must not reach a sandbox runsc leaves running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.WaitDelay = time.Second
	runErr := cmd.Run()
	var out []byte
	if outF != nil {
		out, _ = readBounded(outF, 4<<20)
	}
	if runErr == nil {
		return out, nil
	}
	msg := logMessages(logF)
	if msg == "" && errF != nil {
		stderr, _ := readBounded(errF, 8<<10)
		msg = lastLines(string(stderr), 5)
	}
	re := &RunscError{Args: append([]string{sub}, args...), Stderr: msg, Err: runErr}
	if ctx.Err() != nil {
		re.Err = fmt.Errorf("no answer within %v: %w", timeout, errdefs.ErrTimeout)
	}
	return out, re
}

// logMessages extracts the messages of runsc's JSON error log.
func logMessages(f *os.File) string {
	dec := json.NewDecoder(io.NewSectionReader(f, 0, 64<<10))
	var msgs []string
	for {
		var e struct {
			Msg string `json:"msg"`
		}
		if err := dec.Decode(&e); err != nil {
			break
		}
		if e.Msg != "" {
			// A failed save carries the sentry's panic dump (goroutine
			// stacks, whole objects) after the first line: keep the line.
			m, _, _ := strings.Cut(e.Msg, "\n")
			if len(m) > 1024 {
				m = m[:1024] + "…"
			}
			msgs = append(msgs, strings.TrimSuffix(m, ":"))
		}
	}
	return strings.Join(msgs, "; ")
}

// readBounded reads up to max bytes of f from its start.
func readBounded(f *os.File, max int64) ([]byte, error) {
	var b bytes.Buffer
	_, err := b.ReadFrom(io.NewSectionReader(f, 0, max))
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

// runReplacingStale runs sub (run or restore) for container id; if runsc's
// state still holds a container of that id — one that died on its own
// (a crash), or one left between a checkpoint and its delete — it deletes
// it and tries once more.
func (r *runsc) runReplacingStale(ctx context.Context, timeout time.Duration, sub, id string, args ...string) error {
	_, err := r.run(ctx, timeout, sub, args...)
	if !errors.Is(err, errContainerExists) {
		return err
	}
	if err := r.deleteForce(ctx, id); err != nil {
		return fmt.Errorf("removing its old container: %w", err)
	}
	_, err = r.run(ctx, timeout, sub, args...)
	return err
}

// deleteForce kills and removes a container; a missing one is not an error.
func (r *runsc) deleteForce(ctx context.Context, id string) error {
	_, err := r.run(ctx, 0, "delete", "--force", id)
	if errors.Is(err, errContainerNotExist) {
		return nil
	}
	return err
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
