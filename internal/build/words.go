package build

import (
	"fmt"
	"strings"
)

// This file holds the small part of a shell a build file needs, with
// Docker's rules: splitting arguments into words (quotes group, a backslash
// escapes) and expanding a word (quotes removed, $VAR, ${VAR},
// ${VAR:-default} and ${VAR:+alternative} replaced from the build's
// environment). Expansion results are never split into more words and
// never globbed.

// lookupFunc returns an environment variable's value.
type lookupFunc func(name string) (string, bool)

// splitWords splits s at unquoted, unescaped blanks, keeping quotes and
// escapes in the words (expandWord removes them).
func splitWords(s string) ([]string, error) {
	var (
		words []string
		start = -1
		quote byte
	)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0:
			if c == '\\' && quote == '"' && i+1 < len(s) {
				i++
			} else if c == quote {
				quote = 0
			}
			continue
		case c == ' ' || c == '\t' || c == '\n':
			if start >= 0 {
				words = append(words, s[start:i])
				start = -1
			}
			continue
		}
		if start < 0 {
			start = i
		}
		switch c {
		case '\\':
			i++ // the next byte is literal
		case '"', '\'':
			quote = c
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated %c quote", quote)
	}
	if start >= 0 {
		words = append(words, s[start:])
	}
	return words, nil
}

// expandWord removes quotes and escapes from word and expands variables
// (not inside single quotes). Unset variables expand to nothing.
func expandWord(word string, lookup lookupFunc) (string, error) {
	x := expander{s: word, lookup: lookup}
	out, err := x.process(0)
	if err != nil {
		return "", err
	}
	if x.pos < len(x.s) {
		return "", fmt.Errorf("unexpected %q in %q", x.s[x.pos], word)
	}
	return out, nil
}

type expander struct {
	s      string
	pos    int
	lookup lookupFunc
}

// process consumes the input up to stop (not consumed; 0: the end).
func (x *expander) process(stop byte) (string, error) {
	var b strings.Builder
	for x.pos < len(x.s) {
		c := x.s[x.pos]
		if stop != 0 && c == stop {
			return b.String(), nil
		}
		switch c {
		case '\\':
			x.pos++
			if x.pos < len(x.s) {
				b.WriteByte(x.s[x.pos])
				x.pos++
			} else {
				b.WriteByte('\\')
			}
		case '\'':
			end := strings.IndexByte(x.s[x.pos+1:], '\'')
			if end < 0 {
				return "", fmt.Errorf("unterminated ' quote in %q", x.s)
			}
			b.WriteString(x.s[x.pos+1 : x.pos+1+end])
			x.pos += end + 2
		case '"':
			x.pos++
			if err := x.doubleQuoted(&b); err != nil {
				return "", err
			}
		case '$':
			v, err := x.dollar()
			if err != nil {
				return "", err
			}
			b.WriteString(v)
		default:
			b.WriteByte(c)
			x.pos++
		}
	}
	if stop != 0 {
		return "", fmt.Errorf("missing %q in %q", stop, x.s)
	}
	return b.String(), nil
}

// doubleQuoted consumes the inside of "…" and its closing quote. A
// backslash escapes only ", \ and $ there, as in sh.
func (x *expander) doubleQuoted(b *strings.Builder) error {
	for x.pos < len(x.s) {
		c := x.s[x.pos]
		switch c {
		case '"':
			x.pos++
			return nil
		case '\\':
			if x.pos+1 < len(x.s) && strings.IndexByte(`"\$`, x.s[x.pos+1]) >= 0 {
				b.WriteByte(x.s[x.pos+1])
				x.pos += 2
				continue
			}
			b.WriteByte(c)
			x.pos++
		case '$':
			v, err := x.dollar()
			if err != nil {
				return err
			}
			b.WriteString(v)
		default:
			b.WriteByte(c)
			x.pos++
		}
	}
	return fmt.Errorf("unterminated \" quote in %q", x.s)
}

func isNameByte(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// dollar expands the reference at x.pos (a '$').
func (x *expander) dollar() (string, error) {
	x.pos++ // '$'
	if x.pos >= len(x.s) {
		return "$", nil
	}
	if x.s[x.pos] != '{' {
		start := x.pos
		for x.pos < len(x.s) && isNameByte(x.s[x.pos]) {
			x.pos++
		}
		if x.pos == start {
			return "$", nil // a lone dollar is literal
		}
		v, _ := x.lookup(x.s[start:x.pos])
		return v, nil
	}
	x.pos++ // '{'
	start := x.pos
	for x.pos < len(x.s) && isNameByte(x.s[x.pos]) {
		x.pos++
	}
	name := x.s[start:x.pos]
	if name == "" || x.pos >= len(x.s) {
		return "", fmt.Errorf("bad substitution in %q", x.s)
	}
	if x.s[x.pos] == '}' {
		x.pos++
		v, _ := x.lookup(name)
		return v, nil
	}
	if x.s[x.pos] != ':' || x.pos+1 >= len(x.s) || (x.s[x.pos+1] != '-' && x.s[x.pos+1] != '+') {
		return "", fmt.Errorf("bad substitution in %q: only ${VAR}, ${VAR:-default} and ${VAR:+alternative} are supported", x.s)
	}
	op := x.s[x.pos+1]
	x.pos += 2
	word, err := x.process('}')
	if err != nil {
		return "", err
	}
	x.pos++ // '}'
	v, ok := x.lookup(name)
	set := ok && v != ""
	switch {
	case op == '-' && !set:
		return word, nil
	case op == '+' && set:
		return word, nil
	case op == '+':
		return "", nil
	}
	return v, nil
}

// placeholder stands for every variable when a build file is checked
// before its environment is known: it keeps words non-empty.
func placeholder(string) (string, bool) { return "x", true }

// expandAll splits s into words and expands each.
func expandAll(s string, lookup lookupFunc) ([]string, error) {
	raw, err := splitWords(s)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(raw))
	for i, w := range raw {
		if out[i], err = expandWord(w, lookup); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// mapLookup looks names up in env.
func mapLookup(env map[string]string) lookupFunc {
	return func(name string) (string, bool) {
		v, ok := env[name]
		return v, ok
	}
}
