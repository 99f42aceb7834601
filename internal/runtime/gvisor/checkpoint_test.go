package gvisor_test

import (
	"context"
	"testing"

	"github.com/spacehq/space/internal/testenv"
)

func TestProbeCheckpoint(t *testing.T) {
	requireRunsc(t)
	rt := newRuntime(t, testenv.AgentBinary(t))
	c := rt.Probe(context.Background())
	t.Logf("verbs %v reasons %v details %v", c.Verbs, c.VerbReasons, c.Details)
	if !c.Verbs["suspend"] {
		t.Fatal(c.VerbReasons["suspend"])
	}
}
