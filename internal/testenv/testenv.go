// Package testenv gates tests on host capabilities in one place.
//
// A test that needs something the host may lack (root, user namespaces, the
// base rootfs, …) calls Require. Locally, a missing capability skips the test
// with the reason. In CI (SPACE_CI=1) a missing capability FAILS the test,
// because CI runs on a machine where everything is expected to work and a
// silent skip would hide a regression.
package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
)

// InCI reports whether the tests run under .ci/run.
func InCI() bool { return os.Getenv("SPACE_CI") == "1" }

// Require skips (locally) or fails (in CI) t when ok is false.
func Require(t testing.TB, what string, ok bool, why string) {
	t.Helper()
	if ok {
		return
	}
	if InCI() {
		t.Fatalf("required capability %q missing in CI: %s", what, why)
	}
	t.Skipf("skipping: capability %q missing: %s", what, why)
}

// RequireRoot needs uid 0 (namespaces, cgroups, mounts).
func RequireRoot(t testing.TB) {
	t.Helper()
	Require(t, "root", os.Geteuid() == 0, "test needs uid 0")
}

// CacheDir is where expensive, shareable test inputs live (the debootstrapped
// base rootfs). SPACE_CACHE overrides; default /var/cache/space.
func CacheDir() string {
	if d := os.Getenv("SPACE_CACHE"); d != "" {
		return d
	}
	return "/var/cache/space"
}

// BaseRootfs returns the cached Debian base root filesystem built by
// scripts/setup.sh (space template build-base), or skips/fails.
func BaseRootfs(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(CacheDir(), "base-bookworm", "rootfs")
	_, err := os.Stat(filepath.Join(CacheDir(), "base-bookworm", "complete"))
	Require(t, "base-rootfs", err == nil, "run scripts/setup.sh to build "+dir)
	return dir
}

// staticBinary is one of the repository's static binaries, built at most
// once per test binary.
type staticBinary struct {
	name, env, pkg string
	once           sync.Once
	path           string
	err            error
}

var (
	agentBin = &staticBinary{name: "space-agent", env: "SPACE_AGENT_BIN", pkg: "github.com/spacehq/space/cmd/space-agent"}
	jailBin  = &staticBinary{name: "space-jail", env: "SPACE_JAIL_BIN", pkg: "github.com/spacehq/space/cmd/space-jail"}
	gwBin    = &staticBinary{name: "space-gateway", env: "SPACE_GATEWAY_BIN", pkg: "github.com/spacehq/space/cmd/space-gateway"}
	shimBin  = &staticBinary{name: "containerd-shim-space-v2", env: "SPACE_SHIM_BIN", pkg: "github.com/spacehq/space/cmd/containerd-shim-space-v2"}
)

// ShimBinary returns a static containerd-shim-space-v2 for tests, as
// AgentBinary does ($SPACE_SHIM_BIN when set, else built once).
func ShimBinary(t testing.TB) string {
	t.Helper()
	return shimBin.get(t)
}

// GatewayBinary returns a static space-gateway (the network gateway
// process) for tests, as AgentBinary does ($SPACE_GATEWAY_BIN when set).
func GatewayBinary(t testing.TB) string {
	t.Helper()
	return gwBin.get(t)
}

// AgentBinary returns a static space-agent for tests: $SPACE_AGENT_BIN when
// set (make test builds bin/space-agent first), else one built once per test
// binary into a fixed path under the temp dir (replaced atomically, so test
// binaries running side by side neither race nor leave a copy each behind).
func AgentBinary(t testing.TB) string {
	t.Helper()
	return agentBin.get(t)
}

// JailBinary returns a static space-jail (the microvm runtime's QEMU
// jailer) for tests, as AgentBinary does: $SPACE_JAIL_BIN when set (make
// test builds bin/space-jail first), else one built once per test binary.
func JailBinary(t testing.TB) string {
	t.Helper()
	return jailBin.get(t)
}

func (b *staticBinary) get(t testing.TB) string {
	t.Helper()
	b.once.Do(func() { b.path, b.err = b.build() })
	if b.err != nil {
		t.Fatalf("building %s: %v", b.name, b.err)
	}
	return b.path
}

func (b *staticBinary) build() (string, error) {
	if p := os.Getenv(b.env); p != "" {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	dir := filepath.Join(os.TempDir(), "space-test-agent")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(dir, "build-")
	if err != nil {
		return "", err
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", tmp.Name(), b.pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", &buildError{out: string(out), err: err}
	}
	path := filepath.Join(dir, b.name)
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", err
	}
	return path, nil
}

// PrepareAgentBinary finds or builds the agent binary AgentBinary returns,
// for a TestMain that must have it before any test runs (a later failure is
// reported again by AgentBinary).
func PrepareAgentBinary() error {
	agentBin.once.Do(func() { agentBin.path, agentBin.err = agentBin.build() })
	return agentBin.err
}

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + ": " + e.out }
