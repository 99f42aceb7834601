package server

import "testing"

// TestEveryRouteSaysItsActions: a route added to the table without saying
// which policy actions it can cause (FrontDoorActions) fails here, and the
// e2e front-door matrix then has to try each action it names.
func TestEveryRouteSaysItsActions(t *testing.T) {
	s := &Server{metrics: newMetrics(nil)}
	seen := map[string]bool{}
	for _, rt := range s.routeTable() {
		seen[rt.pattern] = true
		if _, ok := FrontDoorActions[rt.pattern]; !ok {
			t.Errorf("route %s is not in FrontDoorActions: say which policy actions it can cause (nil for none)", rt.pattern)
		}
	}
	for p := range FrontDoorActions {
		if !seen[p] {
			t.Errorf("FrontDoorActions names %s, which the server does not route", p)
		}
	}
}
