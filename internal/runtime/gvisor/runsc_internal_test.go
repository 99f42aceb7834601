package gvisor

import (
	"context"
	"errors"
	"os"
	"testing"

	"github.com/spacehq/space/internal/testenv"
)

// TestRunscErrorKinds: the real runsc's messages are classified into the
// container sentinels that Start, Restore and Sweep act on.
func TestRunscErrorKinds(t *testing.T) {
	testenv.RequireRoot(t)
	bin, err := findRunsc()
	_, serr := os.Stat(bin)
	testenv.Require(t, "runsc", err == nil && serr == nil, "scripts/setup.sh builds bin/runsc")
	rs := &runsc{bin: bin, root: t.TempDir(), flags: globalFlags()}
	ctx := context.Background()
	_, err = rs.run(ctx, 0, "state", "no-such-sandbox")
	if !errors.Is(err, errContainerNotExist) {
		t.Fatalf("runsc state of a missing container: %v, want errContainerNotExist", err)
	}
	if errors.Is(err, errContainerExists) {
		t.Fatalf("a missing container also classified as existing: %v", err)
	}
	if err := rs.deleteForce(ctx, "no-such-sandbox"); err != nil {
		t.Fatalf("deleteForce of a missing container: %v", err)
	}
	// runsc's message for a second run of an id (runsc/container/state_file.go).
	exists := &RunscError{Args: []string{"run"}, Stderr: "creating container: container already exists", Err: errors.New("exit status 128")}
	if !errors.Is(exists, errContainerExists) || errors.Is(exists, errContainerNotExist) {
		t.Fatalf("%v: not classified as errContainerExists only", exists)
	}
	other := &RunscError{Args: []string{"run"}, Stderr: "boom", Err: errors.New("exit status 1")}
	if errors.Is(other, errContainerExists) || errors.Is(other, errContainerNotExist) {
		t.Fatalf("%v: classified although runsc said nothing about the container", other)
	}
}
