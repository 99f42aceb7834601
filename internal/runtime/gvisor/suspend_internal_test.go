package gvisor

import (
	"testing"

	"github.com/spacehq/space/internal/agent"
)

// The runtime writes the marker the agent waits for.
func TestResumeMarkerMatchesAgent(t *testing.T) {
	if want := agentSock + agent.ResumeSuffix; resumeMarker != want {
		t.Fatalf("resumeMarker %q, the agent waits for %q", resumeMarker, want)
	}
}
