// Package e2e drives a real space server (in-process, and as a separate
// process for crash tests) with real native sandboxes, through the Go SDK,
// the CLI and raw HTTP.
package e2e

import (
	"bytes"
	"context"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/internal/cli"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/pgtest"
	"github.com/spacehq/space/sdk"
)

// maxFileBytes is the shared server's per-request file limit, small enough
// that the 413 path is cheap to test.
const maxFileBytes = 8 << 20

// env is one in-process server shared by the tests of this package.
type env struct {
	url    string
	key    string
	data   string
	srv    *server.Server
	client *sdk.Client
	// internet stands in for the outside world (network_test.go); the
	// server's gateway reaches it only through 127.0.0.0/8, opened with
	// --egress-allow-private, and refuses any dial off this machine.
	internet *fakeInternet
	apiPort  int
}

var (
	sharedOnce sync.Once
	shared     *env
	sharedErr  error
)

// setup returns the shared server, skipping (locally) or failing (CI) when
// the host cannot run native sandboxes.
func setup(t *testing.T) *env {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	sharedOnce.Do(func() {
		data, err := os.MkdirTemp("", "space-e2e-")
		if err != nil {
			sharedErr = err
			return
		}
		fi, err := startFakeInternet()
		if err != nil {
			sharedErr = err
			return
		}
		s, err := server.New(context.Background(), server.Config{DataDir: data, CacheDir: testenv.CacheDir(), AgentBinary: agent, JailBinary: testenv.JailBinary(t), APIKeyOut: os.Stderr, MaxFileBytes: maxFileBytes,
			// As `space server` does: a pool of one for base:latest on
			// auto, so the tests below exercise claims constantly.
			PoolDefault: 1,
			Network: server.NetworkOptions{
				AllowPrivate:  []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
				DNSUpstream:   fi.dns.Addr,
				DialGuard:     "loopback",
				GatewayBinary: testenv.GatewayBinary(t),
				UpstreamCA:    fi.upCAFile,
			}})
		if err != nil {
			sharedErr = err
			return
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			sharedErr = err
			return
		}
		go s.HTTPServer().Serve(l)
		url := "http://" + l.Addr().String()
		c, err := sdk.New(url, s.APIKey())
		if err != nil {
			sharedErr = err
			return
		}
		shared = &env{url: url, key: s.APIKey(), data: data, srv: s, client: c, internet: fi, apiPort: l.Addr().(*net.TCPAddr).Port}
	})
	if sharedErr != nil {
		t.Fatalf("starting server: %v", sharedErr)
	}
	return shared
}

func TestMain(m *testing.M) {
	procs := startProcWatch()
	code := m.Run()
	if shared != nil {
		// Delete whatever the tests left, then check nothing leaked.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		sbs, _ := shared.client.ListSandboxes(ctx, sdk.ListOptions{})
		for _, sb := range sbs {
			if op, err := shared.client.DeleteSandbox(ctx, sb.ID, true); err == nil {
				shared.client.WaitOperation(ctx, op.ID)
			}
		}
		// Pool members go with their pools (Close waits for the drain).
		pools, _ := shared.client.ListPools(ctx)
		for _, p := range pools {
			shared.client.DeletePool(ctx, p.ID)
		}
		cancel()
		shared.srv.Close()
		if err := gatewayClean(shared.data); err != nil {
			os.Stderr.WriteString("e2e: " + err.Error() + "\n")
			code = 1
		}
		shared.internet.close()
		if leaks := hostLeaks(shared.data); len(leaks) > 0 {
			os.Stderr.WriteString("e2e: host resources leaked after deleting every sandbox:\n  " + strings.Join(leaks, "\n  ") + "\n")
			code = 1
		}
		procs.addDirs(shared.data)
		os.RemoveAll(shared.data)
	}
	pgtest.StopShared()
	// No runsc, QEMU, agent or gateway the suite started may outlive it
	// (procleak_test.go); a few seconds for exits already under way.
	if left := procs.finish(10 * time.Second); len(left) > 0 {
		os.Stderr.WriteString("e2e: processes the suite started outlive it:\n  " + strings.Join(left, "\n  ") + "\n")
		code = 1
	}
	os.Exit(code)
}

// hostLeaks lists mounts, cgroups and sandbox dirs that belong to data.
func hostLeaks(data string) []string {
	var out []string
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, data) {
				out = append(out, "mount: "+l)
			}
		}
	}
	for _, rt := range []string{"native", "gvisor", "microvm"} {
		ents, _ := os.ReadDir(filepath.Join(data, "runtimes", rt, "sandboxes"))
		for _, e := range ents {
			out = append(out, "dir: "+rt+"/"+e.Name())
		}
	}
	return out
}

// ensureBase builds the base template base:latest if it is missing (a
// no-op once it is there), so a test naming it passes run alone.
func (e *env) ensureBase(t *testing.T, ctx context.Context) {
	t.Helper()
	if _, err := e.client.BuildBaseTemplate(ctx, nil); err != nil {
		t.Fatalf("base template: %v", err)
	}
}

// spaceCLI runs the CLI in-process against the shared server.
func (e *env) spaceCLI(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var o, s bytes.Buffer
	all := append([]string{"--url", e.url, "--api-key", e.key}, args...)
	code = cli.Execute(context.Background(), all, strings.NewReader(stdin), &o, &s)
	return o.String(), s.String(), code
}

// buildSpace builds the space binary for tests that need a separate
// process, with space-server beside it (which `space server` becomes).
func buildSpace(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, b := range []string{"space", "space-server"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, b), "github.com/spacehq/space/cmd/"+b)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("building %s: %v\n%s", b, err, out)
		}
	}
	return filepath.Join(dir, "space")
}
