package agentclient_test

import (
	"os"
	"testing"

	"github.com/spacehq/space/internal/testenv"
)

// TestMain finds or builds the agent binary before any test runs. The
// in-process agents of client_test.go start a process-wide reaper
// (wait4(-1) on every SIGCHLD) that can collect the exit status of `go
// build` before exec.Cmd.Wait does, so building it inside whichever test
// needs it first made the binary tests depend on running first (their file
// was named to sort first). Errors are reported by testenv.AgentBinary in
// the tests that need it.
func TestMain(m *testing.M) {
	_ = testenv.PrepareAgentBinary()
	os.Exit(m.Run())
}
