package sandbox

import (
	"go/build"
	"path/filepath"
	"strings"
	"testing"
)

// TestImportsNoGateway holds the layering docs/ARCHITECTURE.md describes:
// the gateway's control client (internal/gateway/gwctl) implements this
// package's Network and Broker, so nothing this package builds on, directly
// or not, may import internal/gateway or a package under it (the
// brokering config they share lives in the leaf internal/brokerconf).
func TestImportsNoGateway(t *testing.T) {
	const module = "github.com/spacehq/space/"
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	// via[p] is the package that imports p on the first path found.
	via := map[string]string{module + "internal/sandbox": ""}
	queue := []string{module + "internal/sandbox"}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		pkg, err := build.Default.ImportDir(filepath.Join(root, strings.TrimPrefix(p, module)), 0)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		for _, imp := range pkg.Imports {
			if !strings.HasPrefix(imp, module) {
				continue
			}
			if _, seen := via[imp]; seen {
				continue
			}
			via[imp] = p
			queue = append(queue, imp)
		}
	}
	if len(via) < 5 {
		t.Fatalf("only %d packages of the module found: the walk is broken", len(via))
	}
	for p := range via {
		rel := strings.TrimPrefix(p, module)
		if rel != "internal/gateway" && !strings.HasPrefix(rel, "internal/gateway/") {
			continue
		}
		chain := []string{rel}
		for q := via[p]; q != ""; q = via[q] {
			chain = append(chain, strings.TrimPrefix(q, module))
		}
		for i, j := 0, len(chain)-1; i < j; i, j = i+1, j-1 {
			chain[i], chain[j] = chain[j], chain[i]
		}
		t.Errorf("internal/sandbox depends on %s (%s): the gateway is built on the manager, not the other way round", rel, strings.Join(chain, " → "))
	}
}
