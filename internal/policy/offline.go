package policy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
)

// ReadActions reads JSON Lines of actions (blank lines skipped; unknown
// fields refused), at most max lines.
func ReadActions(r io.Reader, max int) ([]api.PolicyAction, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var out []api.PolicyAction
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		if len(out) >= max {
			return nil, fmt.Errorf("more than %d actions: %w", max, errdefs.ErrInvalidArgument)
		}
		var a api.PolicyAction
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&a); err != nil {
			return nil, fmt.Errorf("line %d: %w: %w", n, err, errdefs.ErrInvalidArgument)
		}
		if a.Kind == "" {
			return nil, fmt.Errorf("line %d: kind is required: %w", n, errdefs.ErrInvalidArgument)
		}
		out = append(out, a)
	}
	return out, sc.Err()
}

// Test evaluates rs offline over a recorded history: each action gets the
// verdict rs gives it with the actions before it (and their verdicts) as
// history, as the engine would have decided them in order; then, if extra
// is set, extra gets the verdict given all of them. An action's own time is
// its "now" (a missing time is the previous action's). An "ask" is
// reported as ask and joins the history as not having happened (as a
// timeout would have it). Pure: no server, no clock.
func Test(rs api.PolicyRuleSet, history []api.PolicyAction, extra *api.PolicyAction) ([]api.PolicyTestResult, error) {
	c, err := Compile(rs)
	if err != nil {
		return nil, err
	}
	sets := []*RuleSet{c}
	h := NewHistory(len(history) + 1)
	var last time.Time
	var out []api.PolicyTestResult
	run := func(line int, a api.PolicyAction) (api.PolicyAction, actions.Verdict) {
		if a.Time.IsZero() {
			a.Time = last
		}
		last = a.Time
		r := Evaluate(context.Background(), sets, a, h, a.Time)
		out = append(out, api.PolicyTestResult{Line: line, Action: a, Verdict: string(r.Verdict), Rule: r.Rule, Reason: r.Reason})
		if r.Verdict == actions.Ask {
			return a, actions.Deny
		}
		return a, r.Verdict
	}
	for i, a := range history {
		h.Append(run(i+1, a))
	}
	if extra != nil {
		run(0, *extra)
	}
	return out, nil
}
