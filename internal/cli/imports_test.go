package cli

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestClientCommandsUseOnlySDK holds the CLI to what docs/ARCHITECTURE.md
// says: client commands reach a server only through the SDK and use only
// package api besides; the host-side commands are in package hostcli
// (linked only into space-server), reached through Host.
func TestClientCommandsUseOnlySDK(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	// internal/audit/chain is imported by audit.go for Verify, a pure
	// function over an export file (`space audit verify` works offline).
	allowed := map[string]bool{"github.com/spacehq/space/api": true, "github.com/spacehq/space/sdk": true,
		"github.com/spacehq/space/internal/audit/chain": true}
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		for _, imp := range af.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(p, "github.com/spacehq/space/") && !allowed[p] {
				t.Errorf("%s imports %s: a client command may use only the SDK and package api (host-side code goes in package hostcli)", f, p)
			}
			if p == "net/http" {
				t.Errorf("%s imports net/http: the CLI speaks HTTP only through the SDK", f)
			}
		}
	}
	if checked < 5 {
		t.Fatalf("only %d files checked", checked)
	}
}

// TestMCPServerUsesOnlySDK keeps the exception above honest: the MCP server
// the CLI runs reaches a server only through the SDK too.
func TestMCPServerUsesOnlySDK(t *testing.T) {
	files, err := filepath.Glob("../mcpserver/*.go")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		for _, imp := range af.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(p, "github.com/spacehq/space/") && p != "github.com/spacehq/space/api" && p != "github.com/spacehq/space/sdk" {
				t.Errorf("%s imports %s: the MCP server may use only the SDK and package api", f, p)
			}
			if p == "net/http" {
				t.Errorf("%s imports net/http: the MCP server speaks HTTP only through the SDK", f)
			}
		}
	}
	if checked < 3 {
		t.Fatalf("only %d files checked", checked)
	}
}
