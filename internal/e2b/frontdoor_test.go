package e2b

import "testing"

// TestEveryRouteSaysItsActions: every route the handler registers is in
// FrontDoorActions and the table names no route the handler lacks, so a
// new E2B route must say what it can cause and e2e's front-door matrix
// then needs a row for it.
func TestEveryRouteSaysItsActions(t *testing.T) {
	h := New(Config{})
	seen := map[string]bool{}
	for _, p := range h.patterns {
		if seen[p] {
			t.Errorf("route %s is registered twice", p)
		}
		seen[p] = true
		if _, ok := FrontDoorActions[p]; !ok {
			t.Errorf("route %s is not in FrontDoorActions: say which policy actions it can cause (nil for none)", p)
		}
	}
	for p := range FrontDoorActions {
		if !seen[p] {
			t.Errorf("FrontDoorActions names %s, which the handler does not route", p)
		}
	}
}
