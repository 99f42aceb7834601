package policy

import (
	"sort"
	"strings"
	"time"

	"github.com/spacehq/space/internal/actions"
)

// Act is an action as CEL rules see it: `action` is one, `history` a list
// of them (oldest first, each with the verdict it got). It is the one
// action type (actions.Action, whose cel tags are the field names rules
// use; a name not there is a compile error) and its verdict. The action is
// embedded through an unexported name so that CEL sees its fields and not
// the embedded struct itself.
type Act struct {
	action
	// Verdict is what the action got ("allow" or "deny"); "" for the
	// action being decided.
	Verdict string `cel:"verdict"`
}

// action names actions.Action for embedding in Act without an exported
// (CEL-visible) field name.
type action = actions.Action

// subject is what seen() matches a prefix against: the path of files and
// HTTP actions, the name of DNS queries, connections and secrets' hosts,
// the program of an exec, the secret's name, the verb.
func (a *Act) subject() string {
	switch a.Kind {
	case actions.FileRead, actions.FileWrite, actions.FileDelete:
		return a.Path
	case actions.DNS, actions.Connect, actions.HTTP:
		return a.Name
	case actions.Exec:
		if len(a.Argv) > 0 {
			return a.Argv[0]
		}
		return ""
	case actions.SecretUse:
		return a.Secret
	case actions.Lifecycle:
		return a.Verb
	}
	return ""
}

// pathKind reports whether kind's subject is a path, which seen() matches
// by directory (prefix "/data/pii" covers "/data/pii/x", not "/data/piix").
func pathKind(kind string) bool {
	return kind == actions.FileRead || kind == actions.FileWrite || kind == actions.FileDelete
}

func hasPrefix(kind, subject, prefix string) bool {
	if prefix == "" {
		return true
	}
	if !pathKind(kind) || strings.HasSuffix(prefix, "/") {
		return strings.HasPrefix(subject, prefix)
	}
	return subject == prefix || strings.HasPrefix(subject, prefix+"/")
}

// DefaultHistoryLen is how many actions a sandbox's history keeps.
const DefaultHistoryLen = 10000

// maxDistinct bounds the distinct subjects remembered per history for
// seen(); past it, a prefix asked for the first time may miss subjects
// that were evicted from the action list.
const maxDistinct = 10000

// History is one sandbox's past actions, newest last, bounded. It keeps an
// index per kind (count() binary-searches its window) and, for seen(), the
// distinct subjects of allowed actions and a memo per asked (kind, prefix)
// that stays true after the actions that made it true are evicted: "after
// any read under /data/pii" must not be forgotten 10k actions later.
// Not safe for concurrent use: the engine holds its sandbox's lock.
type History struct {
	max   int
	acts  []Act // acts[start:] are live
	start int
	first uint64 // sequence number of acts[0]
	kinds map[string]*kindIndex
	// distinct subjects of allowed actions per kind; memo of seen().
	distinct  map[string]map[string]struct{}
	ndistinct int
	memo      map[seenKey]bool
	last      time.Time
}

type kindIndex struct {
	seqs  []uint64 // ascending; seqs[start:] live
	start int
}

type seenKey struct{ kind, prefix string }

// NewHistory returns an empty history keeping at most max actions
// (DefaultHistoryLen if max <= 0).
func NewHistory(max int) *History {
	if max <= 0 {
		max = DefaultHistoryLen
	}
	return &History{max: max, kinds: map[string]*kindIndex{}, distinct: map[string]map[string]struct{}{}, memo: map[seenKey]bool{}}
}

// Len is the number of actions kept.
func (h *History) Len() int { return len(h.acts) - h.start }

// Acts returns the kept actions, oldest first. The slice is the history's
// own: read it only while nothing appends.
func (h *History) Acts() []Act { return h.acts[h.start:] }

func (h *History) at(seq uint64) *Act { return &h.acts[seq-h.first] }

