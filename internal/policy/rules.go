package policy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	"cel.dev/cel-go/cel"
	"cel.dev/cel-go/common/ast"
	"cel.dev/cel-go/common/types"
	"cel.dev/cel-go/common/types/ref"
	"cel.dev/cel-go/common/types/traits"
	"cel.dev/cel-go/ext"
	"go.yaml.in/yaml/v3"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
)

// Limits of a rule set.
const (
	MaxRules      = 1000
	MaxMatchBytes = 4096
	maxNameBytes  = 128
	// DefaultCostLimit bounds one rule's evaluation in CEL's cost units
	// (roughly one per operation): a scan of a full 10k history fits, a
	// nested scan of it does not. A rule over it denies.
	DefaultCostLimit = 300_000
	// ruleTimeout is the wall-clock bound beside the cost limit, for what
	// CEL's cost model undercounts (long string operations).
	ruleTimeout = 500 * time.Millisecond
)

// Rule is one compiled rule.
type Rule struct {
	api.PolicyRule
	prg cel.Program
}

// RuleSet is a compiled rule set.
type RuleSet struct {
	Scope string
	Rules []Rule
	Src   api.PolicyRuleSet
}

var (
	envOnce sync.Once
	celEnv  *cel.Env
	envErr  error
)

// filterKeys are the keys a count() filter map may have.
var filterKeys = map[string]bool{"name": true, "path": true, "path_prefix": true, "method": true, "ip": true, "sni": true,
	"user": true, "cwd": true, "exe": true, "verb": true, "secret": true, "argv0": true, "verdict": true, "port": true}

// env is the one CEL environment of rules: variables action, history, now
// and the history functions count() and seen(), bound late to the
// sandbox's history at each evaluation.
func env() (*cel.Env, error) {
	envOnce.Do(func() {
		actT := cel.ObjectType("policy.Act")
		celEnv, envErr = cel.NewEnv(
			ext.NativeTypes(reflect.TypeFor[Act](), ext.ParseStructTags(true)),
			ext.Strings(),
			cel.Variable("action", actT),
			cel.Variable("history", cel.ListType(actT)),
			cel.Variable("now", cel.TimestampType),
			cel.Function("count",
				cel.Overload("count_kind_window", []*cel.Type{cel.StringType, cel.DurationType}, cel.IntType, cel.LateFunctionBinding()),
				cel.Overload("count_kind_window_filter", []*cel.Type{cel.StringType, cel.DurationType, cel.MapType(cel.StringType, cel.DynType)}, cel.IntType, cel.LateFunctionBinding())),
			cel.Function("seen",
				cel.Overload("seen_kind", []*cel.Type{cel.StringType}, cel.BoolType, cel.LateFunctionBinding()),
				cel.Overload("seen_kind_prefix", []*cel.Type{cel.StringType, cel.StringType}, cel.BoolType, cel.LateFunctionBinding())),
			cel.Function("under",
				cel.Overload("under_path_prefix", []*cel.Type{cel.StringType, cel.StringType}, cel.BoolType,
					cel.BinaryBinding(func(p, pre ref.Val) ref.Val {
						return types.Bool(hasPrefix(actions.FileRead, string(p.(types.String)), string(pre.(types.String))))
					}))),
		)
	})
	return celEnv, envErr
}

