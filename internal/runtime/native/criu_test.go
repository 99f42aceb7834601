package native

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/testenv"
)

// criu check must not share the host's network: with iptables installed
// it lists the rules with reverse DNS through the host resolver. A stand-in
// criu on PATH records the network namespace it ran in.
func TestCriuCheckRunsWithoutTheHostNetwork(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	seen := filepath.Join(dir, "netns")
	script := "#!/bin/sh\nreadlink /proc/self/ns/net > " + seen + "\nexit 1\n"
	if err := os.WriteFile(filepath.Join(dir, "criu"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+":"+os.Getenv("PATH"))
	why := criuReason(context.Background())
	if !strings.Contains(why, "criu check fails") {
		t.Fatalf("reason %q does not come from the stand-in criu", why)
	}
	got, err := os.ReadFile(seen)
	if err != nil {
		t.Fatal(err)
	}
	host, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(string(got)) == host {
		t.Fatalf("criu check ran in the host's network namespace (%s)", host)
	}
}