// Append records a decided action with the verdict it got. Times are kept
// non-decreasing (an earlier time than the last one's is raised to it) so
// windows can be binary-searched.
func (h *History) Append(act actions.Action, v actions.Verdict) {
	a := Act{action: act, Verdict: string(v)}
	if a.Time.Before(h.last) {
		a.Time = h.last
	}
	h.last = a.Time
	seq := h.first + uint64(len(h.acts))
	h.acts = append(h.acts, a)
	ki := h.kinds[a.Kind]
	if ki == nil {
		ki = &kindIndex{}
		h.kinds[a.Kind] = ki
	}
	ki.seqs = append(ki.seqs, seq)
	if a.Verdict == string(actions.Allow) {
		h.remember(&a)
	}
	if h.Len() > h.max {
		h.evict()
	}
}

func (h *History) evict() {
	old := &h.acts[h.start]
	ki := h.kinds[old.Kind]
	ki.start++
	if ki.start == len(ki.seqs) {
		delete(h.kinds, old.Kind)
	} else if ki.start > 1024 && ki.start > len(ki.seqs)/2 {
		ki.seqs = append([]uint64(nil), ki.seqs[ki.start:]...)
		ki.start = 0
	}
	h.acts[h.start] = Act{}
	h.start++
	if h.start >= h.max {
		// Compact: the live tail moves to a fresh array, once per max appends.
		n := make([]Act, h.Len(), h.max+h.max/2)
		copy(n, h.acts[h.start:])
		h.first += uint64(h.start)
		h.acts, h.start = n, 0
	}
}

func (h *History) remember(a *Act) {
	s := a.subject()
	for k, v := range h.memo {
		if !v && k.kind == a.Kind && hasPrefix(a.Kind, s, k.prefix) {
			h.memo[k] = true
		}
	}
	set := h.distinct[a.Kind]
	if set == nil {
		set = map[string]struct{}{}
		h.distinct[a.Kind] = set
	}
	if _, ok := set[s]; !ok && h.ndistinct < maxDistinct {
		set[s] = struct{}{}
		h.ndistinct++
	}
}

// Seen reports whether an allowed action of kind whose subject is under
// prefix ever happened (since the server started). The first question for
// a (kind, prefix) scans the distinct subjects; later ones are a map read.
func (h *History) Seen(kind, prefix string) bool {
	k := seenKey{kind, prefix}
	if v, ok := h.memo[k]; ok {
		return v
	}
	v := false
	for s := range h.distinct[kind] {
		if hasPrefix(kind, s, prefix) {
			v = true
			break
		}
	}
	if len(h.memo) < 4096 {
		h.memo[k] = v
	}
	return v
}

// Filter narrows count(): each set field must equal the action's (Argv0
// its first argument; PathPrefix is seen()'s match on the path). Verdict
// "" counts allowed actions only: a denied action did not happen.
type Filter struct {
	Name, Path, PathPrefix, Method, IP, SNI, User, Cwd, Exe, Verb, Secret, Argv0, Verdict string
	Port                                                                                  int
}

func (f *Filter) match(a *Act) bool {
	v := f.Verdict
	if v == "" {
		v = string(actions.Allow)
	}
	if v != "any" && a.Verdict != v {
		return false
	}
	eq := func(want, got string) bool { return want == "" || want == got }
	if !eq(f.Name, a.Name) || !eq(f.Path, a.Path) || !eq(f.Method, a.Method) || !eq(f.IP, a.IP) || !eq(f.SNI, a.SNI) ||
		!eq(f.User, a.User) || !eq(f.Cwd, a.Cwd) || !eq(f.Exe, a.Exe) || !eq(f.Verb, a.Verb) || !eq(f.Secret, a.Secret) {
		return false
	}
	if f.Port != 0 && f.Port != a.Port {
		return false
	}
	if f.Argv0 != "" && (len(a.Argv) == 0 || a.Argv[0] != f.Argv0) {
		return false
	}
	if f.PathPrefix != "" && !hasPrefix(a.Kind, a.Path, f.PathPrefix) {
		return false
	}
	return true
}

// Count is the number of actions of kind later than since that f matches.
// It binary-searches the kind's index for since and scans only the window.
func (h *History) Count(kind string, since time.Time, f *Filter) int {
	ki := h.kinds[kind]
	if ki == nil {
		return 0
	}
	seqs := ki.seqs[ki.start:]
	i := sort.Search(len(seqs), func(i int) bool { return h.at(seqs[i]).Time.After(since) })
	n := 0
	for _, s := range seqs[i:] {
		if f.match(h.at(s)) {
			n++
		}
	}
	return n
}