// Parse reads a rule set from YAML or JSON (JSON is YAML), refusing
// unknown fields.
func Parse(data []byte) (api.PolicyRuleSet, error) {
	var rs api.PolicyRuleSet
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&rs); err != nil {
		return rs, fmt.Errorf("rule set: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	return rs, nil
}

// Compile checks and compiles a rule set. Every problem is an
// ErrInvalidArgument naming the rule; CEL errors keep CEL's message with
// its line:column and a caret under the position.
func Compile(rs api.PolicyRuleSet) (*RuleSet, error) {
	e, err := env()
	if err != nil {
		return nil, err
	}
	if len(rs.Rules) > MaxRules {
		return nil, fmt.Errorf("rule set has %d rules, more than %d: %w", len(rs.Rules), MaxRules, errdefs.ErrInvalidArgument)
	}
	out := &RuleSet{Scope: rs.Scope, Src: rs}
	names := map[string]bool{}
	for i, r := range rs.Rules {
		where := fmt.Sprintf("rules[%d]", i)
		if r.Name != "" {
			where += fmt.Sprintf(" (%q)", r.Name)
		}
		switch {
		case r.Name == "":
			return nil, fmt.Errorf("%s: name is required: %w", where, errdefs.ErrInvalidArgument)
		case len(r.Name) > maxNameBytes || strings.ContainsFunc(r.Name, func(c rune) bool { return c < 0x20 || c == 0x7f }):
			return nil, fmt.Errorf("%s: name must be at most %d bytes without control characters: %w", where, maxNameBytes, errdefs.ErrInvalidArgument)
		case names[r.Name]:
			return nil, fmt.Errorf("%s: name is used twice: %w", where, errdefs.ErrInvalidArgument)
		case r.Verdict != string(actions.Allow) && r.Verdict != string(actions.Deny) && r.Verdict != string(actions.Ask):
			return nil, fmt.Errorf("%s: verdict must be allow, deny or ask, got %q: %w", where, r.Verdict, errdefs.ErrInvalidArgument)
		case strings.TrimSpace(r.Match) == "":
			return nil, fmt.Errorf("%s: match is required (a CEL expression; \"true\" matches every action): %w", where, errdefs.ErrInvalidArgument)
		case len(r.Match) > MaxMatchBytes:
			return nil, fmt.Errorf("%s: match is %d bytes, more than %d: %w", where, len(r.Match), MaxMatchBytes, errdefs.ErrInvalidArgument)
		case len(r.Reason) > 1024:
			return nil, fmt.Errorf("%s: reason is more than 1024 bytes: %w", where, errdefs.ErrInvalidArgument)
		}
		names[r.Name] = true
		checked, iss := e.Compile(r.Match)
		if iss.Err() != nil {
			return nil, fmt.Errorf("%s: match: %s: %w", where, iss.Err(), errdefs.ErrInvalidArgument)
		}
		if !checked.OutputType().IsExactType(cel.BoolType) {
			return nil, fmt.Errorf("%s: match must be a bool expression, this one is %s: %w", where, checked.OutputType(), errdefs.ErrInvalidArgument)
		}
		if err := checkFilters(checked.NativeRep(), r.Match); err != nil {
			return nil, fmt.Errorf("%s: match: %w", where, err)
		}
		prg, err := e.Program(checked, cel.CostLimit(DefaultCostLimit), cel.InterruptCheckFrequency(64))
		if err != nil {
			return nil, fmt.Errorf("%s: match: %w: %w", where, err, errdefs.ErrInvalidArgument)
		}
		out.Rules = append(out.Rules, Rule{PolicyRule: r, prg: prg})
	}
	return out, nil
}

// checkFilters refuses, at compile time, a literal count() filter map with
// a key count() does not know (a typo would otherwise count everything).
func checkFilters(a *ast.AST, src string) error {
	var bad error
	ast.PostOrderVisit(a.Expr(), ast.NewExprVisitor(func(e ast.Expr) {
		if bad != nil || e.Kind() != ast.CallKind || e.AsCall().FunctionName() != "count" || len(e.AsCall().Args()) != 3 {
			return
		}
		m := e.AsCall().Args()[2]
		if m.Kind() != ast.MapKind {
			return
		}
		for _, ent := range m.AsMap().Entries() {
			k := ent.AsMapEntry().Key()
			if k.Kind() != ast.LiteralKind {
				continue
			}
			s, ok := k.AsLiteral().(types.String)
			if !ok || !filterKeys[string(s)] {
				loc := a.SourceInfo().GetStartLocation(k.ID())
				bad = fmt.Errorf("count() filter key %v at %d:%d is not one of %s: %w", k.AsLiteral(), loc.Line(), loc.Column()+1,
					strings.Join(sortedKeys(filterKeys), ", "), errdefs.ErrInvalidArgument)
				return
			}
		}
	}))
	return bad
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

// Result is the verdict of the rule sets on one action.
type Result struct {
	Verdict actions.Verdict
	Rule    string // "scope/name" of the deciding rule ("name" without a scope)
	Reason  string
}

// evaluation is the per-action state the late-bound functions close over.
type evaluation struct {
	hist *History
	now  time.Time
}

func (ev *evaluation) count(_ string, args ...ref.Val) ref.Val {
	kind, ok := args[0].(types.String)
	if !ok {
		return types.NewErr("count: kind must be a string")
	}
	win, ok := args[1].(types.Duration)
	if !ok {
		return types.NewErr("count: window must be a duration")
	}
	var f Filter
	if len(args) == 3 {
		m, ok := args[2].(traits.Mapper)
		if !ok {
			return types.NewErr("count: filter must be a map")
		}
		it := m.Iterator()
		for it.HasNext() == types.True {
			k := it.Next()
			ks, ok := k.(types.String)
			if !ok || !filterKeys[string(ks)] {
				return types.NewErr("count: unknown filter key %v", k)
			}
			v := m.Get(k)
			if ks == "port" {
				p, ok := v.(types.Int)
				if !ok {
					return types.NewErr("count: filter port must be an int")
				}
				f.Port = int(p)
				continue
			}
			s, ok := v.(types.String)
			if !ok {
				return types.NewErr("count: filter %s must be a string", ks)
			}
			switch ks {
			case "name":
				f.Name = string(s)
			case "path":
				f.Path = string(s)
			case "path_prefix":
				f.PathPrefix = string(s)
			case "method":
				f.Method = string(s)
			case "ip":
				f.IP = string(s)
			case "sni":
				f.SNI = string(s)
			case "user":
				f.User = string(s)
			case "cwd":
				f.Cwd = string(s)
			case "exe":
				f.Exe = string(s)
			case "verb":
				f.Verb = string(s)
			case "secret":
				f.Secret = string(s)
			case "argv0":
				f.Argv0 = string(s)
			case "verdict":
				f.Verdict = string(s)
			}
		}
	}
	return types.Int(ev.hist.Count(string(kind), ev.now.Add(-win.Duration), &f))
}

func (ev *evaluation) seen(_ string, args ...ref.Val) ref.Val {
	kind, ok := args[0].(types.String)
	if !ok {
		return types.NewErr("seen: kind must be a string")
	}
	prefix := ""
	if len(args) == 2 {
		p, ok := args[1].(types.String)
		if !ok {
			return types.NewErr("seen: prefix must be a string")
		}
		prefix = string(p)
	}
	return types.Bool(ev.hist.Seen(string(kind), prefix))
}

// Evaluate runs every rule of sets (in order) on action a given hist: deny wins
// over ask, ask over allow, no match allows; a deny stops the evaluation.
// A rule that fails to evaluate — over its cost limit, too slow, a runtime
// error — denies (fail closed) with a reason saying so. hist is only read.
func Evaluate(ctx context.Context, sets []*RuleSet, a actions.Action, hist *History, now time.Time) Result {
	res := Result{Verdict: actions.Allow}
	if len(sets) == 0 {
		return res
	}
	ev := &evaluation{hist: hist, now: now}
	vars, err := cel.FunctionVars(map[string]any{
		"action":  Act{action: a}, // no verdict yet
		"history": func() any { return hist.Acts() },
		"now":     now,
	}, map[string]cel.LateBoundFunction{"count": ev.count, "seen": ev.seen})
	if err != nil {
		return Result{Verdict: actions.Deny, Reason: "policy evaluation failed: " + err.Error()}
	}
	for _, rs := range sets {
		for i := range rs.Rules {
			r := &rs.Rules[i]
			name := r.Name
			if rs.Scope != "" {
				name = rs.Scope + "/" + r.Name
			}
			rctx, cancel := context.WithTimeout(ctx, ruleTimeout)
			out, _, err := r.prg.ContextEval(rctx, vars)
			cancel()
			if err != nil {
				why := "could not be evaluated: " + err.Error()
				switch {
				case strings.Contains(err.Error(), "cost limit exceeded"):
					why = fmt.Sprintf("exceeded its evaluation cost limit (%d)", DefaultCostLimit)
				case errors.Is(rctx.Err(), context.DeadlineExceeded), strings.Contains(err.Error(), "interrupted"):
					why = fmt.Sprintf("took longer than %v to evaluate", ruleTimeout)
				}
				return Result{Verdict: actions.Deny, Rule: name, Reason: fmt.Sprintf("rule %s %s; failing closed", name, why)}
			}
			if b, ok := out.(types.Bool); !ok || !bool(b) {
				continue
			}
			v := actions.Verdict(r.Verdict)
			reason := r.Reason
			if reason == "" {
				reason = fmt.Sprintf("rule %s says %s", name, v)
			}
			switch {
			case v == actions.Deny:
				return Result{Verdict: v, Rule: name, Reason: reason}
			case v == actions.Ask && res.Verdict != actions.Ask:
				res = Result{Verdict: v, Rule: name, Reason: reason}
			case v == actions.Allow && res.Verdict == actions.Allow && res.Rule == "":
				res = Result{Verdict: v, Rule: name, Reason: reason}
			}
		}
	}
	return res
}
