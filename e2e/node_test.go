package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/testenv"
)

// TestNodeSuites runs every e2e/js/*.test.mjs file with node's test runner
// against the shared server: the real npm clients (E2B's SDK, the MCP
// TypeScript SDK), unmodified, configured only through their environment.
// scripts/setup-test.sh installs them from the committed lockfile.
func TestNodeSuites(t *testing.T) {
	e := setup(t)
	node, err := exec.LookPath("node")
	testenv.Require(t, "node", err == nil, "node is not on PATH (scripts/setup-test.sh checks for it)")
	if _, err := os.Stat("js/node_modules/e2b/package.json"); err != nil {
		t.Fatalf("e2e/js/node_modules is missing: run scripts/setup-test.sh (npm ci from the lockfile): %v", err)
	}
	files, _ := filepath.Glob("js/*.test.mjs")
	if len(files) == 0 {
		t.Fatal("no e2e/js/*.test.mjs files")
	}
	spaceBin := spaceBinary(t)
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".test.mjs"), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec", "--test-concurrency=1", filepath.Base(f))
			cmd.Dir = "js"
			cmd.Env = append(os.Environ(),
				"SPACE_URL="+e.url,
				"SPACE_API_KEY="+e.key,
				"SPACE_BIN="+spaceBin,
				"SPACE_RUNTIME=gvisor",
				// E2B's SDK, pointed at this server exactly as docs/e2b.md says.
				"E2B_API_URL="+e.url+"/e2b",
				"E2B_SANDBOX_URL="+e.url+"/e2b/envd",
				"E2B_API_KEY="+e.key,
				"E2B_DOMAIN=localhost:"+strconv.Itoa(e.apiPort),
			)
			out, err := cmd.CombinedOutput()
			if err != nil || testing.Verbose() {
				t.Logf("node --test %s:\n%s", f, out)
			}
			if err != nil {
				t.Fatalf("node --test %s: %v", f, err)
			}
		})
	}
}

// spaceBinary is the space CLI for tests that run it as a separate process:
// bin/space (with bin/space-server) next to $SPACE_AGENT_BIN when make test
// built them, else a fresh build.
func spaceBinary(t *testing.T) string {
	t.Helper()
	if a := os.Getenv("SPACE_AGENT_BIN"); a != "" {
		p := filepath.Join(filepath.Dir(a), "space")
		_, err := os.Stat(p)
		_, serr := os.Stat(filepath.Join(filepath.Dir(a), "space-server"))
		if err == nil && serr == nil {
			return p
		}
	}
	return buildSpace(t)
}
